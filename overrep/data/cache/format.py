"""The feature cache's on-disk format: file names, dtypes, fingerprint records, shard checks and crash-safe file writes."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ...atomic import fsync_dir, temporary_sibling, write_file
from ...errors import OverRepError


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


# The project's one implementation of both (hidden, unique temporary names that _TMP_RE
# recognises, so stale ones get swept; a durable rename).
_fsync_dir = fsync_dir
_tmp_path = temporary_sibling


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _atomic_write(final: Path, chunks: Iterator[memoryview | bytes], cache_dir: Path) -> tuple[int, str]:
    """Stream ``chunks`` into ``final`` through the project's one atomic writer
    (:func:`overrep.atomic.write_file`: temp file, fsync, rename; removed on any failure).

    Returns (size in bytes, sha256 hex digest). A full disk becomes the feature cache's own
    message, which says how to run without a cache.
    """
    hasher = hashlib.sha256()
    size = 0

    def write(tmp: Path) -> None:
        nonlocal size
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                hasher.update(chunk)
                size += len(chunk)

    try:
        write_file(final, write, "the feature cache file")
    except OverRepError as exc:
        if "no space left" in str(exc):
            raise _no_space_error(cache_dir) from None
        raise
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
