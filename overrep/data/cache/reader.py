"""Read a feature cache: random access to rows, one preadv per contiguous run, shard checks on open."""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import struct
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from .format import (FORMAT_NAME, FORMAT_VERSION, MANIFEST, _DTYPE_BY_NAME, _DTYPES, FeatureCacheCorrupt,
                     FeatureCacheMismatch, _canonical, _check_shard_file, _mismatch_reason, _read_json)

logger = logging.getLogger(__name__)


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
        self._lock = None  # a CacheLock held shared while this reader lives (hold)

    def hold(self, lock) -> None:
        """Keep ``lock`` (:class:`~overrep.data.cache.lock.CacheLock`, held shared) while this
        reader, or a :meth:`first` view of it, lives: the folder is not removed under it."""
        self._lock = lock

    @property
    def build_seconds(self) -> float:
        """Seconds the teacher spent producing the samples read here (summed over the ranks
        that wrote them; 0 for a cache written before shards recorded it)."""
        return self.seconds_for(range(self._num_samples))

    def seconds_for(self, rows: range) -> float:
        """What producing ``rows`` cost, from the shards' recorded seconds (a shard read in
        part counts in proportion)."""
        total = 0.0
        for entry in self.manifest["shards"]:
            start, count = entry.get("start", entry["shard"] * self._shard_size), entry["count"]
            overlap = min(rows.stop, start + count) - max(rows.start, start)
            if overlap > 0 and count:
                total += float(entry.get("seconds", 0.0)) * overlap / count
        return total

    def first(self, n: int) -> FeatureCache:
        """A reader of the first ``n`` samples alone (:mod:`~overrep.data.cache.prefix`: a
        smaller plan of the same rows); its own open files."""
        if not 0 < n <= self._num_samples:
            raise IndexError(f"cannot read the first {n} samples of a cache of {self._num_samples}")
        view = FeatureCache(self.path, self.manifest)
        view._num_samples, view._lock = n, self._lock
        return view

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
        state["_lock"] = None  # and so are locks
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
