"""Where and on what a run executes: the device, a fingerprint of the model's weights, peak memory."""

from __future__ import annotations

import hashlib
import json
import resource

import torch

from ..errors import OverRepError
from ..memo import digest  # (the runtime's fingerprints and the caches share one digest)
from .placement import named_tensors


def model_fingerprint(model, source: str, portable: bool = False) -> str:
    """Source, config and a sample of every weight tensor: cheap, and changes with the weights.
    ``portable``: without the folder the config was read from (``_name_or_path``), the same
    in every installation (the package's shipped figures, :mod:`overrep.eval.reference`)."""
    from .onload import checkpoint_fingerprint, is_onloaded

    if is_onloaded(model):  # its blocks' weights are on disk: sampled there
        return checkpoint_fingerprint(model, source)
    h = hashlib.sha256(source.encode())
    config = model.config.to_json_string(use_diff=False)
    if portable:
        config = json.dumps({k: v for k, v in json.loads(config).items() if k != "_name_or_path"}, sort_keys=True)
    h.update(config.encode())
    for name, p in named_tensors(model):  # (a model placed by accelerate: offloaded weights read module by module)
        h.update(name.encode())
        h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def check_finite(model, what: str = "model") -> None:
    """Every weight finite, or a one-line error naming the first tensor that is not: a NaN or
    an infinity in a loaded checkpoint would otherwise run to the end and export garbage."""
    for name, p in named_tensors(model):
        if p.is_floating_point() and p.device.type != "meta" and not torch.isfinite(p).all():
            bad = int((~torch.isfinite(p)).sum())
            raise OverRepError(f"{what} weight '{name}' holds {bad} non-finite value(s) (NaN or inf); "
                               "the checkpoint is broken")


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise OverRepError(f"unknown device '{spec}'; use auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OverRepError(f"device '{spec}' requested but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise OverRepError(f"device '{spec}' requested but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: GPU memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
