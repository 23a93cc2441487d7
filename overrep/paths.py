"""The project's cache root, defined once: ``$OVERREP_CACHE``, else ``~/.cache/overrep``.

Converted models, feature caches, criterion results, loss constants and offline lm-eval
task folders all live under it (a run's ``cache.dir`` overrides it for that run's caches).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("OVERREP_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "overrep"
