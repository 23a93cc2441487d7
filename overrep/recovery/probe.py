"""A time budget's probe: what a step of each phase, a validation and a checkpoint cost, timed
on real steps of a trainer built for the purpose (:func:`overrep.app.budgeting.probe_costs`
builds it on a copy of the model and throws it away)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from .budget import StepCosts, phase_costs

logger = logging.getLogger(__name__)

#: the share of its rows a budget's probe validates on to time one validation (scaled up)
VALIDATION_PROBE_FRACTION = 0.25


def measure(trainer, steps: int = 3, within: float | None = None) -> StepCosts:
    """Time ``steps`` real steps of ``trainer`` (a :class:`~overrep.recovery.trainer.Trainer`) in each
    of its :meth:`~overrep.recovery.trainer.Trainer.stretches`, each priced at its fastest timed
    step, per phase of the objective (:func:`~overrep.recovery.budget.phase_costs`; ``anneal``: the first stretch,
    where a run starts and its re-fits time it), one validation (on
    :data:`VALIDATION_PROBE_FRACTION` of its rows, scaled up) in each phase it timed, and one
    checkpoint. It changes the weights: the caller rebuilds the recovery afterwards.

    ``within``: the seconds the timed steps of all stretches together may take (a share of
    a short budget, :data:`~overrep.app.budgeting.PROBE_SHARE`): fewer than ``steps`` a
    stretch where its first, untimed step says they would take longer, never fewer than one.
    At one minute on a 2-core CPU three timed steps in each of three stretches had taken
    about 24 s, as many steps as the run then trained; the re-fits time the real ones. The
    stretches share ``within`` in order, each the seconds left over the stretches left, so
    what cheap layer-wise stretches do not spend goes to a dearer later phase: with an equal
    third each, an Intel Xeon (family 6 model 167) timed one next-token step of the 12-minute
    default at 9.1 s against 1.7 s in training, planned its switch for that price and left
    133 s of its 720 unused (docs/results-log.md)."""
    trainer.objective.train(True)
    spans = trainer.stretches()
    left = [within]  # the probe's seconds not yet spent on timed steps

    def timed(at: int, stretches_left: int) -> float:
        trainer.step = at
        trainer.objective.after_optimizer_step(at - 1)  # the objective's phase at that step
        t0 = time.perf_counter()
        trainer._step()  # untimed: the first step at a new phase pays one-off costs
        first = time.perf_counter() - t0
        n = steps if within is None else max(1, min(steps, int(max(left[0], 0.0) / stretches_left
                                                               / max(first, 1e-6))))
        n = trainer.world.broadcast(n)  # rank 0's count: every rank takes the same steps (their collectives pair up)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            trainer._step()
            times.append(time.perf_counter() - t0)
        if within is not None:
            left[0] -= sum(times)
        logger.info("budget probe: step %d: %.2f s untimed, then %s s", at, first,
                    ", ".join(f"{t:.2f}" for t in times))
        # the fastest: what disturbs a timed step (another process, a buffer's first use, the
        # steps after a stretch's first still warming up) only slows it. Against the median of
        # the run's own first 20 steps, over the kept grid's cells (scripts/probe_accuracy.py
        # docs/grid-epyc-f25m17/cells): the fastest of the timed steps 1.01x (0.91-1.16x, worst
        # 1.36x) in 124 first stretches, the median of them 1.03x (0.92-1.17x, worst 2.64x); in
        # 188 later-phase stretches 1.03x (0.94-1.14x) against 1.04x (0.96-1.18x). Of two, the
        # slower had put a ``ce`` step at 3.6 s for 2.1.
        return min(times)

    timings = [(at, share, timed(at, len(spans) - i)) for i, (at, share) in enumerate(spans)]
    switch = min(trainer.objective.phase_starts(), default=None)
    # a quarter of the rows, scaled up: at a short budget a whole validation, timed only to
    # learn what one costs, was up to a fifth of the budget
    with trainer.objective.validation_sample(VALIDATION_PROBE_FRACTION) as scale:
        loss, ppl = _timed_validation(trainer, 0)
        # a later phase validates its own loss (``ce``: through the frozen tail and the head); the
        # perplexity part is the same model's in either phase
        later = switch is not None and any(at >= switch for at, _, _ in timings)
        later_loss = _timed_validation(trainer, switch, ppl=False)[0] if later else 0.0
    validation, later_validation = (loss + ppl) * scale, ((later_loss + ppl) * scale if later else 0.0)
    trainer.objective.after_optimizer_step(-1)
    trainer.step = 0
    ckpt_dir = trainer.ckpt_dir
    with tempfile.TemporaryDirectory(dir=ckpt_dir.parent if ckpt_dir.parent.exists() else None) as tmp:
        trainer.ckpt_dir = Path(tmp)
        t0 = time.perf_counter()
        trainer.save_checkpoint()
        checkpoint = time.perf_counter() - t0
    trainer.ckpt_dir = ckpt_dir
    return phase_costs(timings, switch, trainer.objective.later_phase(), validation, checkpoint, later_validation)


def _timed_validation(trainer, at: int, ppl: bool = True) -> tuple[float, float]:
    """Seconds of the validation loss and (``ppl``) of the perplexity with the objective at
    step ``at`` (its phase there)."""
    trainer.step = at
    trainer.objective.after_optimizer_step(at - 1)
    t0 = time.perf_counter()
    trainer.objective.validation_loss()
    t1 = time.perf_counter()
    if ppl:
        trainer.objective.validation_ppl()
    return t1 - t0, time.perf_counter() - t1

