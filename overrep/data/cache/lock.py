"""Runs that share a feature cache: one builds it while the others wait, and a cache a run
reads is not removed under it.

A feature cache is named by what it holds, not by the run that built it, so two runs (two
seeds of one plan on one machine, say) can want the same folder at the same time. Unguarded,
both would compute every feature, and the second one's scan of the folder would delete the
shards the first was writing. So a run holds the cache's lock, a hidden sibling file
``.NAME.lock``, with ``flock``: exclusively while it settles or builds the folder (another
run waits, then finds the cache complete and reads it), shared while it reads it;
``overrep cache --clean`` removes only a folder whose lock it gets exclusively at once. The
kernel drops a lock when its process dies, however it dies.

The lock file stays beside its folder (a shared lock cannot remove it); the cleaner removes
those of folders that are gone, while holding them, and an acquirer that finds the file
replaced between its open and its lock starts again, as :mod:`overrep.app.runlock` does.
"""

from __future__ import annotations

import fcntl
import logging
import os
import weakref
from pathlib import Path

from ...errors import OverRepError

logger = logging.getLogger(__name__)


def lock_file(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.lock")


_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's locks


def release_own(folder: Path) -> int:
    """Drop the locks this process holds on ``folder``'s cache (its own earlier readers): the
    lock keeps other processes out, and a process that rebuilds a cache it read before must
    not wait for itself. How many were held."""
    own = [lk for lk in list(_LIVE) if lk.held and lk.path == lock_file(Path(folder))]
    for lk in own:
        lk.release()
    return len(own)


class CacheLock:
    """The lock of the cache folder ``folder``: :meth:`exclusive`, :meth:`shared` (either
    turns a held lock into the other), :meth:`release`; released when garbage-collected."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = lock_file(self.folder)
        self._fd: int | None = None
        _LIVE.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def exclusive(self, wait: bool = True) -> bool:
        """Hold the lock alone; with ``wait``, after the runs that hold it now (logged once).
        False (without ``wait``) when another process holds it."""
        return self._take(fcntl.LOCK_EX, wait, "building or checking")

    def shared(self, wait: bool = True) -> bool:
        """Hold the lock beside other readers; False (without ``wait``) while a run builds."""
        return self._take(fcntl.LOCK_SH, wait, "building")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # (closing the descriptor drops the flock)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.release()

    def _take(self, mode: int, wait: bool, doing: str) -> bool:
        try:
            return self._flock(mode, wait, doing)
        except OSError as e:  # BlockingIOError is handled below: this is a filesystem without flock
            self.release()
            raise OverRepError(f"cannot lock the feature cache {self.folder}: {e.strerror or e} (its folder "
                               "needs a filesystem with flock; set cache.dir to a local disk)") from None

    def _flock(self, mode: int, wait: bool, doing: str) -> bool:
        if self._fd is not None:  # a conversion (exclusive to shared here): flock turns the held lock
            try:
                fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if not wait:
                    return False
            fcntl.flock(self._fd, mode)
            return True
        for _ in range(20):  # retried only when the file was replaced under us (module docstring)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise OverRepError(f"cannot create the feature cache's lock {self.path}: {e.strerror or e}") from None
            try:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                except BlockingIOError:
                    if not wait:
                        os.close(fd)
                        return False
                    logger.info("feature cache %s: another run is %s it; waiting for it", self.folder, doing)
                    fcntl.flock(fd, mode)
            except OSError:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return True
            os.close(fd)  # the cleaner removed it between our open and our lock
        raise OverRepError(f"cannot lock the feature cache {self.folder}: its lock file keeps being replaced")

    def __getstate__(self) -> dict:  # a lock is its process's own: a copy in a worker holds nothing
        return {"folder": self.folder, "path": self.path, "_fd": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _LIVE.add(self)
