"""Keys and memoisation for everything cached under the cache root, defined once.

:func:`digest` keys a JSON-able description (model fingerprint, plan, settings);
:func:`tensor_digest` keys a tensor's values (calibration or probe rows); :func:`memoised`
computes a value once and stores it as a torch file under the cache root, read back on the
next call (a torn or foreign file is recomputed and replaced, never trusted).
"""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from .atomic import save_torch

log = logging.getLogger(__name__)


def digest(obj: Any, length: int = 16) -> str:
    """Short sha256 hex digest of ``obj`` as sorted-key JSON (anything else by ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:length]


def tensor_digest(tensor, length: int = 16) -> str:
    """Short sha256 hex digest of a tensor's dtype, shape and values (to key caches)."""
    h = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:length]


def memoised(path: Path, compute: Callable[[], Any], what: str, *, valid: Callable[[Any], bool] = lambda got: True,
             world=None) -> tuple[Any, bool]:
    """``compute()``, stored at ``path`` (torch format) and read back from there when a
    readable file that ``valid`` accepts is found. Returns the value and whether it was read
    back. ``world``: several ranks compute it once (rank 0), the others read rank 0's file."""
    import torch

    with world.main_first() if world is not None else nullcontext():
        if path.is_file():
            try:
                got = torch.load(path, map_location="cpu", weights_only=True)
                if valid(got):
                    log.info("%s: reusing %s", what, path)
                    return got, True
            except Exception:  # a torn or foreign file: recompute and replace it
                log.warning("%s %s is unreadable; recomputing", what, path)
        value = compute()
        save_torch(path, value, what)
        return value, False
