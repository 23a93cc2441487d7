"""Atomic writes: the one way overrep puts a file or a folder a user relies on onto disk.

Every write goes to a hidden temporary name beside its destination, is flushed and
``fsync``-ed, then renamed into place (and the directory entry is ``fsync``-ed too). On
*any* failure -- a full disk, a read-only folder, an exception inside a serialiser such
as ``torch.save`` or safetensors, Ctrl-C -- the temporary file or folder is removed and
the destination is left exactly as it was. Failures become one-line :class:`OverRepError`
messages; a full disk is named as such whatever layer noticed it (an ``OSError`` with
``ENOSPC``, or a serialiser's own ``RuntimeError``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

from .errors import OverRepError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def temporary_sibling(final: Path, tag: str = "tmp") -> Path:
    """A hidden, unique name in ``final``'s folder (same file system, so rename is atomic)."""
    return final.with_name(f".{final.name}.{tag}-{uuid.uuid4().hex[:12]}")


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _disk_is_full(path: Path) -> bool:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free < (1 << 20)
    except OSError:
        return False


def _errno_of(exc: BaseException) -> int | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def write_error(path: Path, exc: BaseException, what: str = "") -> OverRepError:
    """The one-line error for a failed write of ``path``."""
    if isinstance(exc, OverRepError):
        return exc
    name = f"{what} {path}" if what else str(path)
    code = _errno_of(exc)
    if code in _FULL or "No space left" in str(exc) or _disk_is_full(path):
        return OverRepError(f"no space left on device while writing {name}; free some space and rerun "
                            "(with --resume where a run had started)")
    if code in _DENIED:
        reason = "read-only file system" if code == errno.EROFS else "permission denied"
        return OverRepError(f"cannot write {name}: {reason}")
    detail = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).strip()
    detail = detail.splitlines()[0] if detail else type(exc).__name__
    return OverRepError(f"cannot write {name}: {detail}")


def make_dirs(path: Path, what: str = "folder") -> Path:
    """``mkdir -p`` with a one-line error (read-only location, a file in the way, ...)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OverRepError(f"cannot create {what} '{path}': a file is in the way") from None
    except OSError as e:
        raise write_error(path, e, what) from None
    return path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            pass


@contextlib.contextmanager
def _undone_on_failure(tmp: Path, final: Path, what: str):
    """Any failure inside removes ``tmp``; Ctrl-C passes through, anything else becomes the
    one-line :func:`write_error` for ``final``."""
    try:
        yield
    except KeyboardInterrupt:
        _remove(tmp)
        raise
    except BaseException as e:
        _remove(tmp)
        raise write_error(final, e, what) from None


def write_file(final: str | Path, write: Callable[[Path], None], what: str = "") -> Path:
    """``write(tmp)`` fills a temporary file; it becomes ``final`` only if that succeeded."""
    final = Path(final)
    make_dirs(final.parent)
    tmp = temporary_sibling(final)
    with _undone_on_failure(tmp, final, what):
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def write_bytes(final: str | Path, data: bytes, what: str = "") -> Path:
    return write_file(final, lambda tmp: tmp.write_bytes(data), what)


def write_text(final: str | Path, text: str, what: str = "") -> Path:
    return write_bytes(final, text.encode("utf-8"), what)


def json_default(o: Any):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return str(o)


def write_json(final: str | Path, data: Any, what: str = "") -> Path:
    return write_text(final, json.dumps(data, indent=2, default=json_default) + "\n", what)


def save_torch(final: str | Path, obj: Any, what: str = "") -> Path:
    import torch

    return write_file(final, lambda tmp: torch.save(obj, tmp), what)


def write_dir(final: str | Path, write: Callable[[Path], None], what: str = "folder") -> Path:
    """``write(tmp)`` fills a temporary folder; it replaces ``final`` only if that succeeded.

    Every file is ``fsync``-ed before the swap. A folder already at ``final`` is moved
    aside, the new one renamed into place, and only then the old one deleted.
    """
    final = Path(final)
    make_dirs(final.parent)
    tmp = temporary_sibling(final, "partial")
    with _undone_on_failure(tmp, final, what):
        tmp.mkdir()
        write(tmp)
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                with open(f, "rb+") as h:
                    os.fsync(h.fileno())
        fsync_dir(tmp)
        if final.exists():
            old = temporary_sibling(final, "old")
            os.replace(final, old)
            os.replace(tmp, final)
            _remove(old)
        else:
            os.replace(tmp, final)
    fsync_dir(final.parent)
    return final
