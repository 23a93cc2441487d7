"""What an offline task is: :class:`LocalTask` (its YAMLs, files and provenance) or :class:`Unavailable`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ...errors import OverRepError
from .sources import LM_EVAL_INSTALL, LOCAL_TAG, lm_eval_tasks_dir


@dataclass
class LocalTask:
    """One benchmark's offline lm-eval task: its name, YAML files and provenance."""

    benchmark: str
    task: str
    """lm-eval task (or group) name to evaluate, e.g. ``arc_easy_local``."""
    data: str
    """Human-readable data source."""
    data_id: str
    """Short identity of the documents; results are comparable only on equal ``data_id``."""
    eval_split: str
    fewshot_split: str | None = None
    """Split few-shot examples come from (when a few-shot count is asked for)."""
    notes: list[str] = field(default_factory=list)
    subtasks: list[str] = field(default_factory=list)
    """Leaf task names (for a group), else ``[task]``."""
    yamls: dict[str, dict] = field(default_factory=dict)
    files: dict[str, list[dict]] = field(default_factory=dict)
    """JSON-lines files to write (relative path -> documents)."""


@dataclass
class Unavailable:
    benchmark: str
    reason: str


def _stock(rel: str) -> str:
    path = lm_eval_tasks_dir() / rel
    if not path.is_file():
        raise OverRepError(f"lm-eval's stock task file {path} is missing; reinstall `{LM_EVAL_INSTALL}`")
    return str(path)


def _single_split(split: str) -> dict:
    """Split keys for a task whose only offline split is ``split`` (few-shot from it, self excluded)."""
    return {"training_split": None, "validation_split": None, "test_split": split, "fewshot_split": split}


def _task_yaml(stock_rel: str, name: str, data_path: str, data_files: dict[str, str], **overrides) -> dict:
    cfg = {"include": _stock(stock_rel), "task": name, "tag": [LOCAL_TAG], "dataset_path": data_path,
           "dataset_name": None, "dataset_kwargs": {"data_files": data_files}}
    cfg.update(overrides)
    return cfg


class NoData(Exception):
    """Raised by a builder whose benchmark has no offline copy here (the message says why)."""


class Function(str):
    """A YAML ``!function`` reference (``module.function``), as lm-eval's task loader reads it."""


def load_plain_yaml(path: Path) -> dict:
    """A stock YAML without resolving ``!function`` tags or includes (kept as plain strings)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: "!function " + loader.construct_scalar(node))
    return yaml.load(Path(path).read_text(), Loader=Loader)
