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
  corrupt cache is detected instead of silently training on wrong features;
* **shared** -- runs that want one cache at once take turns: one builds it, the others
  wait and read it (:mod:`~overrep.data.cache.lock`); ``overrep cache --clean`` removes the
  caches a larger one of the same rows serves (:func:`~overrep.data.cache.prefix.clean`),
  never one a run holds.

Directory layout::

    <path>/fingerprint.json            written when a build starts (matches partial builds)
    <path>/shard-00000.safetensors     tensors [n, T, H] for samples [0, n)
    <path>/shard-00000.json            sidecar: size and sha256 of that shard
    ...
    <path>/manifest.json               written last; its presence means "complete"
    <parent>/.<name>.lock              the lock runs take turns on (stays beside the folder)
"""

from .build import build_or_open
from .format import FeatureCacheCorrupt, FeatureCacheMismatch
from .reader import FeatureCache
from .writer import FeatureCacheWriter

__all__ = ["FeatureCache", "FeatureCacheCorrupt", "FeatureCacheMismatch", "FeatureCacheWriter", "build_or_open"]
