"""Open a matching feature cache or build it again: the rebuild policy."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...distributed import SINGLE, World
from ...errors import OverRepError
from .format import (FINGERPRINT, MANIFEST, FeatureCacheCorrupt, FeatureCacheMismatch, _clear_cache_files,
                     _dtype_name, _mismatch_reason, _read_json, _record)
from .lock import CacheLock, release_own
from .prefix import PrefixFeed, find_sibling
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
    world: World = SINGLE,
    prefix_key: str | None = None,
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

    ``world``: several ranks (:mod:`overrep.distributed`) build one cache together, each
    its share of the shards; all of them return the same complete cache.

    ``prefix_key``: the fingerprint field that counts the samples, where the caller vouches
    that caches differing only there (and in their sample count) begin with the same samples:
    with no cache at ``path``, a complete sibling folder of the same samples serves its first
    ``num_samples`` (one that holds them all) or the leading rows of the build
    (:mod:`~overrep.data.cache.prefix`); not under ``rebuild="always"``, nor across ranks.

    Runs that want one cache at once take turns (:mod:`~overrep.data.cache.lock`): the first
    settles or builds it while the others wait, then each reads it under a shared lock that
    the returned cache holds for its lifetime.

    ``produce(sample_range)`` returns ``{name: [len(sample_range), seq_len, hidden_size]}``
    for the samples of one shard (any dtype/device; cast to ``dtype`` on CPU).
    """
    if rebuild not in ("auto", "never", "always"):
        raise OverRepError(f"cache.rebuild must be 'auto', 'never' or 'always', got {rebuild!r}")
    path = Path(path)
    layout = {"num_samples": num_samples, "seq_len": seq_len, "hidden_size": hidden_size,
              "dtype": _dtype_name(dtype), "shard_size": shard_size, "tensors": list(tensors)}
    expected = _record(fingerprint, layout)
    args = dict(fingerprint=fingerprint, num_samples=num_samples, seq_len=seq_len, hidden_size=hidden_size,
                dtype=dtype, shard_size=shard_size, tensors=tensors, rank=world.rank)
    lock = CacheLock(path)
    if world.is_main:
        ready = _read_or_claim(lock, path, expected, rebuild)
        if ready is not None and not world.distributed:
            ready.hold(lock)
            return ready
    try:
        if world.distributed:
            cache = _build_together(path, expected, rebuild, args, produce, progress, world)
        else:
            cache = _build_alone(path, expected, rebuild, args, produce, progress, prefix_key)
    except BaseException:
        lock.release()
        raise
    if cache.path == path and world.is_main:
        lock.shared()  # read from now on: not removed under this run (`overrep cache --clean`)
        cache.hold(lock)
    else:
        lock.release()  # (a sibling's rows: its own lock, which find_sibling took)
    return cache


def _read_or_claim(lock: CacheLock, path: Path, expected: dict, rebuild: str) -> FeatureCache | None:
    """The complete matching cache at ``path`` with ``lock`` held shared, or None with it
    held exclusively (this run settles or builds the folder). A run building it now is waited
    for; runs reading it hold it shared, so a cache this run would have to rebuild while they
    read it is retried every second until they are done."""
    waiting = False
    while True:
        lock.shared()  # (waits while a run builds it)
        found = _probe_existing(path, expected)[0] if rebuild != "always" else None
        if found is not None:
            return found
        lock.release()
        if lock.exclusive(wait=False):
            return None
        if release_own(path):  # this process's own earlier reader of it: rebuilt under it, as without a lock
            continue
        if not waiting:
            logger.info("feature cache %s: another run holds it; waiting for it", path)
            waiting = True
        time.sleep(1.0)


def _build_alone(path: Path, expected: dict, rebuild: str, args: dict, produce, progress: bool,
                 prefix_key: str | None) -> FeatureCache:
    cache = _settle(path, expected, rebuild)
    if cache is not None:
        return cache
    num_samples = expected["layout"]["num_samples"]
    sibling = find_sibling(path, expected, prefix_key) if prefix_key and rebuild != "always" else None
    if sibling is not None and len(sibling) >= num_samples:
        logger.info("feature cache: the first %d rows of the cache of %d at %s (the same rows)", num_samples,
                    len(sibling), sibling.path)
        return sibling.first(num_samples)
    if sibling is not None:
        logger.info("feature cache: %d of its %d rows read from the cache at %s (the same rows)", len(sibling),
                    num_samples, sibling.path)
        produce = PrefixFeed(sibling, produce)
    writer = FeatureCacheWriter(path, **args)
    _produce(writer, writer.missing_shards(), produce, progress)
    return writer.finalize()


def _settle(path: Path, expected: dict, rebuild: str) -> FeatureCache | None:
    """The complete matching cache at ``path``, or None once the folder is ready to be
    (re)built: stale files cleared, or a refusal under ``rebuild="never"``."""
    if rebuild == "always":
        _clear_cache_files(path)
        return None
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
    return None


def _produce(writer: FeatureCacheWriter, shards: list[int], produce, progress: bool) -> None:
    todo = sum(len(writer.shard_range(s)) for s in shards)
    logger.info("building feature cache at %s: %d of %d samples to produce", writer.path, todo,
                writer.layout["num_samples"])
    with tqdm(total=todo, unit="sample", desc="feature cache", disable=not progress, dynamic_ncols=True) as bar:
        for shard in shards:
            rows = writer.shard_range(shard)
            t0 = time.perf_counter()
            tensors = produce(rows)
            seconds = time.perf_counter() - t0
            if isinstance(produce, PrefixFeed):  # rows read from a sibling count at what building them cost
                seconds = produce.seconds
            writer.write_shard(shard, seconds=seconds, **tensors)
            bar.update(len(rows))


def _build_together(path: Path, expected: dict, rebuild: str, args: dict, produce, progress: bool,
                    world: World) -> FeatureCache:
    """Several ranks, one cache: rank 0 settles the folder and claims it, every rank scans
    it, rank r produces the missing shards s with s mod N = r, and rank 0 writes the
    manifest (each shard's entry names the rank that wrote it)."""
    verdict, cache, writer = None, None, None
    if world.is_main:
        try:
            cache = _settle(path, expected, rebuild)
            if cache is None:
                writer = FeatureCacheWriter(path, **args)
            verdict = "open" if cache is not None else "build"
        except OverRepError as exc:
            verdict = f"error: {exc}"
            raise
        finally:
            verdict = world.broadcast(verdict or "error: rank 0 failed")
    else:
        verdict = world.broadcast(None)
        if verdict.startswith("error: "):
            raise OverRepError(verdict[len("error: "):])
    if verdict == "build":
        if writer is None:
            writer = FeatureCacheWriter(path, **args, claim=False)
        world.barrier()  # every rank has scanned the folder before any writes into it
        _produce(writer, [s for s in writer.missing_shards() if s % world.size == world.rank], produce,
                 progress and world.is_main)
        world.barrier()
        if world.is_main:
            writer.adopt_written()
            cache = writer.finalize()
        world.barrier()
    return cache if cache is not None else FeatureCache.open(path, fingerprint=expected["fingerprint"],
                                                             verify=False)


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
