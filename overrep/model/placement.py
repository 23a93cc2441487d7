"""A dense model spread over devices by accelerate (``model.device_map``), and what reads it.

A teacher larger than one device can be loaded with ``model.device_map: auto`` (or
``balanced``, ``balanced_low_0``, ``sequential``): accelerate places its blocks over the
machine's GPUs, then the CPU, then (where ``model.max_memory`` caps them) a folder on disk,
and moves each block's weights and inputs where it runs. Its forward is the model's own,
so the live teacher (``cache.mode: live``), the feature cache, the criteria and the
evaluations read it unchanged, with three exceptions this module covers:

* **inputs** go to the device the embedding runs on (:func:`input_device`), not to "the
  model's device": an offloaded model's first parameter sits on the meta device;
* **weights** of an offloaded module are read one module at a time, each brought back to
  the CPU for the moment it is read (:func:`named_tensors`: the weight fingerprint);
* **the pruned model** is not a deep copy of the teacher (that would copy the teacher's
  placement, or meta tensors): :func:`placed_copy` builds an empty model of the same class
  and config and fills in only the blocks the pruned model keeps (and the blocks a stitch
  reads), on the training device. Peak memory: the pruned model, never the dense one.

One process only: under ``torchrun`` every rank would place its own copy over the same
GPUs; the streaming teacher (``cache.teacher: stream``) is the road for several ranks.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from ..errors import OverRepError
from .arch import decoder_layers

#: the placements ``model.device_map`` accepts: accelerate's strategies by name
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_placement(device_map: str | None, max_memory: dict | None) -> None:
    """The ``model.device_map`` / ``model.max_memory`` fields (the config's validation calls this)."""
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise OverRepError(f"model.device_map must be one of {', '.join(DEVICE_MAPS)} (or null), got '{device_map}'")
    if max_memory is not None:
        if device_map is None:
            raise OverRepError("model.max_memory caps the devices of model.device_map; set model.device_map: auto")
        if not isinstance(max_memory, dict) or not max_memory:
            raise OverRepError("model.max_memory must map devices to sizes, e.g. {0: 70GiB, cpu: 200GiB}")
        for device, size in max_memory.items():
            if not re.fullmatch(r"\d+|cpu|disk|mps|cuda:\d+", str(device)):
                raise OverRepError(f"model.max_memory: unknown device '{device}' (use a GPU index, cpu or disk)")
            if not re.fullmatch(r"\s*\d+(\.\d+)?\s*([KMGT]i?B)?\s*", str(size), flags=re.IGNORECASE):
                raise OverRepError(f"model.max_memory: size '{size}' for '{device}' must look like 20GiB or 500MB")


def placement_kwargs(device_map: str, max_memory: dict | None, offload_folder: Path) -> dict:
    """``from_pretrained``'s placement keywords."""
    out: dict = {"device_map": device_map, "offload_folder": str(offload_folder)}
    if max_memory:
        out["max_memory"] = {int(k) if str(k).isdigit() else str(k): str(v).replace(" ", "")
                             for k, v in max_memory.items()}
    return out


def teacher_placement(device_map: str | None, max_memory: dict | None, ranks: int, cache_root: Path):
    """``(placement keywords or None, the offload folder or None)`` for a run's dense model: the
    folder (under the cache root) lives as long as the returned object, or until its ``cleanup()``."""
    if device_map is None:
        return None, None
    if ranks > 1:
        raise OverRepError("model.device_map spreads one process's dense model over this machine's devices; "
                           "under torchrun every rank would place its own copy (use cache.teacher: stream, "
                           "or one process)")
    import tempfile

    Path(cache_root).mkdir(parents=True, exist_ok=True)
    folder = tempfile.TemporaryDirectory(prefix="offload-", dir=cache_root)
    return placement_kwargs(device_map, max_memory, Path(folder.name)), folder


def is_placed(model: nn.Module) -> bool:
    """Whether accelerate placed ``model`` (loaded with a ``device_map``)."""
    return bool(getattr(model, "hf_device_map", None))


def execution_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its accelerate hook's device, else its first parameter's
    (the CPU for a module whose weights are offloaded or that has none)."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    p = next(module.parameters(), None)
    return torch.device("cpu") if p is None or p.device.type == "meta" else p.device


def input_device(model: nn.Module) -> torch.device:
    """The device a model's input ids go to: where its embedding runs."""
    return execution_device(model.get_input_embeddings())


def _own_names(module: nn.Module) -> list[str]:
    """The parameters and persistent buffers ``module`` holds itself, in ``state_dict`` order."""
    return ([n for n, p in module._parameters.items() if p is not None]
            + [n for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set])


def _offload_owner(model: nn.Module, prefix: str) -> nn.Module | None:
    """The module whose accelerate hook holds ``prefix``'s offloaded weights: itself or its
    nearest ancestor with an offloading hook (None: its weights are real tensors)."""
    from accelerate.utils import has_offloaded_params

    parts = prefix.split(".") if prefix else []
    for n in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:n])) if n else model
        if has_offloaded_params(module):
            return module
    return None


def named_tensors(model: nn.Module, wanted: Callable[[str], bool] = lambda name: True
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``state_dict``'s items (same names, same order); an offloaded module's weights are
    brought to the CPU while its tensors are read, and sent back after.

    A tensor yielded from an offloaded module is valid until the next module is read: copy it."""
    from accelerate.utils import align_module_device

    placed = is_placed(model)
    with contextlib.ExitStack() as stack:
        current = None
        for prefix, module in model.named_modules():
            own = [f"{prefix}.{n}" if prefix else n for n in _own_names(module)]
            own = [n for n in own if wanted(n)]
            if not own:
                continue
            owner = _offload_owner(model, prefix) if placed else None
            if owner is not current:
                stack.close()
                if owner is not None:
                    stack.enter_context(align_module_device(owner, torch.device("cpu")))
                current = owner
            for name in own:
                yield name, _resolve(model, name).detach()


def _resolve(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, attr)


def layer_prefix(model: nn.Module) -> str:
    """The name of the model's decoder-block list (``model.layers`` for most families)."""
    layers = decoder_layers(model)
    return next(name for name, m in model.named_modules() if m is layers)


def placed_copy(dense: nn.Module, keep_layers: set[int], device: torch.device) -> nn.Module:
    """A copy of ``dense`` on ``device`` whose decoder blocks in ``keep_layers`` and every
    tensor outside the blocks are real; the other blocks stay on the meta device (they are
    about to be removed). Tied weights stay tied."""
    from accelerate import init_empty_weights

    with init_empty_weights():  # buffers (rotary frequencies) are computed for real
        model = type(dense)(copy.deepcopy(dense.config))
    model.generation_config = copy.deepcopy(dense.generation_config)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})  # targets: tied to their source below
    block = re.compile(rf"^{re.escape(layer_prefix(dense))}\.(\d+)\.")

    def wanted(name: str) -> bool:
        m = block.match(name)
        return name not in tied and (m is None or int(m.group(1)) in keep_layers)

    for name, tensor in named_tensors(dense, wanted):
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        value = tensor.to(device, copy=True)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=module._parameters[attr].requires_grad)
        else:
            module._buffers[attr] = value
    if tied:
        model.tie_weights()
    mine = dict(model.named_modules())
    for prefix, source in dense.named_modules():  # non-persistent buffers (rotary frequencies): the dense model's
        target = mine.get(prefix)
        for k in source._non_persistent_buffers_set if target is not None else ():
            b = source._buffers.get(k)
            if b is not None and b.device.type != "meta" and k in target._buffers:
                target._buffers[k] = b.to(device, copy=True)
    for module in model.modules():  # any other buffer computed on the CPU at construction; not the meta blocks
        for k, b in module._buffers.items():
            if b is not None and b.device.type != "meta" and b.device != device:
                module._buffers[k] = b.to(device)
    missing = [n for n, t in model.state_dict().items() if t.device.type == "meta" and wanted(n) and n not in tied]
    if missing:
        raise OverRepError(f"the placed model's copy misses {len(missing)} tensors (first: {missing[0]})")
    return model.train(dense.training)
