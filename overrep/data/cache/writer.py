"""Write a feature cache: sharded safetensors, one sidecar per shard, the manifest last; resumable."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from ...errors import OverRepError
from .format import (FINGERPRINT, MANIFEST, _TMP_RE, FeatureCacheCorrupt, FeatureCacheMismatch, _atomic_write,
                     _atomic_write_json, _cache_key, _check_shard_file, _dtype_name, _is_no_space, _mismatch_reason,
                     _no_space_error, _read_json, _record, _remove_quietly, _safetensors_chunks, _shard_name,
                     _sidecar_name)
from .reader import FeatureCache

logger = logging.getLogger(__name__)


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
        rank: int = 0,
        claim: bool = True,
    ) -> None:
        """``rank``: recorded with every shard this writer writes (several ranks build one
        cache); ``claim=False``: another rank's writer has claimed the folder already."""
        self.rank = rank
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
        if claim:
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

    def _scan_existing(self, hash_it: bool = True) -> None:
        """Adopt shards a previous (killed) build finished; drop invalid ones. ``hash_it=False``
        trusts the sidecars' sha256 (shards other ranks have just written and hashed)."""
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
                _check_shard_file(self.path, entry, self.layout, hash_it=hash_it)
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

    def write_shard(self, shard: int, *, seconds: float | None = None, **tensors: torch.Tensor) -> None:
        """Write one shard atomically; each tensor is ``[len(shard_range(shard)), seq_len, hidden]``.
        ``seconds``: what producing the shard cost (recorded, so that a reused cache still
        states what it took to build: :attr:`FeatureCache.build_seconds`).

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
                 "size": size, "sha256": digest, "rank": self.rank, "key": self.key}
        if seconds is not None:
            entry["seconds"] = round(float(seconds), 3)
        try:
            _atomic_write_json(sidecar, entry, self.path)
        except BaseException:
            # Without its sidecar the shard would be rewritten anyway; do not leave it around.
            _remove_quietly(file)
            raise
        self._done[shard] = entry

    def adopt_written(self) -> None:
        """Take in the shards other ranks wrote since this writer scanned the folder."""
        self._scan_existing(hash_it=False)

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
