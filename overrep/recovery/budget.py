"""Time budgets: turn "recover within 20 minutes" into a step count, before training starts.

The learning-rate and α schedules are functions of the total step count, so the count
must be fixed before the first step for both schedules to complete (α reaches 0 and the
merge is exact). A budgeted run therefore

1. builds the recovery (the feature cache included: it is part of the budget),
2. times a few real optimiser steps, one validation and one checkpoint
   (:meth:`Trainer.measure <overrep.recovery.trainer.Trainer.measure>`),
3. rebuilds the recovery from scratch, so the measured steps leave no trace,
4. fixes the step count with :func:`fit_steps` from what is left of the budget.

A resumed run takes the step count from its checkpoint instead of measuring again.

Measurements taken before the real run drift from it (the probe runs before the feature
cache is built, on a machine whose load changes), so the trainer re-fits the step count
after :data:`REFIT_STEPS` real steps, from the step time it observes and the time left to
the :class:`Deadline`, and once more as many steps later from the steps in between: a
run's first steps can be slower than its later ones (on a CPU, LoRA's first 8 steps of
5.1 s were followed by steps of 4.5 s, and one re-fit left 10% of the budget unused). The
schedules are still near their start then (the learning-rate warm-up and α's rise are 1%
of the run, and 4% of it has passed at the second), so the change leaves almost no mark.

Layer-wise methods on the disk feature cache do it the other way round, so that a short
budget does not pay for features it will never train on: they time the teacher on a few
rows and a few steps on those rows' features (``cache.mode: probe``), then fix the step
count *and* the number of training rows to cache together (``StepCosts.row``: building
one row's features; a run needs ``steps x batch`` rows, at most the data it has), and only
then build the cache. Short budgets cache fewer rows and see each ``recovery.budget_passes``
times (default 6); long ones cache all the data and go over it more often. Where a row's
features cost more than its share of a step (a short budget, a deep mask, fp32 on a CPU),
more passes over fewer rows buy more steps for the same seconds; whether those steps are
worth more than fresh rows is measured in docs/results-log.md ("Rows against steps").
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, replace

from ..errors import OverRepError

log = logging.getLogger(__name__)

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str | float | int, where: str = "recovery.time_budget") -> float:
    """Seconds in ``"90s"``, ``"20m"``, ``"1.5h"`` or a plain number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h)?\s*", str(text))
        if not m:
            raise OverRepError(f"{where} must look like 90s, 20m or 1.5h, got {text!r}")
        seconds = float(m.group(1)) * _UNITS[m.group(2) or ""]
    if not math.isfinite(seconds) or seconds <= 0:
        raise OverRepError(f"{where} must be a positive duration, got {text!r}")
    return seconds


@dataclass
class StepCosts:
    """Measured seconds: one optimiser step (``step``: averaged over the stretches of the
    objective's first phase; ``anneal``: in the α > 0 stretch, where a run starts), one
    validation, one checkpoint; optionally the features of one new training row (``row``, for
    ``rows_per_step`` rows a step, at most ``max_rows`` in all, each planned to be seen
    ``passes`` times, except by the last ``fresh_share`` of the steps, whose loss learns the
    text itself and should see each row once: :func:`overrep.recovery.losses.fresh_share`).

    An ``A>B`` loss's later phase is priced on its own: ``later`` seconds a step for the last
    ``later_share`` of the steps, at most one pass over the ``max_rows`` rows where it is
    ``one_pass`` (``Layerwise.set_total_steps`` moves the switch later instead, and the first
    phase gets the steps). Averaging the two phases had over-counted a run whose later phase
    the one-pass limit shortens: ``ce`` steps cost 2.1 s against 0.45 s for ``normed`` on the
    family 26 EPYC, and the default run left 67 s of its 720 unused (docs/configuration.md)."""

    step: float
    validation: float
    checkpoint: float
    anneal: float = 0.0
    row: float = 0.0
    rows_per_step: int = 0
    max_rows: int = 0
    passes: float = 1.0
    fresh_share: float = 0.0
    later: float = 0.0
    later_share: float = 0.0
    one_pass: bool = False
    #: rows past ``cached`` that the one-pass later phase reads live, at ``live_row`` seconds each
    #: more (a re-fit's view: :meth:`Deadline.steps_left`); 0: none
    live_row: float = 0.0
    cached: int = 0
    #: a row read live pays this share of ``row`` (its ``inputs`` only: :attr:`Teacher.live_share
    #: <overrep.recovery.teacher.Teacher.live_share>`)
    live_share: float = 1.0
    #: ``later`` was timed on the later phase's own steps (else it is the first phase's price)
    later_timed: bool = False
    #: one validation in the later phase (0: priced as ``validation``). Its loss is that phase's:
    #: ``ce`` runs the frozen tail and the head, and the last validation of most five-minute
    #: two-phase cells of one grid (the family 25 EPYC, docs/grid-epyc-f25m17) took 1.1-1.5x the
    #: probe's price of a first-phase one (0.7-1.5x over all of them); unreserved, one cell ended
    #: 7 s past its 300.
    later_validation: float = 0.0

    def validation_in(self, later: bool) -> float:
        """Seconds of one validation in the later phase (``later``) or the first."""
        return self.later_validation if later and self.later_share and self.later_validation else self.validation

    @property
    def last_validation(self) -> float:
        """Seconds of a run's last validation: in its later phase where it has one."""
        return self.validation_in(True)

    def validations_seconds(self, n: int) -> float:
        """Seconds of ``n`` validations, the last at the run's end (:attr:`last_validation`)."""
        return (n - 1) * self.validation + self.last_validation if n > 0 else 0.0

    def later_steps(self, total: int) -> int:
        """Steps of a ``total``-step run in the later phase (as ``Layerwise.set_total_steps`` places its switch)."""
        if not self.later_share:
            return 0
        n = total - int(round((1 - self.later_share) * total))
        if self.one_pass and self.rows_per_step:
            n = min(n, max(self.max_rows // self.rows_per_step, 1))
        return n

    def live_steps(self, total: int) -> int:
        """The later phase's last steps, which read rows past the ``cached`` ones (live)."""
        if not self.live_row or not self.rows_per_step:
            return 0
        return max(0, self.later_steps(total) - self.cached // self.rows_per_step)

    def train_seconds(self, total: int, done: int = 0) -> float:
        """Seconds of a ``total``-step run's optimiser steps after the first ``done``."""
        later = min(self.later_steps(total), total - done)
        live = min(self.live_steps(total), later) * self.rows_per_step * self.live_row
        return (total - done - later) * self.step + later * self.later + live

    def rows(self, steps: int) -> int:
        """Training rows ``steps`` steps need features for (at least one step's worth)."""
        need = max(math.ceil(steps * self.rows_per_step / self.passes),
                   math.ceil(self.fresh_share * steps * self.rows_per_step))
        return min(self.max_rows, max(need, self.rows_per_step))

    def run_seconds(self, steps: int, eval_every: int, checkpoint_every: int, done: int = 0) -> float:
        """Seconds a ``steps``-step run takes after its first ``done`` steps, with a validation
        every ``eval_every`` (0: none), the features of its rows included (``row``)."""
        left = steps - done
        validations = math.ceil(left / eval_every) if eval_every else 0
        return (self.train_seconds(steps, done) + self.validations_seconds(validations)
                + math.ceil(left / checkpoint_every) * self.checkpoint + self.rows(steps) * self.row)


def validation_plan(budget: float, share: float, costs: StepCosts) -> int:
    """How many validations a budget of ``budget`` seconds affords when they may take at
    most ``share`` of it (``recovery.validation_share``): a validation every step of the
    default cadence cost a 12-minute run a quarter of its time for a choice that moved the
    result by < 0.5% (docs/speed.md)."""
    return int(share * budget // costs.validation) if costs.validation > 0 else 0


def spread(steps: int, validations: int) -> int:
    """``eval_every`` that spreads ``validations`` evenly over ``steps``, the last at the end (0: none)."""
    return math.ceil(steps / validations) if validations > 0 else 0


def stretches(total: int, cuts) -> list[tuple[int, float]]:
    """(a step inside it, its share of the run) for each stretch of a ``total``-step run
    between ``cuts``: the parts of a schedule whose steps may cost differently, each timed once."""
    edges = sorted({0, total, *(c for c in cuts if 0 <= c <= total)})
    return [((a + b - 1) // 2, (b - a) / total) for a, b in zip(edges, edges[1:]) if b > a]


def fit_steps(seconds_left: float, costs: StepCosts, eval_every: int, checkpoint_every: int, done: int = 0) -> int:
    """The largest step count whose training after its first ``done`` steps fits in
    ``seconds_left`` (at least ``done + 1``)."""
    def fits(total: int) -> bool:
        return costs.run_seconds(total, eval_every, checkpoint_every, done) <= seconds_left

    lo = done + 1
    if not fits(lo):
        return lo
    hi = done + 2
    while fits(hi):
        lo, hi = hi, done + 2 * (hi - done)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def phase_costs(timings: list[tuple[int, float, float]], switch: int | None, later: tuple[float, bool] | None,
                validation: float, checkpoint: float, later_validation: float = 0.0) -> StepCosts:
    """:class:`StepCosts` from a step's seconds timed in each stretch of a run, ``(step, share,
    seconds)`` in order: those from ``switch`` on (None: none) are the later phase's
    (``later``: :meth:`Objective.later_phase <overrep.recovery.objectives.Objective.later_phase>`;
    a later phase the measured run did not reach is priced as the first, its validation too)."""
    def mean(rows):
        weight = sum(share for _, share, _ in rows)
        return sum(share * seconds for _, share, seconds in rows) / weight if weight else 0.0

    first = [t for t in timings if switch is None or t[0] < switch]
    last = [t for t in timings if switch is not None and t[0] >= switch]
    step = mean(first) if first else mean(last)
    share, one_pass = later or (0.0, False)
    return StepCosts(step, validation, checkpoint, anneal=timings[0][2], later=mean(last) if last else step,
                     later_share=share, one_pass=one_pass, later_timed=bool(last),
                     later_validation=later_validation if last else 0.0)


#: real steps a budgeted run takes before it re-fits its step count to the time it observes
REFIT_STEPS = 20


@dataclass
class Deadline:
    """The end of a budgeted run's training (``at``, on :func:`time.perf_counter`'s clock)
    and the costs its step count was first fitted to."""

    at: float
    costs: StepCosts
    eval_every: int
    checkpoint_every: int

    def refit_steps(self, total: int) -> tuple[int, int]:
        """The steps after which to re-fit: :data:`REFIT_STEPS` (fewer in a short run), and
        twice that, timed on the steps since the first (then :meth:`next_refit`)."""
        first = max(3, min(REFIT_STEPS, total // 10))
        return first, 2 * first

    def next_refit(self, step: int, first_end: int) -> int | None:
        """After the scheduled re-fits, the step of the next one (None: none): twice the step of
        the last re-fit, each timed on the steps since it, while that step is still inside the
        run's first stretch (``first_end``: where it ends, the whole run where the probe priced
        every step alike). LoRA-iso's steps of about 4 s at the 50% mask had left 25 s of a
        5-minute budget unused after two re-fits, and OverRep-KD's 28 s of 300 (its steps sped up
        from 8-9 s to 6-7 s after the second). A re-fit prices the stretches not reached by the
        first stretch's steps, so it is not timed across a stretch's end; a later loss phase has
        its own, :func:`refit_late_phase`."""
        return 2 * step if 2 * step < first_end else None

    def steps_left(self, seconds_per_step: float, now: float, done: int = 0, rows: int | None = None,
                   cached: int | None = None) -> int:
        """Steps that fit between ``now`` and the deadline after ``done`` steps when a step in
        the α > 0 phase takes ``seconds_per_step`` (the first phase's other stretches scaled
        alike), the later phase held to one pass over ``rows`` (None: as planned), of which those
        past ``cached`` (None: none) are read live at the measured cost of a row's features (its
        ``live_share`` of it); at least 1.

        A later phase the probe timed on its own steps keeps the probe's price: what makes the
        probe's layer-wise steps dearer or cheaper than the run's does not carry over to a step
        through the frozen tail. In the twelve two-phase cells of one grid (2.5 minutes, the
        family 25 EPYC, docs/grid-epyc-f25m17) the layer-wise steps ran at 0.71-1.14x their probe
        price and the ``ce`` steps at 0.87-1.04x theirs: scaled by the layer-wise factor, the
        ``ce`` price was up to 29% off (12% on average), unscaled up to 13% (6%), closer on 9 of
        the 12. The phase re-times itself once it begins (:func:`refit_late_phase`)."""
        costs = self.refit_costs(seconds_per_step, rows, cached)
        return fit_steps(0.99 * (self.at - now), costs, self.eval_every, self.checkpoint_every, done) - done

    def refit_costs(self, seconds_per_step: float, rows: int | None = None, cached: int | None = None) -> StepCosts:
        """The costs a re-fit prices the rest of the run at (:meth:`steps_left`)."""
        scale = seconds_per_step / (self.costs.anneal or self.costs.step)
        live = cached is not None and rows is not None and rows > cached
        later = self.costs.later if self.costs.later_timed else self.costs.later * scale
        return replace(self.costs, step=self.costs.step * scale, anneal=seconds_per_step, row=0.0,
                       later=later, max_rows=self.costs.max_rows if rows is None else rows,
                       live_row=self.costs.row * self.costs.live_share * scale if live else 0.0,
                       cached=cached or 0)


# ---- re-fits during training (called by the trainer) -------------------------------------------
#: steps of a later phase timed before :func:`refit_late_phase` (after the phase's first, which pays one-off costs)
PHASE_REFIT_STEPS = 3


def _apply_refit(trainer, total: int, observed: float, phase: str | None = None,
                 seconds: tuple[float, float] | None = None) -> None:
    """Record a re-fit in ``trainer.refit`` and, where it changes the step count, apply it:
    as many validations as planned, spread over the new count, the last at the end (a count
    the objective allows, :meth:`Trainer.capped`). ``seconds``: ``(left, planned)``, the seconds
    to the deadline and those the re-fitted rest of the run was priced at: their difference is
    the slack the re-fit leaves, and against the run's ``used_seconds`` it says whether time a
    run left unused was left by a re-fit or appeared after it (a price too high)."""
    total = trainer.capped(total)
    if trainer.refit is None:
        costs = trainer.deadline.costs
        trainer.refit = {"probe_seconds_per_step": costs.anneal or costs.step, "steps_before": trainer.total, "at": []}
    at = trainer.refit["at"]
    before = at[-1]["seconds_per_step"] if at else trainer.refit["probe_seconds_per_step"]
    at.append({"step": trainer.step, "seconds_per_step": observed, "steps": total, **({"phase": phase} if phase else {}),
               **({"seconds_left": round(seconds[0], 2), "seconds_planned": round(seconds[1], 2)} if seconds else {})})
    trainer.refit["steps_after"] = total
    if total == trainer.total:
        return
    log.info("time budget: a %sstep takes %.2f s here (%.2f s %s): %d steps instead of %d",
             f"{phase} " if phase else "", observed, before, "before" if len(at) > 1 else "in the probe", total,
             trainer.total)
    if trainer.eval_every:
        trainer.eval_every = trainer.deadline.eval_every = spread(total, math.ceil(trainer.total / trainer.eval_every))
        at[-1]["eval_every"] = trainer.eval_every
    trainer.set_total(total)


def refit_to_deadline(trainer, timed: list[float]) -> None:
    """Re-fit ``trainer``'s step count to the time left, from the real steps ``timed`` since
    the last re-fit (the run's first step, which pays one-off costs, left out); the first
    phase's stretches not yet reached are scaled by the same factor against the probe, a later
    loss phase the probe timed keeps its price (:meth:`Deadline.steps_left`)."""
    observed, now, deadline = sum(timed) / len(timed), time.perf_counter(), trainer.deadline
    rows, cached = trainer.num_samples + trainer.live_rows, trainer.num_samples
    left = deadline.steps_left(observed, now, done=trainer.step, rows=rows, cached=cached)
    total = trainer.world.broadcast(trainer.step + left)
    planned = deadline.refit_costs(observed, rows, cached).run_seconds(
        trainer.capped(total), deadline.eval_every, deadline.checkpoint_every, trainer.step)
    _apply_refit(trainer, total, observed, seconds=(deadline.at - now, planned))


def refit_late_phase(trainer, phase: str, began: tuple[str, int, bool] | None, step_seconds: list[float]):
    """A later phase of an ``A>B`` loss timed on its own. Its steps can cost several of the
    first phase's (``ce`` through the frozen tail: 7-11 s against 2 s on a 2-core AVX2 CPU),
    and a probe of two of them, scaled by the first phase's re-fits, under-counted them by a
    third there: the run was stopped at its deadline 12 steps short of its schedule, the
    learning rate not yet annealed. So every :data:`PHASE_REFIT_STEPS` of its steps the step
    count is re-fitted to what the deadline leaves at the cost of the last ones (a validation
    kept for the last step), and the schedules end inside the budget (the phase's first steps
    were seen to cost 10-11 s and its later ones 7 s, so one re-fit would leave time unused).
    The switch stays at the step the phase began (``set_total_steps``). ``began``:
    ``(phase, index in step_seconds, later)`` of the phase being timed, as this returns it."""
    if began is None or began[0] != phase:  # a phase begins (or the first one is seen): is it a later one?
        at = trainer.step - 1
        return phase, len(step_seconds) - 1, any(0 < s <= at for s in trainer.objective.phase_starts())
    timed = step_seconds[began[1] + 1:]
    if began[2] and timed and len(timed) % PHASE_REFIT_STEPS == 0 and trainer.step < trainer.total:
        observed = sum(timed[-PHASE_REFIT_STEPS:]) / PHASE_REFIT_STEPS
        # the run's end: its last validation (this phase's price) and its last checkpoint
        reserve = (trainer.deadline.costs.last_validation if trainer.eval_every else 0.0) + trainer.deadline.costs.checkpoint
        remaining = trainer.deadline.at - time.perf_counter()
        left = 0.99 * remaining - reserve
        # the phase's steps past its cached rows also compute their rows' features (live)
        cached_left = max(0, trainer.phase_start(trainer.step) + trainer.steps_per_epoch - trainer.step) \
            if trainer.live_rows else 0
        costs = trainer.deadline.costs
        more = trainer.per_step * costs.row * costs.live_share if cached_left else 0.0
        fits = left // observed if left <= cached_left * observed else \
            cached_left + (left - cached_left * observed) // (observed + more)
        fits = max(1, int(fits))
        planned = reserve + fits * observed + max(0, fits - cached_left) * more
        _apply_refit(trainer, trainer.world.broadcast(trainer.step + fits), observed, phase, seconds=(remaining, planned))
    return began
