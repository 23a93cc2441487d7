"""Time budgets in the pipeline: measure, then fix the step count (and the rows to cache).

The arithmetic is :mod:`overrep.recovery.budget`; this mixin of
:class:`~overrep.app.pipeline.Pipeline` runs the measurements on the run's own models and
data. Several ranks (``torchrun``) all measure, but rank 0's figures decide, so that every
rank trains the same number of steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..recovery.budget import StepCosts, fit_steps, parse_duration
from ..recovery.methods import build_recovery
from ..recovery.teacher import PROBE_ROWS

log = logging.getLogger("overrep.app.pipeline")


class BudgetStages:
    """The pipeline's time-budget stages (see :mod:`overrep.recovery.budget`)."""

    def budget_sizes_cache(self) -> bool:
        """A layer-wise method on the disk cache under a time budget: the budget decides how
        many training rows get features (see :mod:`overrep.recovery.budget`)."""
        r = self.cfg.recovery
        return (self.method.needs_features and self.cfg.cache.mode == "disk"
                and r.time_budget is not None and r.steps is None)

    def fit_cached_budget(self) -> None:
        """Fix the step count and the rows to cache from a probe: the teacher timed on a few
        rows, a few real steps on their features; then a fresh pruned model."""
        r = self.cfg.recovery
        budget = parse_duration(r.time_budget)
        per_step = r.batch_size * r.grad_accum
        total = self.checkpointed_total() if self.resume else None
        info = {"seconds": budget}
        if total is None:
            self.teacher.mode = "probe"
            try:
                t0 = time.perf_counter()
                self.recovery = build_recovery(self.method_inputs(), self.method)
                rebuild = time.perf_counter() - t0 - PROBE_ROWS * self.teacher.row_seconds  # paid again below
                costs = self.make_trainer().measure()
            finally:
                self.teacher.mode = self.cfg.cache.mode
            costs = dataclasses.replace(costs, row=self.teacher.row_seconds, rows_per_step=per_step,
                                        max_rows=self.train_ids.shape[0], passes=r.budget_passes)
            left = budget - (time.perf_counter() - self.recovery_started) - max(0.0, rebuild)
            total = self.fit_budget(costs, left, info)
            log.info("time budget %.0f s: %.2f s per step, %.3f s per row of features, %.0f s left -> %d steps on "
                     "%d rows", budget, costs.step, costs.row, left, total, costs.rows(total))
        rows = StepCosts(0, 0, 0, rows_per_step=per_step, max_rows=self.train_ids.shape[0],
                         passes=r.budget_passes).rows(total)
        self.train_ids = self.train_ids[:rows]
        self.teacher.use_rows(rows)
        self.total_steps = info["steps"] = total
        info["rows"] = rows
        self.metrics["time_budget"] = info
        torch.manual_seed(r.seed)  # the measured steps leave no trace: fresh model, fresh recovery
        self.prune()

    def checkpointed_total(self) -> int | None:
        """The step count the newest checkpoint was trained for (a budgeted run's is measured)."""
        found = sorted((self.out / "checkpoints").glob("step-*.pt"))
        if not found:
            return None
        try:
            return int(torch.load(found[-1], map_location="cpu", weights_only=True)["total_steps"])
        except Exception:
            return None  # the trainer's resume reports the unreadable file

    def fit_budget(self, costs: StepCosts, left: float, info: dict) -> int:
        """The step count for ``left`` seconds at ``costs`` (3% kept for what is not measured);
        the trainer re-fits it to the deadline once it has timed real steps."""
        r = self.cfg.recovery
        self.budget_costs = costs = self.world.broadcast(costs)  # rank 0's figures decide
        info.update({f"measured_{k}": v for k, v in (("seconds_per_step", costs.step),
                     ("validation_seconds", costs.validation), ("checkpoint_seconds", costs.checkpoint),
                     ("feature_seconds_per_row", costs.row)) if v})
        return self.world.broadcast(fit_steps(0.97 * left, costs, r.eval_every, r.checkpoint_every))

    def fit_time_budget(self) -> None:
        """``recovery.time_budget``: fix the step count so that the schedules complete inside
        it, feature caching included (see :mod:`overrep.recovery.budget`)."""
        r = self.cfg.recovery
        budget = parse_duration(r.time_budget)
        total = self.checkpointed_total() if self.resume else None
        info = {"seconds": budget}
        if total is None:
            costs = self.make_trainer().measure()
            left = budget - (time.perf_counter() - self.recovery_started) - self.build_seconds
            total = self.fit_budget(costs, left, info)
            log.info("time budget %.0f s: %.2f s per step, %.0f s left -> %d steps", budget, costs.step, left, total)
        self.total_steps = info["steps"] = total
        torch.manual_seed(r.seed)  # the measured steps leave no trace: fresh model, fresh recovery
        self.prune()
        self.build_recovery()
        self.metrics["time_budget"] = info
