"""Open a matching feature cache or build it again: the rebuild policy."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...errors import OverRepError
from .format import (FINGERPRINT, MANIFEST, FeatureCacheCorrupt, FeatureCacheMismatch, _clear_cache_files,
                     _dtype_name, _mismatch_reason, _read_json, _record)
from .reader import FeatureCache
from .writer import FeatureCacheWriter

logger = logging.getLogger(__name__)


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
