"""Export the compact model as a standard Hugging Face folder, atomically.

The folder holds safetensors weights, ``config.json``, ``generation_config.json``, the
tokenizer, and ``overrep.json`` (provenance: source model, removed blocks, method,
preset, measured merge error, training summary). It is written to a temporary sibling
folder and renamed into place only when complete (:func:`overrep.atomic.write_dir`), so
an interrupted or failed export -- a full disk included -- never leaves a folder that
looks finished, nor a partial one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..atomic import json_default, write_dir
from ..errors import OverRepError
from ..model.onload import is_onloaded
from ..model.onload_export import save_onloaded
from ..model.wrap import has_wrappers

PROVENANCE_FILE = "overrep.json"


def export_model(model, tokenizer, out_dir: str | Path, provenance: dict, *, overwrite: bool = False) -> Path:
    """Save the merged ``model`` and ``tokenizer`` to ``out_dir`` (atomic rename)."""
    out_dir = Path(out_dir)
    if has_wrappers(model):
        raise OverRepError("refusing to export: the model still holds overcomplete wrappers (merge it first)")
    if out_dir.exists() and not overwrite:
        raise OverRepError(f"export folder '{out_dir}' already exists; choose another or pass overwrite")

    def write(tmp: Path) -> None:
        if is_onloaded(model):  # lazy blocks: written block by block from the source checkpoint
            save_onloaded(model, tmp)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, default=json_default) + "\n")

    return write_dir(out_dir, write, "the model folder")


def export_checked(model, tokenizer, out_dir: str | Path, provenance: dict, ids: torch.Tensor,
                   device: torch.device) -> tuple[Path, float]:
    """:func:`export_model` (replacing ``out_dir``), then the folder reloaded the way ``model``
    is held (whole by Hugging Face, or block by block when onloaded): its path and the largest
    logit difference from ``model`` on ``ids``."""
    from ..model.onload import reload

    path = export_model(model, tokenizer, out_dir, provenance, overwrite=True)
    reloaded = reload(path, model, device)
    with torch.no_grad():
        return path, (reloaded(ids.to(device)).logits - model(ids.to(device)).logits).abs().max().item()
