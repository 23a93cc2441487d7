"""RankAdaptor: LoRA whose rank differs from block to block, chosen by a performance-model search.

Zhou et al., "RankAdaptor: Hierarchical Rank Allocation for Efficient Fine-Tuning Pruned
LLMs via Performance Model" (NAACL Findings 2025, arXiv 2406.15734). Written from the
paper's description: no public code of it was found, so the details below are ours, and
say so where they are.

The idea (the paper's): structural pruning changes blocks unevenly, so one LoRA rank for
every layer spends a fixed trainable budget poorly. A lightweight *performance model* maps a
per-layer rank configuration to the quality a short recovery reaches; it is fitted offline
on sampled configurations that were really fine-tuned and measured, then used online: it
scores many candidate configurations, the few it predicts best are really measured, and
those measurements join its training set (incremental learning), until the search budget
is spent. The recovery is then LoRA with the best configuration.

Here:

* **What is searched**: one rank per decoder block (the paper's layer-specific ranks), the
  same for every projection of the block; alpha follows the rank (alpha_i = r_i *
  lora_alpha / lora_rank: LoRA's scaling alpha / r kept, as lora-iso keeps it). Blocks
  without projections (Mamba-2 mixers) get none.
* **Budget** (the paper keeps LoRA's trainable parameters; the constraint is ours): the
  ranks' mean over the blocks is exactly ``recovery.lora_rank`` = r, which with blocks of
  one shape (block removal, uniform width pruning) is exactly LoRA's trainable count. A
  configuration draws each block's rank from {r/2, r, 3r/2, 2r} (rounded half up, at least
  1) and is then projected onto the mean: random blocks move towards it by up to r/2 at a
  time, staying within [r/2, 2r].
* **A probe** (one real measurement): a copy of the pruned model with that LoRA, trained
  ``rankadaptor_probe_steps`` steps by the run's Trainer (AdamW, cosine schedule, clipping)
  on the language-model loss over the training rows less a validation slice (the last
  ``rankadaptor_val_sequences`` rows; one row between them left out, as packed rows may
  share a document), scored by its mean loss on that slice. The held-out rows the report
  uses are never read. Every probe starts from ``recovery.seed`` (common random numbers:
  probes differ by their ranks, not by their noise).
* **Offline phase**: the uniform configuration (plain LoRA: the search never picks a
  configuration measured worse than it) plus random ones: half of ``rankadaptor_probes``
  (rounded up), at least two.
* **Performance model** (ours; the paper's is a small learned regressor): ridge regression
  in its dual (kernel) form, as configurations are fewer than features, from
  [x_i - 1, (x_i - 1)^2] per block (x_i = r_i / r: a gain per block and its diminishing
  return) to the validation loss; the penalty is chosen from a fixed grid by closed-form
  leave-one-out error. Deterministic. Reported: its training and leave-one-out R^2 and RMSE,
  and its error on each online probe, predicted before it was measured.
* **Online phase**: per round, ``rankadaptor_candidates`` configurations (half random, half
  moves of r/2 of rank from one block to another starting at the three best measured) are
  scored; the best two predicted that are not measured yet are measured and join the
  training set; rounds repeat until ``rankadaptor_probes`` measurements are spent.
* **Choice**: the configuration with the lowest *measured* validation loss.
* **Under a time budget** (ours): the search is part of the method's wall-clock, so it stops
  before a probe (at the mean probe time so far) would pass ``rankadaptor_budget_share`` of
  the budget; the uniform probe always runs. With one probe measured the result is the
  uniform configuration, i.e. plain LoRA that paid for one probe.

The search runs once per inputs: its result is cached as JSON under the cache root
(``cache.dir``, ``rankadaptor/<digest>.json``) keyed by the teacher's fingerprint (model,
plan, training data, sequence length, dtype), the training rows and every recovery setting
a probe reads. A time budget's rebuild, ``--resume`` and ``overrep export`` read it back; its
seconds count in the run that paid them (``search_seconds``; the pipeline's budget clock
starts before the first build). ``overrep plan`` (no data) neither searches nor needs it:
uniform ranks have the same trainable count. The search leaves the global random state as it
found it, so the final LoRA starts from the same weights whether the search ran or was read.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import random
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...atomic import write_json
from ...memo import tensor_digest
from ...errors import OverRepError
from ...model.runtime import digest
from ..budget import parse_duration
from ..objectives import LanguageModeling
from ..teacher import MethodInputs
from ..trainer import Trainer
from .adapters import AdapterRun, lora_config, projections_by_block
from .base import Method

log = logging.getLogger(__name__)

RANK_FACTORS = (0.5, 1.0, 1.5, 2.0)  # each block's candidate ranks, in units of recovery.lora_rank
PER_ROUND = 2  # configurations really measured per online round
LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # ridge penalties (leave-one-out error picks one)
GAP = 1  # training rows left out between the probes' rows and their validation slice
VERSION = 2  # of the search: a change makes older cached results stale
#: the recovery settings a probe reads: they key the cached search
PROBE_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lr", "batch_size", "grad_accum", "min_lr_ratio",
                "warmup_ratio", "warmup_steps", "betas", "grad_clip", "seed", "rankadaptor_probes", "rankadaptor_probe_steps",
                "rankadaptor_candidates", "rankadaptor_val_sequences", "time_budget", "rankadaptor_budget_share",
                "precision")


@dataclass
class RankAdaptorOptions:
    """``recovery`` options of RankAdaptor: per-block LoRA ranks, mean ``lora_rank``, chosen by
    a performance-model search (cached)."""

    rankadaptor_probes: int = 8  # rank configurations really fine-tuned and measured (the uniform one and ~half sampled offline, the rest proposed online)
    rankadaptor_probe_steps: int = 10  # optimiser steps of each probe's short LoRA fine-tune (the search costs probes x probe_steps LoRA steps, plus one validation each)
    rankadaptor_candidates: int = 2000  # configurations the performance model scores per online round (the best two are measured)
    rankadaptor_budget_share: float = 0.5  # under recovery.time_budget the search stops once another probe would pass this share of the budget (the uniform probe always runs)
    rankadaptor_val_sequences: int = 8  # training rows held back to score the probes (validation loss; never the held-out rows)

    def check_rankadaptor(self, train_sequences: int, searches: bool) -> None:
        """``searches``: the run's method is this search (its rows must hold a batch)."""
        for name, low in (("probes", 2), ("probe_steps", 1), ("candidates", 1), ("val_sequences", 1)):
            v = getattr(self, f"rankadaptor_{name}")
            if v < low:
                raise OverRepError(f"recovery.rankadaptor_{name} must be >= {low}, got {v}")
        if not 0 < self.rankadaptor_budget_share <= 1:
            raise OverRepError(f"recovery.rankadaptor_budget_share must be in (0, 1], got "
                               f"{self.rankadaptor_budget_share}")
        left, batch = train_sequences - self.rankadaptor_val_sequences - GAP, self.batch_size * self.grad_accum
        if searches and left < batch:
            raise OverRepError(f"recovery.rankadaptor_val_sequences={self.rankadaptor_val_sequences} leaves "
                               f"{max(left, 0)} of the {train_sequences} training rows to the search's probes, fewer "
                               f"than one batch ({batch}); lower it or add data")


@dataclass(frozen=True)
class RankSpace:
    """Ranks for ``blocks`` blocks whose mean is ``rank``, each within the candidate ranks' range."""

    blocks: int
    rank: int

    @property
    def levels(self) -> list[int]:
        return sorted({max(1, int(f * self.rank + 0.5)) for f in RANK_FACTORS})

    @property
    def step(self) -> int:
        return max(1, int(0.5 * self.rank + 0.5))

    def uniform(self) -> tuple[int, ...]:
        return (self.rank,) * self.blocks

    @property
    def searchable(self) -> bool:
        """Whether any configuration but the uniform one meets the constraint."""
        return self.blocks >= 2 and self.levels[0] < self.rank < self.levels[-1]

    def project(self, ranks, rng: random.Random) -> tuple[int, ...]:
        """``ranks`` moved onto the mean: random blocks step towards it, within the range."""
        lo, hi = self.levels[0], self.levels[-1]
        ranks = list(ranks)
        diff = sum(ranks) - self.blocks * self.rank
        while diff:
            down = diff > 0
            i = rng.choice([i for i, v in enumerate(ranks) if (v > lo if down else v < hi)])
            delta = min(abs(diff), self.step, ranks[i] - lo if down else hi - ranks[i])
            ranks[i] += -delta if down else delta
            diff += -delta if down else delta
        return tuple(ranks)

    def sample(self, rng: random.Random) -> tuple[int, ...]:
        return self.project([rng.choice(self.levels) for _ in range(self.blocks)], rng)

    def move(self, ranks, rng: random.Random) -> tuple[int, ...] | None:
        """Up to r/2 of rank moved from one block to another (the mean is kept)."""
        lo, hi = self.levels[0], self.levels[-1]
        up = [i for i, v in enumerate(ranks) if v < hi]
        if not up:
            return None
        i = rng.choice(up)
        down = [j for j, v in enumerate(ranks) if v > lo and j != i]
        if not down:
            return None
        j = rng.choice(down)
        s = min(self.step, hi - ranks[i], ranks[j] - lo)
        out = list(ranks)
        out[i], out[j] = out[i] + s, out[j] - s
        return tuple(out)


class PerformanceModel:
    """Ridge regression (dual form) from a rank configuration to its validation loss."""

    def __init__(self, rank: int):
        self.rank = rank

    def features(self, configs) -> torch.Tensor:
        x = torch.tensor(configs, dtype=torch.float64) / self.rank - 1
        return torch.cat([x, x * x], dim=1)

    def fit(self, configs, losses) -> dict:
        """Fit on the measured configurations; the fit's quality."""
        x = self.features(configs)
        self.mean = x.mean(0)
        self.x = x - self.mean
        y = torch.tensor(losses, dtype=torch.float64)
        self.y0 = y.mean()
        y = y - self.y0
        gram, eye = self.x @ self.x.T, torch.eye(len(losses), dtype=torch.float64)
        best = None
        for lam in LAMBDAS:
            inv = torch.linalg.inv(gram + lam * eye)
            hat = gram @ inv
            resid = y - hat @ y
            loo = resid / (1 - hat.diagonal()).clamp_min(1e-9)  # closed-form leave-one-out residuals
            if best is None or (loo ** 2).mean() < (best[3] ** 2).mean():
                best = (lam, inv @ y, resid, loo)
        lam, self.coef, resid, loo = best
        total = float((y ** 2).sum())

        def r2(e):
            return 1 - float((e ** 2).sum()) / total if total > 0 else None

        return {"kind": "ridge (dual form)", "features": "per block x-1 and (x-1)^2, x = rank / lora_rank",
                "lambda": lam, "fitted_on": len(losses), "train_r2": r2(resid), "loo_r2": r2(loo),
                "loo_rmse": float((loo ** 2).mean().sqrt())}

    def predict(self, configs) -> list[float]:
        return ((self.features(configs) - self.mean) @ self.x.T @ self.coef + self.y0).tolist()


def block_config(r, by_block: list[list[str]], ranks: dict[int, int]):
    """LoRA on every projection, block ``i``'s at rank ``ranks[i]`` and alpha scaled with it."""
    names = {re.escape(n): i for i, block in enumerate(by_block) for n in block}  # PEFT reads regexes
    return lora_config(r, [n for block in by_block for n in block], r.lora_rank, r.lora_alpha,
                       rank_pattern={k: ranks[i] for k, i in names.items()},
                       alpha_pattern={k: ranks[i] * r.lora_alpha / r.lora_rank for k, i in names.items()})


def check_ranks(peft_model, by_block: list[list[str]], ranks: dict[int, int]) -> None:
    """Every projection got its block's rank (PEFT matched the patterns as meant)."""
    model = peft_model.base_model.model
    for i, block in enumerate(by_block):
        for name in block:
            got = model.get_submodule(name).r["default"]
            if got != ranks[i]:
                raise OverRepError(f"rankadaptor: {name} got LoRA rank {got}, not its block's {ranks[i]}")


class RankSearch:
    """The performance-model search on one set of inputs (see the module docstring)."""

    def __init__(self, inputs: MethodInputs, by_block: list[list[str]]):
        self.inputs, self.cfg, self.by_block = inputs, inputs.config, by_block
        self.blocks = [i for i, names in enumerate(by_block) if names]
        self.space = RankSpace(len(self.blocks), self.cfg.lora_rank)
        ids, v = inputs.train_ids, self.cfg.rankadaptor_val_sequences
        n, batch = ids.shape[0], self.cfg.batch_size * self.cfg.grad_accum
        if n - v - GAP < batch:
            raise OverRepError(f"recovery.rankadaptor_val_sequences={v} leaves {max(n - v - GAP, 0)} of the {n} "
                               f"training rows to the search's probes, fewer than one batch ({batch})")
        self.train_rows, self.val_rows = ids[:n - v - GAP], ids[n - v:]
        self.probes: list[dict] = []
        #: under a time budget the search may spend this share of it (seconds), then stops
        self.allowance = (parse_duration(self.cfg.time_budget) * self.cfg.rankadaptor_budget_share
                          if self.cfg.time_budget is not None and self.cfg.steps is None else None)

    def out_of_time(self) -> bool:
        """Another probe (at the mean probe time so far) would overrun the search's share of a
        time budget. The uniform probe always runs: the choice is never worse than plain LoRA."""
        if self.allowance is None or not self.probes:
            return False
        elapsed = time.perf_counter() - self.started
        return elapsed + elapsed / len(self.probes) > self.allowance

    def probe(self, config: tuple[int, ...]) -> float:
        """Validation loss after a short LoRA fine-tune with ``config`` on a copy of the pruned model."""
        from peft import get_peft_model

        cfg, steps = self.cfg, self.cfg.rankadaptor_probe_steps
        ranks = dict(zip(self.blocks, config))
        torch.manual_seed(cfg.seed)
        model = get_peft_model(copy.deepcopy(self.inputs.pruned), block_config(cfg, self.by_block, ranks))
        check_ranks(model, self.by_block, ranks)
        objective = LanguageModeling(model, self.train_rows, None, decayed=set(), precision=cfg.precision)
        with tempfile.TemporaryDirectory(prefix="rankadaptor-") as tmp:  # the trainer's last checkpoint
            Trainer(objective, self.train_rows.shape[0], dataclasses.replace(cfg, checkpoint_every=steps,
                    eval_every=steps), steps, Path(tmp), progress=False).run()
        objective.val_ids = self.val_rows
        return objective.validation_loss()

    def measure(self, config: tuple[int, ...], phase: str, predicted: float | None = None) -> None:
        t0 = time.perf_counter()
        loss = self.probe(config)
        seconds = time.perf_counter() - t0
        self.probes.append({"ranks": list(config), "val_loss": loss, "phase": phase, "predicted": predicted,
                            "seconds": seconds})
        done, total = len(self.probes), self.cfg.rankadaptor_probes
        elapsed = time.perf_counter() - self.started
        log.info("rankadaptor probe %d/%d (%s): ranks %s -> validation loss %.4f%s, %.1f s; about %.0f s left",
                 done, total, phase, list(config), loss, "" if predicted is None else f" (predicted {predicted:.4f})",
                 seconds, elapsed / done * max(0, total - done))

    def measured(self) -> set[tuple[int, ...]]:
        return {tuple(p["ranks"]) for p in self.probes}

    def fresh(self, rng: random.Random, count: int) -> list[tuple[int, ...]]:
        """Up to ``count`` random configurations not measured yet, all different."""
        out, seen = [], self.measured()
        for _ in range(50 * count + 100):
            if len(out) == count:
                break
            c = self.space.sample(rng)
            if c not in seen:
                seen.add(c)
                out.append(c)
        return out

    def candidates(self, rng: random.Random, count: int) -> list[tuple[int, ...]]:
        """Half random, half moves from the three best measured; none measured yet."""
        best = [tuple(p["ranks"]) for p in sorted(self.probes, key=lambda p: p["val_loss"])[:3]]
        out: dict[tuple[int, ...], None] = {}
        for k in range(count):
            if k % 2 == 0:
                c = self.space.sample(rng)
            else:
                c = self.space.move(best[(k // 2) % len(best)], rng)
                if c is not None and k % 4 == 3:  # every other move goes two steps
                    c = self.space.move(c, rng)
            if c is not None:
                out[c] = None
        measured = self.measured()
        return [c for c in out if c not in measured]

    def run(self) -> dict:
        self.started = time.perf_counter()
        cfg, space = self.cfg, self.space
        total = cfg.rankadaptor_probes
        result = {"version": VERSION, "blocks": self.blocks, "candidate_ranks": space.levels,
                  "val_sequences": int(self.val_rows.shape[0]), "probe_steps": cfg.rankadaptor_probe_steps}
        if not space.searchable:  # e.g. lora_rank 1 or a single block: the mean leaves one configuration
            log.info("rankadaptor: no configuration but the uniform one has mean rank %d; nothing to search",
                     space.rank)
            return {**result, "ranks": list(space.uniform()), "probes": [], "performance_model": None,
                    "seconds": time.perf_counter() - self.started}
        rng = random.Random(cfg.seed)
        model = PerformanceModel(space.rank)
        log.info("rankadaptor: searching per-block LoRA ranks (mean %d, from %s) with %d probes of %d steps",
                 space.rank, space.levels, total, cfg.rankadaptor_probe_steps)
        for c in [space.uniform()] + self.fresh(rng, max(2, (total + 1) // 2) - 1):  # offline
            if self.out_of_time():
                break
            self.measure(c, "offline")
        while len(self.probes) < total and not self.out_of_time():  # online: the model proposes, the best are measured
            model.fit([p["ranks"] for p in self.probes], [p["val_loss"] for p in self.probes])
            found = self.candidates(rng, cfg.rankadaptor_candidates) or self.fresh(rng, PER_ROUND)
            if not found:
                break  # every configuration it can reach is measured
            predicted = model.predict(found)
            order = sorted(range(len(found)), key=lambda j: (predicted[j], found[j]))
            for j in order[:min(PER_ROUND, total - len(self.probes))]:
                if self.out_of_time():
                    break
                self.measure(found[j], "online", predicted[j])
        truncated = len(self.probes) < total
        if truncated:
            log.info("rankadaptor: the search stops after %d of %d probes: its share of the time budget "
                     "(%.0f s) is spent", len(self.probes), total, self.allowance)
        if len(self.probes) < 2:  # nothing to compare or fit: plain LoRA's uniform ranks
            return {**result, "ranks": list(space.uniform()), "probes": self.probes, "performance_model": None,
                    "uniform_val_loss": self.probes[0]["val_loss"], "best_val_loss": self.probes[0]["val_loss"],
                    "truncated": truncated, "seconds": time.perf_counter() - self.started}
        fit = model.fit([p["ranks"] for p in self.probes], [p["val_loss"] for p in self.probes])
        online = [abs(p["predicted"] - p["val_loss"]) for p in self.probes if p["predicted"] is not None]
        fit["online_mae"] = sum(online) / len(online) if online else None
        best = min(self.probes, key=lambda p: p["val_loss"])  # ties: the first, the uniform one first of all
        seconds = time.perf_counter() - self.started
        log.info("rankadaptor: chose ranks %s (validation loss %.4f; uniform %.4f) after %d probes in %.0f s",
                 best["ranks"], best["val_loss"], self.probes[0]["val_loss"], len(self.probes), seconds)
        return {**result, "ranks": best["ranks"], "probes": self.probes, "performance_model": fit,
                "best_val_loss": best["val_loss"], "uniform_val_loss": self.probes[0]["val_loss"],
                "truncated": truncated, "seconds": seconds}


def search_path(inputs: MethodInputs) -> tuple[Path, str]:
    """Where the search on ``inputs`` is cached, and its key."""
    r = inputs.config
    key = digest({"version": VERSION, "teacher": inputs.teacher.fingerprint,
                  "train": tensor_digest(inputs.train_ids), "recovery": {k: getattr(r, k) for k in PROBE_FIELDS}})
    return Path(inputs.teacher.cache_root) / "rankadaptor" / f"{key}.json", key


def cached_search(path: Path, key: str) -> dict | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: search again
        return None
    return found if isinstance(found, dict) and found.get("key") == key else None


class RankAdaptorRun(AdapterRun):
    """LoRA with the per-block ranks RankSearch found (read from its cache when it ran before).

    ``with_data=False`` (``overrep plan``, re-exporting) only reads the cache; with none
    there the ranks are uniform (the same trainable count)."""

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        check_ranks(self.peft_model, self.by_block, self.block_ranks)

    def lora_config(self, targets: list[str], rank: int, alpha: float):
        inputs = self.inputs
        self.by_block = projections_by_block(inputs.pruned)
        path, key = search_path(inputs)
        world = inputs.teacher.world
        with world.main_first():  # several ranks: rank 0 searches, the others may find it in the cache
            found = cached_search(path, key)
            if found is None and self.with_data:
                with torch.random.fork_rng():  # the final LoRA's initialisation does not depend on the search
                    found = {**RankSearch(inputs, self.by_block).run(), "key": key}
                write_json(path, found, "the RankAdaptor search result")
                self.searched_now = True
        self.search = found = world.broadcast(found)  # every rank trains rank 0's configuration
        chosen = dict(zip(found["blocks"], found["ranks"])) if found else {}
        self.block_ranks = {i: chosen.get(i, rank) for i, names in enumerate(self.by_block) if names}
        self.search_seconds = found["seconds"] if found else 0.0
        return block_config(inputs.config, self.by_block, self.block_ranks)

    def summary(self) -> dict:
        ranks = list(self.block_ranks.values())
        out = {"block_ranks": {str(i): r for i, r in self.block_ranks.items()}, "mean_rank": sum(ranks) / len(ranks),
               "search": "ran" if self.searched_now else "cached" if self.search else "not run (uniform ranks)",
               "search_seconds": self.search_seconds}
        if self.search:
            out.update({k: self.search.get(k) for k in ("candidate_ranks", "val_sequences", "probe_steps",
                                                          "performance_model", "uniform_val_loss", "best_val_loss",
                                                          "truncated")})
            out["probes"] = [{k: p[k] for k in ("ranks", "val_loss", "phase", "predicted")}
                             for p in self.search["probes"]]
        return out

    def finish(self) -> dict:
        return {**super().finish(), "rankadaptor": self.summary()}

    def describe(self) -> dict:
        return {**super().describe(), "rankadaptor": self.summary()}
