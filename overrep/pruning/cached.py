"""Results cached on disk under the cache root: a data-driven criterion is a pure function of
the model, the number of blocks and the calibration rows, and LaCo's search costs minutes;
:func:`memoised` is the same load-or-compute step for any such result (evaluation figures
of the dense and pruned models use it too)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

import torch

from ..atomic import save_torch
from ..model.runtime import digest
from .criteria import Selection, get_criterion

log = logging.getLogger(__name__)


def cached_selection(name: str, model, n: int, calibration: torch.Tensor | None, *, model_fp: str,
                     root: Path) -> Selection:
    """``get_criterion(name)(model, n, calibration)``, reused from ``root/criteria`` when possible."""
    if calibration is None:
        return get_criterion(name)(model, n, None)
    key = digest({"criterion": name, "n": n, "model": model_fp,
                  "calibration": hashlib.sha256(calibration.cpu().numpy().tobytes()).hexdigest()})
    path = root / "criteria" / f"{name}-{key}.pt"

    def compute() -> dict:
        selection = get_criterion(name)(model, n, calibration)
        return {"removed": selection.removed, "replaced": selection.replaced, "scores": json.dumps(selection.scores)}

    saved = memoised(path, compute, f"criterion {name}")
    return Selection(saved["removed"], saved["replaced"], json.loads(saved["scores"]))


def memoised(path: Path, compute: Callable[[], object], what: str):
    """``compute()``'s result (tensors, numbers, strings, lists and dicts of them), read back
    from ``path`` when a readable copy is there, else computed and saved there atomically."""
    if path.is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            log.info("%s: reusing %s", what, path)
            return saved
        except Exception:  # a torn or foreign file: recompute and replace it
            log.warning("%s: cache %s is unreadable; recomputing", what, path)
    result = compute()
    save_torch(path, result, f"the {what} cache")
    return result
