"""Export the compact model as a standard Hugging Face folder, atomically.

The folder holds safetensors weights, ``config.json``, ``generation_config.json``, the
tokenizer, and ``overrep.json`` (provenance: source model, removed blocks, method,
preset, measured merge error, training summary). It is written to a temporary sibling
folder and renamed into place only when complete, so an interrupted export never
leaves a folder that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .errors import OverRepError
from .recovery import has_wrappers

PROVENANCE_FILE = "overrep.json"


def _json_default(o):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return str(o)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def export_model(model, tokenizer, out_dir: str | Path, provenance: dict, *, overwrite: bool = False) -> Path:
    """Save the merged ``model`` and ``tokenizer`` to ``out_dir`` (atomic rename)."""
    out_dir = Path(out_dir)
    if has_wrappers(model):
        raise OverRepError("refusing to export: the model still holds overcomplete wrappers (merge it first)")
    if out_dir.exists() and not overwrite:
        raise OverRepError(f"export folder '{out_dir}' already exists; choose another or pass overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / PROVENANCE_FILE, provenance)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == 28:
            raise OverRepError(f"no space left on device while exporting to '{out_dir}'") from None
        raise OverRepError(f"cannot export to '{out_dir}': {e.strerror or e}") from None
    return out_dir
