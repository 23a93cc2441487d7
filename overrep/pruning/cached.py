"""Criterion results cached on disk: a data-driven criterion is a pure function of the model,
the number of blocks and the calibration rows, and LaCo's search costs minutes."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

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
    if path.is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            log.info("criterion %s: reusing %s", name, path)
            return Selection(saved["removed"], saved["replaced"], json.loads(saved["scores"]))
        except Exception:  # a torn or foreign file: recompute and replace it
            log.warning("criterion cache %s is unreadable; recomputing", path)
    selection = get_criterion(name)(model, n, calibration)
    save_torch(path, {"removed": selection.removed, "replaced": selection.replaced,
                      "scores": json.dumps(selection.scores)}, "the criterion cache")
    return selection
