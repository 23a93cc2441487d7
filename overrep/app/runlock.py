"""One run per output folder: an exclusive lock held from the first write to the end.

The lock is a hidden sibling file, ``.NAME.lock`` beside the folder ``NAME``, so it exists
before the folder does and survives ``--overwrite`` moving the folder aside. It is held with
``flock``: the kernel drops it when its process dies, however it dies (``kill -9``
included), so a lock file left behind by a dead run is simply taken over, with a message.
The file records the holder's process id and host, so a refused run can name the run that
holds the folder.

Unlinking a lock file that another process has open races (the other process would then
lock a file nobody else can see): after locking, the holder checks that the path still
names the file it locked, and starts again if not.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from ..atomic import write_error
from ..errors import OverRepError

log = logging.getLogger(__name__)


def lock_path(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.lock")


def _holder(text: str) -> dict:
    try:
        data = json.loads(text)
        return data if isinstance(data, dict) else {}
    except ValueError:
        return {}


def _describe(holder: dict) -> str:
    pid = holder.get("pid", "?")
    host = holder.get("host")
    started = holder.get("started")
    when = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if started else ""
    return f"process {pid}" + (f" on {host}" if host and host != socket.gethostname() else "") + when


class RunLock:
    """``acquire()`` or a one-line error naming the run that holds ``folder``; ``release()``."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = lock_path(self.folder)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self.held:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(self.path.parent, e, "the folder of the output folder") from None
        for _ in range(20):  # retried only when the file was replaced under us (see the module docstring)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise write_error(self.path, e, "the output folder's lock") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
                os.close(fd)
                raise OverRepError(f"output folder '{self.folder}' is in use by another overrep run "
                                   f"({_describe(holder)}); wait for it or choose another --output") from None
            except OSError as e:
                os.close(fd)
                raise OverRepError(f"cannot lock output folder '{self.folder}': {e.strerror or e}") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed it between our open and our lock
                os.close(fd)
                continue
            stale = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            if stale.get("pid") and stale.get("pid") != os.getpid():
                log.warning("output folder %s: taking over the lock of %s, which is no longer running",
                            self.folder, _describe(stale))
            record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
            self._fd = fd
            return
        raise OverRepError(f"cannot lock output folder '{self.folder}': its lock file keeps being replaced")

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still locked: whoever opens it next sees a new file
        except OSError:
            pass
        os.close(fd)
