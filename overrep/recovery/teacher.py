"""The dense model's side of layer-wise recovery, and what a recovery method receives.

:class:`Teacher` gives the features a layer-wise method trains on (per recovery group,
the hidden state entering it and the one it must reproduce), cached on disk
(``cache.mode: disk``) or recomputed every step (``live``), and is where the losses'
dense-model constants (diagonal Fisher, top-K log-probabilities) are cached next to
them. :class:`MethodInputs` is everything a method gets: the pruned and the dense
model, the plan, the data, its config section and the teacher, and nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..core.precision import autocast
from ..data.cache import build_or_open
from ..distributed import SINGLE, World
from ..memo import tensor_digest
from ..model.prefix import SharedPrefix
from ..model.hooks import teacher_features
from ..model.placement import input_device
from ..model.streaming import stream_features
from ..model.runtime import digest
from ..model.surgery import PrunePlan

FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TEACHER_BATCH = 8  # rows per dense forward when computing features
PROBE_ROWS = 2 * TEACHER_BATCH  # training rows a probe (mode "probe") computes features for
ROWS_KEY = "rows"  # the fingerprint field of a cache of the first rows only (use_rows; prefix.py)

#: A batch source: row indices -> per recovery group ``{"inputs", "targets"}``.
FeatureSource = Callable[[list[int]], list[dict]]


@dataclass
class Teacher:
    """Dense-model features of the training rows for every recovery group of a plan.

    ``fingerprint`` keys the disk cache (model, plan, data, sequence length, dtype);
    ``seconds`` accumulates the time spent building or opening it."""

    dense: nn.Module
    plan: PrunePlan
    train_ids: torch.Tensor
    cache_root: Path
    fingerprint: dict
    mode: str = "disk"  # "disk" | "live" | "probe" (features of the first rows only, cycled: for timing steps)
    dtype: str = "float32"  # stored feature dtype
    rebuild: str = "auto"
    progress: bool = True
    seconds: float = 0.0
    row_seconds: float | None = None  # measured by a probe: teacher seconds per training row
    world: World = SINGLE  # several ranks build the disk cache together (overrep.distributed)
    stream_from: Path | None = None  # a safetensors folder: features by streaming its blocks (overrep.model.streaming)
    precision: str = "fp32"  # the dense forward's: recovery.precision, resolved ("bf16": under bf16 autocast)
    #: features a budget's probe computed (its training rows, the validation rows), by rows' digest: the
    #: method built after it reads them instead of running the dense model on those rows again (a probe's
    #: copy, ``dataclasses.replace``, shares this dict); emptied once the feature cache is built
    kept: dict = field(default_factory=dict, repr=False)
    cache: Any = field(default=None, repr=False)
    #: every training row of the data; ``train_ids`` are the first of them, the ones cached
    all_ids: torch.Tensor | None = field(default=None, repr=False)
    #: rows past the cache whose features were computed when a batch read them, and their seconds
    live_rows_read: int = 0
    live_seconds: float = 0.0

    def __post_init__(self):
        if self.all_ids is None:
            self.all_ids = self.train_ids

    def use_rows(self, n: int) -> None:
        """Cache the first ``n`` rows only (a time budget that needs no more); they get a
        cache of their own. The rest stay readable past the cache (:meth:`features`).
        A cache of more of the same rows serves them, one of fewer its rows
        (:mod:`overrep.data.cache.prefix`): two runs whose probes timed a step a little
        differently cache different counts of the same rows.
        """
        if n < self.train_ids.shape[0]:
            self.train_ids = self.train_ids[:n]
            self.fingerprint = {**self.fingerprint, ROWS_KEY: n}

    def batch(self, ids: torch.Tensor, inputs_only: bool = False) -> list[dict]:
        """Features of ``ids`` for every recovery group, ``TEACHER_BATCH`` rows at a time,
        in the training's precision (bf16 autocast computes them 2.7x faster on an AVX512-BF16
        CPU, within 1% of the fp32 features: docs/speed.md); stored as ``dtype``. With
        ``inputs_only``, the ``inputs`` alone, from the blocks before the groups (a streamed
        teacher computes both)."""
        groups = self.plan.groups
        device = input_device(self.dense)  # where it computes (a placed model's weights may sit on "meta")
        with autocast(self.precision, device):
            if self.stream_from is not None:
                return stream_features(self.stream_from, ids.cpu(), groups, dtype=self.dense.dtype,
                                       batch=TEACHER_BATCH, outside_from=self.dense, device=device)
            parts = [self._features(ids[i:i + TEACHER_BATCH], inputs_only) for i in range(0, ids.shape[0], TEACHER_BATCH)]
        keys = ("inputs",) if inputs_only else ("inputs", "targets")
        return [{k: torch.cat([p[g][k] for p in parts]) for k in keys} for g in range(len(groups))]

    def _features(self, ids: torch.Tensor, inputs_only: bool) -> list[dict]:
        """One batch's features: :attr:`kept` ones (a probe's, the same rows in the same
        batches: the same figures), else computed, and kept when a probe computes them."""
        key = tensor_digest(ids)
        got = self.kept.get((key, False)) or self.kept.get((key, inputs_only))
        if got is None:
            got = teacher_features(self.dense, ids, self.plan.groups, inputs_only)
            if self.mode == "probe":
                self.kept[(key, inputs_only)] = got
        return got

    @property
    def live_share(self) -> float:
        """What a row's ``inputs`` alone cost against its whole features: the share of the
        dense blocks they run (a row read past the cache by a loss without targets pays this)."""
        if self.stream_from is not None:
            return 1.0
        groups = self.plan.groups
        whole = max(g.target_layer for g in groups) + 1
        return max(1, max(g.input_layer for g in groups)) / whole

    @property
    def cache_path(self) -> Path:
        return self.cache_root / "features" / digest(self.fingerprint)

    def features(self) -> FeatureSource:
        """The training batch source: the disk cache (built on first use) or the live teacher.

        From the disk cache, a row index past the cached rows (``train_ids``) reads row
        ``all_ids[i]`` with its features computed now, at the cost a cached row paid once: a
        one-pass later phase whose step count the budget's re-fits raised past the rows the
        first plan cached reads on (``Objective.live_rows``) instead of reading rows twice. Such
        a row has its ``inputs`` only (:attr:`Loss.live <overrep.recovery.losses.Loss.live>`: the
        phase's loss reads no targets), which the blocks before the groups compute
        (:attr:`live_share` of the cost)."""
        groups = self.plan.groups
        if self.mode == "probe":
            return self._probe(PROBE_ROWS)
        if self.mode == "live":
            return lambda idx: self.batch(self.train_ids[idx])
        names = tuple(f"{k}_{g}" for g in range(len(groups)) for k in ("inputs", "targets"))

        def produce(rows: range) -> dict:
            feats = self.batch(self.train_ids[rows.start:rows.stop])
            return {f"{k}_{g}": f[k].cpu() for g, f in enumerate(feats) for k in ("inputs", "targets")}

        t0 = time.perf_counter()
        self.cache = build_or_open(self.cache_path, fingerprint=self.fingerprint, num_samples=self.train_ids.shape[0],
                                   seq_len=self.train_ids.shape[1], hidden_size=self.dense.config.hidden_size,
                                   dtype=FEATURE_DTYPES[self.dtype], produce=produce, tensors=names,
                                   rebuild=self.rebuild, progress=self.progress, world=self.world,
                                   prefix_key=ROWS_KEY)  # (use_rows: the first rows of the same data)
        self.seconds += time.perf_counter() - t0
        self.kept.clear()  # (the probe's features of the training rows are in the cache now)

        def cached(idx: list[int]) -> list[dict]:
            got = self.cache.get(idx)
            return [{"inputs": got[f"inputs_{g}"], "targets": got[f"targets_{g}"]} for g in range(len(groups))]
        return self._past_cache(cached)

    def _past_cache(self, cached: FeatureSource) -> FeatureSource:
        """``cached`` for the cached rows' indices; rows past them computed when read (their
        ``inputs``), stored as the cache stores them."""
        n, dtype = self.train_ids.shape[0], FEATURE_DTYPES[self.dtype]

        def source(idx: list[int]) -> list[dict]:
            if min(idx) < n:  # (a batch is all cached rows or all rows past them: sampler.step_batch)
                return cached(idx)
            if max(idx) >= self.all_ids.shape[0]:
                raise IndexError(f"training row {max(idx)} requested; the data holds {self.all_ids.shape[0]}")
            t0 = time.perf_counter()
            feats = self.batch(self.all_ids[idx], inputs_only=True)
            live = [{k: v.to("cpu", dtype) for k, v in f.items()} for f in feats]
            self.live_seconds += time.perf_counter() - t0
            self.live_rows_read += len(idx)
            return live
        return source


    def _probe(self, n: int) -> FeatureSource:
        """Features of the first ``n`` rows for any index (cycled), timing the teacher on the
        second half of them (the first forward pays one-off costs)."""
        n = min(n, self.train_ids.shape[0])
        half = max(1, n // 2)
        t0 = time.perf_counter()
        first = self.batch(self.train_ids[:half])
        t1 = time.perf_counter()
        second = self.batch(self.train_ids[half:n]) if n > half else []
        self.row_seconds = (time.perf_counter() - t1) / (n - half) if n > half else (t1 - t0) / half
        feats = [{k: torch.cat([f[k]] + ([second[g][k]] if second else [])) for k in f}
                 for g, f in enumerate(first)]
        rows = feats[0]["inputs"].shape[0]
        return lambda idx: [{k: v[[i % rows for i in idx]] for k, v in f.items()} for f in feats]


@dataclass
class MethodInputs:
    """What a recovery method is built from.

    ``config`` is the run's ``recovery`` section (learning rate resolved); ``total_steps``
    the step count the schedules span; ``teacher`` the dense side (features, loss
    constants); ``val_ids`` the validation rows (training documents no training row uses)
    that ``val_ppl`` and ``recovery.keep_best`` read, or None: neither then."""

    pruned: nn.Module
    dense: nn.Module
    plan: PrunePlan
    config: Any
    train_ids: torch.Tensor
    heldout_ids: torch.Tensor
    total_steps: int
    teacher: Teacher
    val_ids: torch.Tensor | None = None
    prefix: SharedPrefix | None = None  # the blocks the pruned model shares with the dense one (validations run them once)
    progress: bool = True  # progress bars of a method's own set-up (LinearPatch-KD's distillation); off under --quiet
