"""Training precision of every recovery method (``recovery.precision``): the layer-wise
recovery modules (their wrappers autocast their own forward) and the whole-model objectives
(LoRA family, full fine-tuning, logit KD, OverRep-KD, RestoreLCC: the training forward, the
KD teacher's included, runs under the autocast; validation stays fp32).

* ``fp32``: every matmul in float32 (the reference form).
* ``bf16``: the recovery module's forward runs under bf16 autocast: matmuls (and the
  elementwise work between them) in bfloat16, with float32 master weights, float32
  gradients and float32 AdamW state (autocast casts the fp32 parameters on use, so the
  optimiser never sees bf16). The loss is computed in float32. The fold at merge time
  is unchanged (float64 on the CPU, float32 on accelerators) and reads the fp32 masters,
  so the merged model is the fp32 function of the trained weights; the merge check
  compares that with the same module run in fp32.

* ``auto`` (the default): ``bf16`` where the device computes bfloat16 natively, ``fp32``
  elsewhere (:func:`resolve_precision`).

On this project's 2-core AVX512-BF16 CPU bf16 matmuls of the recovery shapes run
2.3-2.7x faster than fp32; GPUs have bf16 tensor cores. A CPU without bf16 instructions
(AVX2 only, or AVX-512 without its BF16 extension) emulates them: there a bf16 OverRep step
measured 84 s against 2-4 s in fp32 (docs/speed.md), hence ``auto``.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import OverRepError

PRECISIONS = ("auto", "fp32", "bf16")


def check_precision(value: str, where: str = "recovery.precision") -> str:
    if value not in PRECISIONS:
        raise OverRepError(f"{where} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return value


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bfloat16 matmuls in hardware: a CUDA device that reports bf16
    support, or a CPU with AVX512-BF16 or AMX tiles (what oneDNN's bf16 kernels need)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                    or getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return device.type in ("xpu", "mps")


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``precision`` with ``auto`` made concrete for ``device``: bf16 where it is native, else fp32."""
    check_precision(precision)
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device) else "fp32"


def autocast(precision: str, device: torch.device | str):
    """The context a recovery forward runs in for ``precision`` (``auto`` resolved for ``device``)."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


MODEL_DTYPES = ("float32", "bfloat16", "auto")


def resolve_model_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``model.dtype`` as a torch dtype: ``auto`` is bfloat16 where ``device`` computes it
    natively (:func:`native_bf16`: a GPU, an AVX512-BF16/AMX CPU) -- half the memory of the
    dense and pruned weights -- and float32 elsewhere, where bf16 would be emulated."""
    if name not in MODEL_DTYPES:
        raise OverRepError(f"model.dtype must be one of {', '.join(MODEL_DTYPES)}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
