"""Criterion results cached on disk: a data-driven criterion is a pure function of the model,
the number of blocks and the calibration rows, and LaCo's search costs minutes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..memo import digest, memoised, tensor_digest
from .criteria import Selection, get_criterion


def cached_selection(name: str, model, n: int, calibration: torch.Tensor | None, *, model_fp: str,
                     root: Path) -> Selection:
    """``get_criterion(name)(model, n, calibration)``, reused from ``root/criteria`` when possible."""
    if calibration is None:
        return get_criterion(name)(model, n, None)
    key = digest({"criterion": name, "n": n, "model": model_fp, "calibration": tensor_digest(calibration)})

    def select() -> dict:
        s = get_criterion(name)(model, n, calibration)
        return {"removed": s.removed, "replaced": s.replaced, "scores": json.dumps(s.scores)}

    saved, _ = memoised(root / "criteria" / f"{name}-{key}.pt", select, f"criterion {name}")
    return Selection(saved["removed"], saved["replaced"], json.loads(saved["scores"]))
