"""On-disk feature cache for layer-wise training of the recovery module.

The dense model is run once over the calibration data; for every sample we keep the
hidden state entering the recovery module (``inputs``, [T, H]) and the hidden state
after the removed segment (``targets``, [T, H]). Training then reads random
mini-batches from this cache for many epochs, so the cache must be

* **random access** -- :meth:`FeatureCache.get` reads only the requested rows (one
  ``preadv`` per contiguous run, straight into the output), never a whole shard;
* **crash safe** -- every file is written under a temporary name, fsync'd and renamed,
  and ``manifest.json`` is written last, so a half-written cache never looks complete;
* **resumable** -- a killed build keeps its finished shards and only the missing ones
  are produced again;
* **self-checking** -- the manifest records each shard's size and sha256 together with
  the caller's fingerprint (model, segment, data, dtype ...), so a stale, truncated or
  corrupt cache is detected instead of silently training on wrong features.

Directory layout::

    <path>/fingerprint.json            written when a build starts (matches partial builds)
    <path>/shard-00000.safetensors     tensors [n, T, H] for samples [0, n)
    <path>/shard-00000.json            sidecar: size and sha256 of that shard
    ...
    <path>/manifest.json               written last; its presence means "complete"
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import operator
import os
import random
import re
import struct
import sys
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..errors import OverRepError

__all__ = [
    "FeatureCache",
    "FeatureCacheCorrupt",
    "FeatureCacheMismatch",
    "FeatureCacheWriter",
    "build_or_open",
    "epoch_batches",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "overrep-feature-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FINGERPRINT = "fingerprint.json"

_SHARD_RE = re.compile(r"^shard-(\d{5,})\.(safetensors|json)$")
_TMP_RE = re.compile(r"^\..+\.tmp-[0-9a-f]+$")
_HASH_CHUNK = 8 << 20  # 8 MiB: large enough for full disk throughput, small in memory

# torch dtype <-> safetensors dtype tag / manifest name.
_DTYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.float32: ("F32", "float32"),
    torch.float16: ("F16", "float16"),
    torch.bfloat16: ("BF16", "bfloat16"),
    torch.float64: ("F64", "float64"),
}
_DTYPE_BY_NAME = {name: dtype for dtype, (_, name) in _DTYPES.items()}


class FeatureCacheMismatch(OverRepError):
    """The cache on disk was built for a different fingerprint or layout."""


class FeatureCacheCorrupt(OverRepError):
    """The cache on disk is truncated, corrupt or unreadable."""


# --------------------------------------------------------------------------- helpers


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def _sidecar_name(shard: int) -> str:
    return f"shard-{shard:05d}.json"


def _canonical(obj: Any, what: str) -> Any:
    """Round-trip ``obj`` through JSON so tuples/lists and key order compare equal."""
    try:
        return json.loads(json.dumps(obj, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise OverRepError(f"feature cache {what} is not JSON-serialisable: {exc}") from exc


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        supported = ", ".join(name for _, name in _DTYPES.values())
        raise OverRepError(f"feature cache dtype {dtype} is not supported (use one of: {supported})")
    return _DTYPES[dtype][1]


def _is_no_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _no_space_error(path: Path) -> OverRepError:
    return OverRepError(
        f"no space left on device while writing the feature cache at {path}; "
        "free space or set cache.mode: live"
    )


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories; best effort
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tmp_path(final: Path) -> Path:
    # Hidden, unique per writer, and recognisable by _TMP_RE so stale ones get swept.
    return final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _atomic_write(final: Path, chunks: Iterator[memoryview | bytes], cache_dir: Path) -> tuple[int, str]:
    """Write ``chunks`` to ``final`` via temp file + fsync + rename.

    Returns (size in bytes, sha256 hex digest). On any failure the temp file is removed
    and ``final`` is left untouched; a full disk becomes the user-facing ENOSPC error.
    """
    tmp = _tmp_path(final)
    hasher = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                hasher.update(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        _remove_quietly(tmp)
        if _is_no_space(exc):
            raise _no_space_error(cache_dir) from exc
        raise OverRepError(f"could not write {final}: {exc.strerror or exc}") from exc
    except BaseException:
        _remove_quietly(tmp)
        raise
    _fsync_dir(final.parent)
    return size, hasher.hexdigest()


def _atomic_write_json(final: Path, obj: Any, cache_dir: Path) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    _atomic_write(final, iter([data]), cache_dir)


def _read_json(path: Path) -> Any:
    """Parse a JSON file; unreadable or malformed -> FeatureCacheCorrupt naming it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FeatureCacheCorrupt(f"feature cache file {path} is unreadable or malformed ({exc})") from exc
    if not isinstance(data, dict):
        raise FeatureCacheCorrupt(f"feature cache file {path} is malformed (not a JSON object)")
    return data


def _sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def _safetensors_chunks(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Iterator[memoryview | bytes]:
    """Serialise contiguous CPU tensors in the safetensors format, without copying them.

    ``safetensors.torch.save`` would build the whole file as one ``bytes`` object (a
    second copy of a possibly multi-GB shard) and its Rust ``save_file`` hides OSError
    (so ENOSPC could not be recognised); the format is simple enough to stream:
    u64-LE header length, JSON header padded to 8 bytes, then the raw tensor bytes.
    """
    if sys.byteorder != "little":  # safetensors stores little-endian data
        raise OverRepError("the feature cache requires a little-endian machine")
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype][0],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # spaces are the padding the format allows
    yield struct.pack("<Q", len(blob)) + blob
    for t in tensors.values():
        # A uint8 view of the tensor's own storage: no copy, works for bf16 too.
        yield memoryview(t.reshape(-1).view(torch.uint8).numpy())


_MISSING = object()


def _fields_differing(stored: dict, expected: dict) -> list[str]:
    """Top-level keys whose values differ (a key present on one side only differs too)."""
    return sorted(k for k in set(stored) | set(expected) if stored.get(k, _MISSING) != expected.get(k, _MISSING))


def _mismatch_reason(path: Path, stored: dict, expected: dict) -> str | None:
    """Explain why a stored record (fingerprint + layout) differs from the expected one."""
    if stored.get("format") != FORMAT_NAME or stored.get("version") != FORMAT_VERSION:
        return (
            f"feature cache at {path} was written in a different format "
            f"({stored.get('format')!r} v{stored.get('version')}, expected {FORMAT_NAME!r} v{FORMAT_VERSION})"
        )
    stored_fp = stored.get("fingerprint")
    fp_diff = _fields_differing(stored_fp if isinstance(stored_fp, dict) else {}, expected["fingerprint"])
    if fp_diff:
        fields = ", ".join(repr(k) for k in fp_diff[:3]) + (" ..." if len(fp_diff) > 3 else "")
        noun = "field" if len(fp_diff) == 1 else "fields"
        verb = "differs" if len(fp_diff) == 1 else "differ"
        return f"feature cache at {path} was built for a different model/segment/data ({noun} {fields} {verb})"
    stored_layout = stored.get("layout") if isinstance(stored.get("layout"), dict) else {}
    layout_diff = _fields_differing(stored_layout, expected["layout"])
    if layout_diff:
        k = layout_diff[0]
        return (
            f"feature cache at {path} was built with a different layout "
            f"(field {k!r} is {stored_layout.get(k)!r}, expected {expected['layout'].get(k)!r})"
        )
    return None


def _record(fingerprint: dict, layout: dict) -> dict:
    """What identifies a cache: the caller's fingerprint plus the on-disk layout."""
    if not isinstance(fingerprint, dict):
        raise OverRepError(f"feature cache fingerprint must be a dict, got {type(fingerprint).__name__}")
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "fingerprint": _canonical(fingerprint, "fingerprint"),
        "layout": layout,
    }


def _cache_key(record: dict) -> str:
    """Short digest of a record, stamped into every shard so foreign shards are rejected."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _check_shard_header(file: Path, layout: dict, count: int) -> None:
    """Parse the safetensors header and check tensor names, dtype and shapes.

    safetensors itself rejects a header whose data extent disagrees with the file size,
    so this also catches truncation even without a recorded size.
    """
    expected_shape = [count, layout["seq_len"], layout["hidden_size"]]
    expected_dtype = _DTYPES[_DTYPE_BY_NAME[layout["dtype"]]][0]
    try:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            if names != set(layout["tensors"]):
                raise FeatureCacheCorrupt(
                    f"feature cache shard {file} holds tensors {sorted(names)}, expected {sorted(layout['tensors'])}"
                )
            for name in layout["tensors"]:
                sl = f.get_slice(name)
                if list(sl.get_shape()) != expected_shape or sl.get_dtype() != expected_dtype:
                    raise FeatureCacheCorrupt(
                        f"feature cache shard {file} tensor {name!r} is {sl.get_dtype()} {list(sl.get_shape())}, "
                        f"expected {expected_dtype} {expected_shape}"
                    )
    except FeatureCacheCorrupt:
        raise
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise FeatureCacheCorrupt(f"feature cache shard {file} has an unreadable header ({exc})") from exc


def _check_shard_file(cache_dir: Path, entry: dict, layout: dict, *, hash_it: bool) -> None:
    """Existence, recorded size (truncation), header, and optionally sha256 (corruption)."""
    file = cache_dir / entry["file"]
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise FeatureCacheCorrupt(f"feature cache shard {file} is missing") from None
    if size != entry["size"]:
        raise FeatureCacheCorrupt(
            f"feature cache shard {file} is {size} bytes, expected {entry['size']} (truncated or overwritten)"
        )
    _check_shard_header(file, layout, entry["count"])
    if hash_it and _sha256_file(file) != entry["sha256"]:
        raise FeatureCacheCorrupt(f"feature cache shard {file} fails its sha256 check (corrupt)")


def _clear_cache_files(path: Path) -> None:
    """Delete only files this module creates; anything else in the directory is left alone."""
    if not path.is_dir():
        return
    for child in path.iterdir():
        if child.is_file() and (
            child.name in (MANIFEST, FINGERPRINT) or _SHARD_RE.match(child.name) or _TMP_RE.match(child.name)
        ):
            child.unlink()


# --------------------------------------------------------------------------- writer


class FeatureCacheWriter:
    """Writes sharded safetensors + manifest. Resumable: shards already complete are kept.

    Shard ``s`` holds samples ``shard_range(s)``; each named tensor in it is
    ``[n, seq_len, hidden_size]`` with ``n <= shard_size``. A shard counts as complete
    when its file and its sidecar (size, sha256, this cache's key) exist and agree;
    anything else found on resume is deleted and must be written again.

    Creating a writer on a directory removes an existing ``manifest.json`` there (the
    cache is being written, so it is not complete) until :meth:`finalize`, and sweeps
    temp files left by a killed writer: one writer per directory at a time.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        fingerprint: dict,
        num_samples: int,
        seq_len: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        shard_size: int = 64,
        tensors: tuple[str, ...] = ("inputs", "targets"),
    ) -> None:
        for name, value in (("num_samples", num_samples), ("seq_len", seq_len),
                            ("hidden_size", hidden_size), ("shard_size", shard_size)):
            if not isinstance(value, int) or value <= 0:
                raise OverRepError(f"feature cache {name} must be a positive integer, got {value!r}")
        if not tensors or len(set(tensors)) != len(tensors):
            raise OverRepError(f"feature cache tensor names must be non-empty and unique, got {tensors!r}")
        self.path = Path(path)
        self.dtype = dtype
        self.layout = {
            "num_samples": num_samples,
            "seq_len": seq_len,
            "hidden_size": hidden_size,
            "dtype": _dtype_name(dtype),
            "shard_size": shard_size,
            "tensors": list(tensors),
        }
        self.record = _record(fingerprint, self.layout)
        self.key = _cache_key(self.record)
        self.num_shards = math.ceil(num_samples / shard_size)
        self._done: dict[int, dict] = {}  # shard -> manifest entry

        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if _is_no_space(exc):
                raise _no_space_error(self.path) from exc
            raise OverRepError(f"cannot create the feature cache directory {self.path}: {exc.strerror or exc}") from exc
        self._claim_directory()
        self._scan_existing()

    # -- setup ---------------------------------------------------------------

    def _claim_directory(self) -> None:
        """Match or write fingerprint.json; a different one means the caller must clear first."""
        fingerprint_ok = False
        for name in (MANIFEST, FINGERPRINT):
            file = self.path / name
            if not file.exists():
                continue
            try:
                stored = _read_json(file)
            except FeatureCacheCorrupt:
                # Unreadable: it is rewritten below. Shards are still safe to adopt
                # because each one is stamped with this cache's key.
                continue
            reason = _mismatch_reason(self.path, stored, self.record)
            if reason:
                raise FeatureCacheMismatch(reason)
            fingerprint_ok |= name == FINGERPRINT
        _remove_quietly(self.path / MANIFEST)  # being (re)written: no longer complete
        if not fingerprint_ok:
            _atomic_write_json(self.path / FINGERPRINT, self.record, self.path)
        for child in self.path.iterdir():  # temp files of a killed writer
            if _TMP_RE.match(child.name):
                _remove_quietly(child)

    def _scan_existing(self) -> None:
        """Adopt shards a previous (killed) build finished; drop invalid ones."""
        for shard in range(self.num_shards):
            file, sidecar = self.path / _shard_name(shard), self.path / _sidecar_name(shard)
            if not file.exists() and not sidecar.exists():
                continue
            try:
                if not sidecar.exists():
                    raise FeatureCacheCorrupt(f"feature cache shard {file} has no sidecar (killed mid-write)")
                entry = _read_json(sidecar)
                if entry.get("key") != self.key or entry.get("start") != self.shard_range(shard).start \
                        or entry.get("count") != len(self.shard_range(shard)):
                    raise FeatureCacheCorrupt(f"feature cache shard {file} belongs to a different build")
                # Hashing here costs far less than producing the shard again with the dense model.
                _check_shard_file(self.path, entry, self.layout, hash_it=True)
            except FeatureCacheCorrupt as exc:
                logger.warning("%s; it will be written again", exc)
                _remove_quietly(file)
                _remove_quietly(sidecar)
                continue
            self._done[shard] = entry
        if self._done:
            logger.info("feature cache at %s: resuming, %d of %d shards already complete",
                        self.path, len(self._done), self.num_shards)

    # -- public API ----------------------------------------------------------

    def missing_shards(self) -> list[int]:
        """Shard indices still to write, ascending."""
        return [s for s in range(self.num_shards) if s not in self._done]

    def shard_range(self, shard: int) -> range:
        """Sample indices stored in ``shard``."""
        if not 0 <= shard < self.num_shards:
            raise IndexError(f"shard {shard} out of range [0, {self.num_shards})")
        size = self.layout["shard_size"]
        return range(shard * size, min((shard + 1) * size, self.layout["num_samples"]))

    def write_shard(self, shard: int, **tensors: torch.Tensor) -> None:
        """Write one shard atomically; each tensor is ``[len(shard_range(shard)), seq_len, hidden]``.

        Tensors are moved to CPU and cast to the cache dtype. The shard is written to a
        temp file, fsync'd and renamed, then its sidecar (size, sha256) likewise.
        """
        rows = self.shard_range(shard)
        expected = (len(rows), self.layout["seq_len"], self.layout["hidden_size"])
        if set(tensors) != set(self.layout["tensors"]):
            raise OverRepError(
                f"feature cache shard {shard} got tensors {sorted(tensors)}, expected {sorted(self.layout['tensors'])}"
            )
        prepared: dict[str, torch.Tensor] = {}
        for name in self.layout["tensors"]:  # fixed order -> identical bytes for identical data
            t = tensors[name]
            if tuple(t.shape) != expected:
                raise OverRepError(
                    f"feature cache shard {shard} tensor {name!r} has shape {tuple(t.shape)}, expected {expected}"
                )
            prepared[name] = t.detach().to(device="cpu", dtype=self.dtype).contiguous()

        file, sidecar = self.path / _shard_name(shard), self.path / _sidecar_name(shard)
        metadata = {"key": self.key, "shard": str(shard), "start": str(rows.start), "count": str(len(rows))}
        size, digest = _atomic_write(file, _safetensors_chunks(prepared, metadata), self.path)
        entry = {"file": file.name, "shard": shard, "start": rows.start, "count": len(rows),
                 "size": size, "sha256": digest, "key": self.key}
        try:
            _atomic_write_json(sidecar, entry, self.path)
        except BaseException:
            # Without its sidecar the shard would be rewritten anyway; do not leave it around.
            _remove_quietly(file)
            raise
        self._done[shard] = entry

    def finalize(self) -> FeatureCache:
        """Write ``manifest.json`` (last, atomically) and return the reader.

        The returned reader skips re-hashing: every shard was hashed when written or
        when adopted on resume.
        """
        missing = self.missing_shards()
        if missing:
            raise OverRepError(
                f"feature cache at {self.path} is incomplete: {len(missing)} shard(s) not written (first: {missing[0]})"
            )
        shards = [{k: v for k, v in self._done[s].items() if k != "key"} for s in range(self.num_shards)]
        manifest = {
            **self.record,
            "shapes": {name: [self.layout["num_samples"], self.layout["seq_len"], self.layout["hidden_size"]]
                       for name in self.layout["tensors"]},
            "key": self.key,
            "shards": shards,
        }
        _atomic_write_json(self.path / MANIFEST, manifest, self.path)
        return FeatureCache(self.path, manifest)


# --------------------------------------------------------------------------- reader


def _runs(rows: list[int]) -> Iterator[tuple[int, int]]:
    """Split sorted unique ints into maximal contiguous half-open runs [start, stop)."""
    start = prev = rows[0]
    for r in rows[1:]:
        if r != prev + 1:
            yield start, prev + 1
            start = r
        prev = r
    yield start, prev + 1


_IOV_MAX = 1024  # POSIX minimum for the number of buffers one preadv may take


class _ShardFile:
    """One open shard file, read by byte range: only the requested rows touch the disk.

    Why not ``safe_open(...).get_slice(name)[a:b]``: with the default mmap backend the
    slice is a view into the mapping, so the copy page-faults the rows in and the
    kernel's fault read-around pulls in ``read_ahead_kb`` around each fault (8 MiB on
    typical cloud disks): a cold single-sample read of a 75 MB shard read ~58 MB from
    disk. The ``pread`` backend reads the whole tensor before slicing. Reading the rows
    with ``preadv`` on a descriptor advised ``POSIX_FADV_RANDOM`` reads just them, and
    straight into the output tensor (no intermediate copy).

    The header has already been validated with ``safe_open`` when the cache was
    opened; here it is parsed again only to find each tensor's byte offset.
    """

    def __init__(self, file: Path, names: Sequence[str], shape: list[int], dtype: torch.dtype) -> None:
        self.file = file
        self.row_bytes = 0
        self.offsets: dict[str, int] = {}  # tensor name -> absolute byte offset of row 0
        try:
            self._fh = open(file, "rb", buffering=0)
        except OSError as exc:
            raise FeatureCacheCorrupt(f"cannot open feature cache shard {file} ({exc.strerror or exc})") from exc
        if hasattr(os, "posix_fadvise"):
            # Random access: do not let the kernel read ahead past the rows we ask for.
            os.posix_fadvise(self._fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        try:
            self._parse_header(names, shape, dtype)
        except BaseException:
            self._fh.close()
            raise

    def _parse_header(self, names: Sequence[str], shape: list[int], dtype: torch.dtype) -> None:
        dtype_tag = _DTYPES[dtype][0]
        try:
            (header_len,) = struct.unpack("<Q", self._fh.read(8))
            header = json.loads(self._fh.read(header_len))
            data_start = 8 + header_len
            for name in names:
                info = header[name]
                if info["dtype"] != dtype_tag or info["shape"] != shape:
                    raise ValueError(f"tensor {name!r} is {info['dtype']} {info['shape']}")
                self.offsets[name] = data_start + info["data_offsets"][0]
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            raise FeatureCacheCorrupt(f"feature cache shard {self.file} has an unexpected header ({exc})") from exc
        self.row_bytes = math.prod(shape[1:]) * (torch.finfo(dtype).bits // 8)

    def read_rows(self, name: str, start: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` (one ``row_bytes`` buffer per row) with rows ``start, start+1, ...``."""
        offset = self.offsets[name] + start * self.row_bytes
        pending = list(buffers)
        while pending:
            batch = pending[:_IOV_MAX]
            if hasattr(os, "preadv"):
                n = os.preadv(self._fh.fileno(), batch, offset)
            else:  # platforms without preadv (Windows): same bytes, via seek + readinto
                self._fh.seek(offset)
                n = self._fh.readinto(batch[0])
            if not n:
                raise FeatureCacheCorrupt(f"feature cache shard {self.file} ended early (truncated?)")
            offset += n
            # Drop the buffers this call filled; trim one it filled only partly (short read).
            while n:
                if n >= len(pending[0]):
                    n -= len(pending.pop(0))
                else:
                    pending[0], n = pending[0][n:], 0

    def close(self) -> None:
        self._fh.close()


class FeatureCache:
    """Random-access reader over a complete feature cache.

    ``get(indices)`` returns ``{name: [len(indices), seq_len, hidden_size]}`` in the
    order given, reading only the requested rows: indices are grouped by shard, each
    contiguous run of rows is read with one ``preadv`` directly into the caller-ordered
    output rows, and duplicates are copied afterwards. Shard files are opened lazily
    and kept open (LRU-bounded by :attr:`max_open_shards`).

    Not thread-safe; picklable (open files are dropped and reopened lazily), so it can
    be handed to DataLoader worker processes; ``pread`` keeps no shared file position,
    so forked workers sharing a descriptor do not interfere.
    """

    #: Upper bound on simultaneously open shard files.
    max_open_shards = 256

    def __init__(self, path: str | os.PathLike, manifest: dict) -> None:
        """Wrap an already validated manifest; use :meth:`open` to read one from disk."""
        self.path = Path(path)
        self.manifest = manifest
        layout = manifest["layout"]
        self._num_samples: int = layout["num_samples"]
        self._shard_size: int = layout["shard_size"]
        self.seq_len: int = layout["seq_len"]
        self.hidden_size: int = layout["hidden_size"]
        self.dtype: torch.dtype = _DTYPE_BY_NAME[layout["dtype"]]
        self.tensor_names: tuple[str, ...] = tuple(layout["tensors"])
        self.nbytes: int = sum(entry["size"] for entry in manifest["shards"])
        self._files: OrderedDict[int, _ShardFile] = OrderedDict()

    @classmethod
    def open(
        cls, path: str | os.PathLike, *, fingerprint: dict | None = None, verify: bool = True
    ) -> FeatureCache:
        """Open and check a complete cache.

        Raises :class:`FeatureCacheMismatch` if ``fingerprint`` is given and differs
        from the stored one, :class:`FeatureCacheCorrupt` naming the file if the
        manifest is missing/malformed or a shard is missing, has the wrong size
        (truncated), an unreadable header, or (``verify=True``) a wrong sha256.
        """
        path = Path(path)
        manifest_file = path / MANIFEST
        if not manifest_file.exists():
            raise FeatureCacheCorrupt(f"no complete feature cache at {path} ({MANIFEST} is missing)")
        manifest = _read_json(manifest_file)
        try:
            layout, shards = manifest["layout"], manifest["shards"]
            num_shards = math.ceil(layout["num_samples"] / layout["shard_size"])
            if len(shards) != num_shards or layout["dtype"] not in _DTYPE_BY_NAME:
                raise ValueError("inconsistent shard list or dtype")
            for entry in shards:
                absent = [k for k in ("file", "size", "sha256", "count") if k not in entry]
                if absent:
                    raise ValueError(f"shard entry lacks {absent}")
        except (KeyError, TypeError, ValueError) as exc:
            raise FeatureCacheCorrupt(f"feature cache manifest {manifest_file} is malformed ({exc})") from exc
        # Compare against the manifest itself with only the fingerprint swapped in: this
        # checks the format version always, and the fingerprint when one is given.
        expected = dict(manifest, format=FORMAT_NAME, version=FORMAT_VERSION)
        if fingerprint is not None:
            expected["fingerprint"] = _canonical(fingerprint, "fingerprint")
        reason = _mismatch_reason(path, manifest, expected)
        if reason:
            raise FeatureCacheMismatch(reason)
        for entry in shards:
            _check_shard_file(path, entry, layout, hash_it=verify)
        logger.debug("opened feature cache at %s (%d shards, %.1f MB, verify=%s)",
                     path, len(shards), sum(e["size"] for e in shards) / 1e6, verify)
        return cls(path, manifest)

    def __len__(self) -> int:
        return self._num_samples

    def __repr__(self) -> str:
        return (f"FeatureCache({str(self.path)!r}, samples={self._num_samples}, "
                f"shape=[{self.seq_len}, {self.hidden_size}], dtype={self.dtype}, tensors={self.tensor_names})")

    def get(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows ``indices`` of every tensor: ``{name: [len(indices), seq_len, hidden_size]}``.

        Indices may repeat and come in any order; the result follows the order given.
        """
        n = len(indices)
        out = {name: torch.empty((n, self.seq_len, self.hidden_size), dtype=self.dtype)
               for name in self.tensor_names}
        # Byte views of the outputs, so rows can be read from disk straight into place.
        out_bytes = {name: memoryview(t.view(torch.uint8).reshape(-1).numpy()) for name, t in out.items()}
        row_bytes = self.seq_len * self.hidden_size * out[self.tensor_names[0]].element_size()

        # shard -> local row -> output positions wanting that row (in caller order)
        wanted: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for pos, raw in enumerate(indices):
            i = operator.index(raw)
            if not 0 <= i < self._num_samples:
                raise IndexError(f"sample index {i} out of range [0, {self._num_samples})")
            shard, row = divmod(i, self._shard_size)
            wanted[shard][row].append(pos)

        duplicates: list[tuple[int, int]] = []  # (from output position, to output position)
        for shard, rows in wanted.items():
            shard_file = self._file(shard)
            for start, stop in _runs(sorted(rows)):
                first = [rows[r][0] for r in range(start, stop)]  # each row is read once, here
                for name in self.tensor_names:
                    buffers = [out_bytes[name][p * row_bytes:(p + 1) * row_bytes] for p in first]
                    shard_file.read_rows(name, start, buffers)
                duplicates += [(rows[r][0], p) for r in range(start, stop) for p in rows[r][1:]]
        if duplicates:
            src, dst = (torch.tensor(col) for col in zip(*duplicates))
            for t in out.values():
                t[dst] = t[src]
        return out

    def close(self) -> None:
        """Close all open shard files (they are reopened on demand)."""
        while self._files:
            self._files.popitem()[1].close()

    def __enter__(self) -> FeatureCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_files", None):
            self.close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_files"] = OrderedDict()  # open files are per process
        return state

    def _file(self, shard: int) -> _ShardFile:
        """Lazily opened reader for ``shard`` (LRU-bounded)."""
        shard_file = self._files.get(shard)
        if shard_file is not None:
            self._files.move_to_end(shard)
            return shard_file
        entry = self.manifest["shards"][shard]
        shard_file = _ShardFile(self.path / entry["file"], self.tensor_names,
                                [entry["count"], self.seq_len, self.hidden_size], self.dtype)
        self._files[shard] = shard_file
        if len(self._files) > self.max_open_shards:
            self._files.popitem(last=False)[1].close()
        return shard_file


# --------------------------------------------------------------------------- build / open


def build_or_open(
    path: str | os.PathLike,
    *,
    fingerprint: dict,
    num_samples: int,
    seq_len: int,
    hidden_size: int,
    dtype: torch.dtype,
    produce: Callable[[range], dict[str, torch.Tensor]],
    shard_size: int = 64,
    tensors: tuple[str, ...] = ("inputs", "targets"),
    rebuild: str = "auto",
    progress: bool = True,
) -> FeatureCache:
    """Open the cache at ``path`` if it matches ``fingerprint``, else (re)build it.

    * complete and matching -> opened with full sha256 verification and returned;
    * built for a different fingerprint/layout -> ``rebuild="auto"`` logs a warning
      with the reason, deletes the stale cache files and rebuilds from scratch;
    * corrupt/truncated (same fingerprint) -> ``"auto"`` logs a warning with the
      reason, deletes the bad shards and produces only those again;
    * in both cases ``rebuild="never"`` raises :class:`OverRepError` with the reason,
      and ``rebuild="always"`` deletes everything and rebuilds without looking;
    * partial build (shards, no manifest) with the same fingerprint -> resumed: only
      the missing shards are produced.

    ``produce(sample_range)`` returns ``{name: [len(sample_range), seq_len, hidden_size]}``
    for the samples of one shard (any dtype/device; cast to ``dtype`` on CPU).
    """
    if rebuild not in ("auto", "never", "always"):
        raise OverRepError(f"cache.rebuild must be 'auto', 'never' or 'always', got {rebuild!r}")
    path = Path(path)
    layout = {"num_samples": num_samples, "seq_len": seq_len, "hidden_size": hidden_size,
              "dtype": _dtype_name(dtype), "shard_size": shard_size, "tensors": list(tensors)}
    expected = _record(fingerprint, layout)

    if rebuild == "always":
        _clear_cache_files(path)
    else:
        cache, stale = _probe_existing(path, expected)
        if cache is not None:
            return cache
        if stale is not None:
            if rebuild == "never":
                raise OverRepError(f"{stale}; delete it or set cache.rebuild: auto")
            logger.warning("%s; rebuilding it", stale)
            if isinstance(stale, FeatureCacheMismatch):
                _clear_cache_files(path)
            # A corrupt cache keeps its good shards: the writer re-checks every shard
            # and drops the bad ones, so only those are produced again.

    writer = FeatureCacheWriter(path, fingerprint=fingerprint, num_samples=num_samples, seq_len=seq_len,
                                hidden_size=hidden_size, dtype=dtype, shard_size=shard_size, tensors=tensors)
    missing = writer.missing_shards()
    todo = sum(len(writer.shard_range(s)) for s in missing)
    logger.info("building feature cache at %s: %d of %d samples to produce", path, todo, num_samples)
    with tqdm(total=num_samples, initial=num_samples - todo, unit="sample", desc="feature cache",
              disable=not progress, dynamic_ncols=True) as bar:
        for shard in missing:
            rows = writer.shard_range(shard)
            writer.write_shard(shard, **produce(rows))
            bar.update(len(rows))
    return writer.finalize()


def _probe_existing(path: Path, expected: dict) -> tuple[FeatureCache | None, OverRepError | None]:
    """Classify what is at ``path``: (usable cache, None), (None, why unusable), or (None, None).

    (None, None) means nothing there yet or a matching partial build to resume.
    """
    manifest_file, fingerprint_file = path / MANIFEST, path / FINGERPRINT
    try:
        if manifest_file.exists():
            reason = _mismatch_reason(path, _read_json(manifest_file), expected)
            if reason:
                return None, FeatureCacheMismatch(reason)
            return FeatureCache.open(path, fingerprint=expected["fingerprint"], verify=True), None
        if fingerprint_file.exists():
            reason = _mismatch_reason(path, _read_json(fingerprint_file), expected)
            if reason:
                return None, FeatureCacheMismatch(reason)
    except FeatureCacheMismatch as exc:
        return None, exc
    except FeatureCacheCorrupt as exc:
        return None, exc
    return None, None


# --------------------------------------------------------------------------- batching


def epoch_batches(
    num_samples: int, batch_size: int, *, seed: int, epoch: int, drop_last: bool = True
) -> list[list[int]]:
    """Shuffled sample-index batches for one epoch, a pure function of (seed, epoch).

    Uses Python's ``random.Random`` seeded with a string (sha512-based, stable across
    Python versions and independent of torch), so a resumed run can recompute the same
    epoch and skip the batches it already trained on.
    """
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise OverRepError(f"batch_size must be a positive integer, got {batch_size!r}")
    if num_samples < 0:
        raise OverRepError(f"num_samples must be non-negative, got {num_samples}")
    if drop_last and num_samples < batch_size:
        raise OverRepError(
            f"batch_size {batch_size} exceeds the {num_samples} cached samples, so an epoch has no full batch; "
            "lower the batch size or use more calibration samples"
        )
    order = list(range(num_samples))
    random.Random(f"overrep-epoch:{seed}:{epoch}").shuffle(order)
    stop = num_samples - num_samples % batch_size if drop_last else num_samples
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]
