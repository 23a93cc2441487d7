"""Reading a YAML mapping (a run configuration, a compare grid, a preset file), defined once."""

from __future__ import annotations

from pathlib import Path

import yaml

from .errors import OverRepError


def read_yaml(path: str | Path, what: str) -> dict:
    """A YAML mapping from ``path``; one-line errors, naming ``what``, for a missing file or bad YAML."""
    p = Path(path)
    if not p.is_file():
        raise OverRepError(f"{what} '{p}' does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise OverRepError(f"{what} '{p}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise OverRepError(f"{what} '{p}' must hold a mapping")
    return data
