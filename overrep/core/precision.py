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

On this project's 2-core AVX512-BF16 CPU bf16 matmuls of the recovery shapes run
2.3-2.7x faster than fp32; GPUs have bf16 tensor cores.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import OverRepError

PRECISIONS = ("fp32", "bf16")


def check_precision(value: str, where: str = "recovery.precision") -> str:
    if value not in PRECISIONS:
        raise OverRepError(f"{where} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return value


def autocast(precision: str, device: torch.device | str):
    """The context a recovery forward runs in for ``precision``."""
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
