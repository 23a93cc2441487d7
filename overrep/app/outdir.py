"""A run's output folder: when it may be written, replaced or resumed, and undoing a failed start.

Rules (docs/configuration.md, "What happens when things go wrong", describes them for users):

* Nothing is written before the whole run has validated (configuration, model, data,
  plan): :meth:`RunFolder.check` only looks, :meth:`RunFolder.open` is the first write.
* ``--overwrite`` replaces only a folder that is empty or holds nothing but what overrep
  writes; a folder with any other file is refused. The old run is not deleted up front:
  it is moved aside to a hidden sibling (``.NAME.replaced``) and deleted only when the new
  run finishes, so a new run that fails before it has trained anything gives it back.
* ``--resume`` needs a run to resume (a ``config.yaml``).
* A run that fails before its first checkpoint leaves the disk as it found it (its
  ``config.yaml`` and ``plan.json`` are removed, a replaced run is restored), so the
  corrected command simply runs. A run that has checkpoints stays, to be resumed.
* ``metrics.json`` is written last: its presence marks a finished run.
* A folder belongs to one run at a time (:mod:`overrep.app.runlock`): the lock is taken
  before the folder is checked and released when the run ends, so a second run into the
  same folder stops at once, naming the process that holds it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from ..atomic import fsync_dir, make_dirs, write_error
from ..errors import OverRepError
from .runlock import RunLock

log = logging.getLogger(__name__)

#: Everything overrep itself writes at the top of a run folder.
RUN_ENTRIES = frozenset({"config.yaml", "plan.json", "metrics.json", "report.md", "train_log.jsonl",
                         "checkpoints", "model", "pruned-model", "plots", "benchmarks"})
FINISHED_MARKER = "metrics.json"


class RunFolder:
    def __init__(self, path: str | Path, *, resume: bool = False, overwrite: bool = False, reuse: bool = False):
        self.path = Path(path)
        self.resume, self.overwrite, self.reuse = resume, overwrite, reuse
        self.created = False  # this process created (or replaced) the folder
        self._lock = RunLock(self.path)

    # ---- owning --------------------------------------------------------------------
    def lock(self) -> None:
        """Take the folder for this run, or fail naming the run that has it."""
        self.check_path()
        self._lock.acquire()

    def unlock(self) -> None:
        self._lock.release()

    # ---- looking -------------------------------------------------------------------
    @property
    def replaced(self) -> Path:
        return self.path.with_name(f".{self.path.name}.replaced")

    def entries(self) -> list[str]:
        try:
            return sorted(p.name for p in self.path.iterdir())
        except FileNotFoundError:
            return []
        except OSError as e:
            raise OverRepError(f"cannot read output folder '{self.path}': {e.strerror or e}") from None

    def foreign(self) -> list[str]:
        """Entries overrep did not write (hidden temporaries of its own are not foreign)."""
        return [n for n in self.entries() if n not in RUN_ENTRIES and not n.startswith(".")]

    @property
    def finished(self) -> bool:
        return (self.path / FINISHED_MARKER).is_file()

    def has_progress(self) -> bool:
        """Anything worth keeping for ``--resume``: a checkpoint or an exported model."""
        ckpt = self.path / "checkpoints"
        return (ckpt.is_dir() and any(ckpt.glob("step-*.pt"))) or (self.path / "pruned-model").is_dir()

    def check_path(self) -> None:
        out = self.path
        if not str(out).strip():
            raise OverRepError("the output folder must not be empty (--output)")
        if out.exists() and not out.is_dir():
            raise OverRepError(f"output path '{out}' exists and is not a folder")

    def check(self) -> None:
        """Refuse, before anything is loaded or written, what the flags do not allow."""
        out = self.path
        self.check_path()
        entries = [n for n in self.entries() if not n.startswith(".")]
        if self.overwrite:
            alien = self.foreign()
            if alien:
                raise OverRepError(f"refusing to overwrite '{out}': it holds '{alien[0]}', which overrep did not "
                                   "write; choose another --output or empty it yourself")
            return
        if self.reuse:  # a single stage (prune, cache) writing into a run folder
            if self.foreign():
                raise OverRepError(f"output folder '{out}' holds files overrep did not write "
                                   f"(e.g. '{self.foreign()[0]}'); choose another --output")
            return
        if self.resume:
            if not (out / "config.yaml").is_file():
                raise OverRepError(f"nothing to resume in '{out}' (no config.yaml); drop --resume to start a run")
            return
        if not entries:
            return
        if self.finished:
            raise OverRepError(f"output folder '{out}' already holds a finished run; pass --overwrite or "
                               "choose another --output")
        if self.foreign():
            raise OverRepError(f"output folder '{out}' is not empty and holds files overrep did not write "
                               f"(e.g. '{self.foreign()[0]}'); choose another --output")
        raise OverRepError(f"output folder '{out}' holds an unfinished run; pass --resume to continue it "
                           "or --overwrite to start over")

    def check_same_config(self, cfg) -> None:
        """``--resume`` (or a single stage into a run folder) continues the run saved there only."""
        from .config import RunConfig

        if not (self.path / "config.yaml").exists():
            return
        section = cfg.differing_section(RunConfig.load(self.path / "config.yaml"))
        if section is not None:
            raise OverRepError(f"--resume with a different configuration (section '{section}' differs from "
                               f"{self.path / 'config.yaml'})")

    # ---- writing -------------------------------------------------------------------
    def open(self) -> None:
        """Create the folder for this run (moving a run it replaces aside). The first write."""
        out = self.path
        if self.overwrite and self.entries():
            if self.replaced.exists():
                # An earlier --overwrite failed half-way: what sits in the folder is that
                # attempt, and the user's run is still safe in .replaced.
                shutil.rmtree(out)
            else:
                try:
                    os.replace(out, self.replaced)
                except OSError as e:
                    raise write_error(out, e, "output folder") from None
            self.created = True
        elif not out.exists():
            self.created = True
        make_dirs(out, "output folder")
        fsync_dir(out.parent)

    def commit(self) -> None:
        """The run finished: the run it replaced can go."""
        if self.replaced.exists():
            shutil.rmtree(self.replaced, ignore_errors=True)

    def rollback(self) -> None:
        """After a failure: undo a start that produced nothing resumable."""
        if not self.created or self.has_progress() or self.finished:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if self.replaced.exists():
            os.replace(self.replaced, self.path)
            log.info("restored the run that --overwrite would have replaced in %s", self.path)
