"""One cache's leading samples serving another: a plan that caches the first ``n`` of the same
training rows as a cache already on disk reads them there instead of running the dense model.

A time budget decides how many rows to cache from what its probe timed, so two runs of one
plan can ask for 994 and 1,200 of the same rows; the cache is keyed by its rows, and without
this the second rebuilt every feature it had on disk (66 s of a 12-minute default on a 2-core
Xeon, docs/results-log.md). A *sibling* is a complete cache in the same parent folder whose
record differs from the wanted one only in the fingerprint field that counts the rows (the
caller names it and vouches that sample ``i`` is the same sample in both) and in the number of
samples. One with at least ``n`` samples serves its first ``n`` as they are
(:meth:`~overrep.data.cache.reader.FeatureCache.first`); otherwise the largest one feeds the
new cache's leading shards (:class:`PrefixFeed`) and the dense model produces the rest.
The smaller cache stays on disk; :func:`clean` (``overrep cache --clean``) removes the caches
a larger sibling serves.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .format import MANIFEST, FeatureCacheCorrupt, FeatureCacheMismatch, _clear_cache_files, _read_json
from .lock import CacheLock
from .reader import FeatureCache

logger = logging.getLogger(__name__)


def _without(record: dict, key: str) -> dict:
    """``record`` with the fingerprint's ``key`` and the layout's sample count left out."""
    fingerprint = {k: v for k, v in (record.get("fingerprint") or {}).items() if k != key}
    layout = {k: v for k, v in (record.get("layout") or {}).items() if k != "num_samples"}
    return {**record, "fingerprint": fingerprint, "layout": layout}


def find_sibling(path: Path, expected: dict, key: str) -> FeatureCache | None:
    """The complete cache beside ``path`` whose samples begin with the ``expected`` record's
    (same fingerprint but for ``key``, same layout but for the sample count): the smallest
    that holds all of them, else the largest; opened with its shards' sha256 checked. One that
    fails its checks is passed over with a warning (it stays where it is) for the next."""
    want, n = _without(expected, key), expected["layout"]["num_samples"]
    found = []
    for folder in sorted(p for p in path.parent.iterdir() if p.is_dir() and p != path) if path.parent.is_dir() else []:
        try:
            manifest = _read_json(folder / MANIFEST) if (folder / MANIFEST).is_file() else None
        except (FeatureCacheCorrupt, OSError):
            continue
        if not isinstance(manifest, dict) or not isinstance(manifest.get("layout"), dict):
            continue
        stored = {k: manifest.get(k) for k in ("format", "version", "fingerprint", "layout")}
        if _without(stored, key) == want:
            found.append((manifest["layout"].get("num_samples", 0), folder))
    # those that hold all the rows, the smallest first, then the others, the largest first
    for _, folder in sorted(f for f in found if f[0] >= n) + sorted((f for f in found if f[0] < n), reverse=True):
        lock = CacheLock(folder)
        if not lock.shared(wait=False):  # another run is rebuilding it
            continue
        try:
            cache = FeatureCache.open(folder, verify=True)
        except (FeatureCacheCorrupt, FeatureCacheMismatch) as exc:
            lock.release()
            logger.warning("%s; not reading its rows", exc)
            continue
        cache.hold(lock)
        return cache
    return None


class PrefixFeed:
    """A shard producer that reads the rows a smaller ``sibling`` holds and has ``produce``
    compute the rest. :attr:`seconds` after a call: what those rows cost to build, the
    sibling's recorded seconds for the rows read (prorated by shard) plus the time spent
    computing the others, so that the new cache states its real building cost."""

    def __init__(self, sibling: FeatureCache, produce: Callable[[range], dict[str, torch.Tensor]]) -> None:
        self.sibling, self.produce = sibling, produce
        self.seconds: float | None = None
        self.rows_read = 0

    def __call__(self, rows: range) -> dict[str, torch.Tensor]:
        have = range(rows.start, max(rows.start, min(rows.stop, len(self.sibling))))
        got = self.sibling.get(list(have)) if len(have) else {}
        self.rows_read += len(have)
        t0 = time.perf_counter()
        rest = self.produce(range(have.stop, rows.stop)) if have.stop < rows.stop else None
        self.seconds = (time.perf_counter() - t0 if rest is not None else 0.0) + self.sibling.seconds_for(have)
        if rest is None:
            return got
        if not got:
            return rest
        return {k: torch.cat([got[k], rest[k].to("cpu", got[k].dtype)]) for k in got}


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def clean(root: Path, key: str, dry_run: bool = False) -> list[dict]:
    """Remove the complete caches under ``root`` that a larger sibling serves (same record
    but for ``key`` and the sample count: :func:`find_sibling` would read their rows there),
    once that sibling's shards pass their sha256 check, and the lock files of folders that are
    gone. A cache a run holds (building or reading it) is kept; so is a partial build (the run
    that started it resumes it). One dict per folder it looked at: ``folder``, ``bytes``,
    ``action`` (removed / would remove / kept) and ``why``."""
    done: list[dict] = []
    groups: dict[str, list[tuple[int, Path]]] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            manifest = _read_json(folder / MANIFEST) if (folder / MANIFEST).is_file() else None
        except (FeatureCacheCorrupt, OSError):
            manifest = None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("layout"), dict):
            if any(folder.iterdir()):
                done.append({"folder": str(folder), "bytes": _folder_bytes(folder), "action": "kept",
                             "why": "not complete (a partial build resumes; delete it by hand if none will)"})
            continue
        stored = _without({k: manifest.get(k) for k in ("format", "version", "fingerprint", "layout")}, key)
        groups.setdefault(json.dumps(stored, sort_keys=True), []).append(
            (int(manifest["layout"].get("num_samples", 0)), folder))
    for members in groups.values():
        members.sort()
        largest = members[-1][1]
        if len(members) > 1:
            try:
                FeatureCache.open(largest, verify=True)
            except (FeatureCacheCorrupt, FeatureCacheMismatch) as exc:
                done += [{"folder": str(f), "bytes": _folder_bytes(f), "action": "kept",
                          "why": f"the larger cache that holds its rows fails its check ({exc})"}
                         for _, f in members[:-1]]
                continue
        for rows, folder in members[:-1]:
            entry = {"folder": str(folder), "bytes": _folder_bytes(folder),
                     "why": f"its {rows} rows are the first of the {members[-1][0]} at {largest.name}"}
            lock = CacheLock(folder)
            if not lock.exclusive(wait=False):
                done.append({**entry, "action": "kept", "why": "in use by a run"})
                continue
            try:
                if not dry_run:
                    _clear_cache_files(folder)
                    if not any(folder.iterdir()):
                        folder.rmdir()
                        lock.path.unlink(missing_ok=True)  # while held: see lock's docstring
            finally:
                lock.release()
            done.append({**entry, "action": "would remove" if dry_run else "removed"})
    for stray in sorted(root.glob(".*.lock")) if root.is_dir() else []:
        folder = stray.with_name(stray.name[1:-len(".lock")])
        lock = CacheLock(folder)
        if not folder.exists() and lock.exclusive(wait=False):
            if not dry_run:
                stray.unlink(missing_ok=True)
            lock.release()
    return done
