"""Time budgets in the pipeline: measure once, then fix the step count (and the rows to cache).

The arithmetic is :mod:`overrep.recovery.budget`; :func:`fit_budget` runs the measurement
on the run's own data, between pruning and setting the method up: the method is built
once on a copy of the pruned model (with a few rows' features for a method on the disk
cache, so that a short budget does not pay for features it will never train on), a few
real steps are timed on it, and the copy is dropped. Several ranks (``torchrun``) all
measure, but rank 0's figures decide, so that every rank trains the same number of steps.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..distributed import World
from ..errors import OverRepError, WarmStartTooShort
from ..model.arch import decoder_layers
from ..model.flops import blocks_macs
from ..recovery.budget import StepCosts, fit_steps, parse_duration, spread, validation_plan
from ..recovery.losses import fresh_share
from ..recovery.methods import Method, MethodInputs, build_recovery
from ..recovery.teacher import PROBE_ROWS

log = logging.getLogger("overrep.app.pipeline")


@dataclass
class BudgetFit:
    """What a time budget decided: the step count, the training rows to keep (None: all),
    the measured costs (None: the step count was read from a checkpoint) and the record
    that goes to ``metrics.json`` (``time_budget``), and the validation cadence
    (``recovery.validation_share``)."""

    steps: int
    rows: int | None
    costs: StepCosts | None
    info: dict
    eval_every: int | None = None  # the validation cadence it affords (0: none; None: a resumed run's, from its checkpoint)
    timed: tuple | None = None  # (costs, rebuild, extras_row) of the probe, for fit_budget(timed=...)


def checkpointed_total(out: Path) -> int | None:
    """The step count the newest checkpoint in ``out`` was trained for (a budgeted run's is measured)."""
    found = sorted((out / "checkpoints").glob("step-*.pt"))
    if not found:
        return None
    try:
        return int(torch.load(found[-1], map_location="cpu", weights_only=True)["total_steps"])
    except Exception:
        return None  # the trainer's resume reports the unreadable file


#: the fewest steps a time budget may leave a trained method: a cold start's warm-up is 1% of
#: the run, so AdamW's first steps move every weight by about the learning rate, which a run of
#: a few steps never takes back (docs/closed-forms.md)
MIN_BUDGET_STEPS = 10
#: the same from a warm start, which has a good model to lose: with its 20 learning-rate warm-up
#: steps OverRep from ReplaceMe's fit (validation 196) measured validation 227 / 189 after 10 /
#: 20 steps (cold: 461 / 294), so from 20 steps on it beats the closed form it started from; with
#: a one-step warm-up it had measured test 37,862 / 4,531 / 826 after 1 / 10 / 20 (docs/closed-forms.md)
MIN_WARM_BUDGET_STEPS = 20


#: the share of a time budget the probe's timed steps may take (:meth:`Trainer.measure`'s
#: ``within``): at 12 minutes three a stretch, as before; at one minute one
PROBE_SHARE = 0.05

#: the share of ``recovery.run_limit`` kept for the export, the report and what nothing measures
RUN_LIMIT_RESERVE = 0.03


def limit_left(limit: float, elapsed: float, final_eval: float) -> float:
    """The seconds a whole-run ``limit`` leaves for recovery after ``elapsed`` and the final
    evaluation, less :data:`RUN_LIMIT_RESERVE`."""
    return limit * (1 - RUN_LIMIT_RESERVE) - elapsed - final_eval


def cut_to_run_limit(budget: float, limit: float, elapsed: float, final_eval: float | None) -> tuple[float, dict]:
    """The time budget a run affords under a whole-run limit: ``budget`` (seconds), or less
    where ``limit`` minus what the run has spent (``elapsed``, loading, pruning and the baseline
    evaluations) and its final evaluation (``final_eval``, predicted; None: unknown, nothing is
    cut) leaves less. Returns the seconds and the record for ``metrics.json``."""
    record = {"seconds": limit, "elapsed_before_recovery": round(elapsed, 2),
              "predicted_final_eval_seconds": None if final_eval is None else round(final_eval, 2),
              "budget_asked": budget}
    if final_eval is None:
        log.warning("recovery.run_limit: the final evaluation's cost is unknown (its dense figures were cached "
                    "before their cost was recorded), so the time budget is not cut to fit")
        return budget, record
    left = limit_left(limit, elapsed, final_eval)
    if left >= budget:
        return budget, record
    if left <= 0:
        raise OverRepError(f"recovery.run_limit {limit:.0f} s is spent before recovery starts ({elapsed:.0f} s gone, the final "
                           f"evaluation predicted at {final_eval:.0f} s); raise it, or set it to null to keep the time "
                           "budget whole")
    record["cut_to"] = round(left, 2)
    log.info("time budget cut from %.0f s to %.0f s: the run has spent %.0f s and its final evaluation is predicted "
             "at %.0f s, within recovery.run_limit %.0f s", budget, left, elapsed, final_eval, limit)
    return left, record


def per_token_macs(model, seq_len: int, start: int = 0) -> int:
    """MACs per token of ``model``'s blocks from ``start`` on and its LM head."""
    head = model.get_output_embeddings()
    return blocks_macs(decoder_layers(model)[start:], model.config, seq_len) + (
        head.weight.numel() if head is not None else 0)


def row_sets(p, model, data) -> list[tuple[int, int]]:
    """``(tokens, block)`` of each set of ``data``'s perplexity rows (test, validation, each
    unseen corpus; an :class:`~overrep.eval.figures.EvalData`): the block from which ``model``
    scores it if scored now, the shared prefix's where it shares those blocks and a model scored
    whole on the set kept its states in this run, else 0 (whole). The dense figures read back
    (a cache, the package's entry) keep none, so the first later model runs every set whole; the
    unrecovered model keeps those it scores, so the recovered one runs the unseen corpora whole."""
    prefix = p.shared_prefix
    shares = prefix is not None and prefix.shares(model)
    sets = [data.test, data.validation, *(rows for rows, _ in data.unseen.values())]
    return [(rows.numel(), prefix.start if shares and prefix.holds(rows) else 0) for rows in sets]


def _rows_seconds(p, sets: list[tuple[int, int]]) -> float | None:
    """Seconds the compact model should take on the row ``sets`` (:func:`row_sets`): the dense
    rows' seconds per token, scaled by the MACs per token of the compact model's blocks from
    each set's block on and its head against the dense model's (None: the dense rows' cost is unknown)."""
    dense_rows, tokens = p.eval_rows_cost.get("dense"), p.eval_data.rows_tokens()
    if not dense_rows or not tokens:
        return None
    seq_len = p.cfg.data.seq_len
    whole = per_token_macs(p.dense, seq_len)
    return dense_rows / tokens * sum(n * per_token_macs(p.pruned, seq_len, start) / whole for n, start in sets)


def predict_final_eval(p) -> float | None:
    """Seconds pipeline ``p``'s final evaluation (the recovered model, the compact
    architecture of ``p.pruned``) should take, from what the dense model's took, scaled by
    their MACs per token: the perplexity rows (``eval_rows_cost``) by those of the compact
    model's blocks after the shared prefix, where a model of the run kept a set's states, and
    its head, which is all a model sharing the first blocks runs on them (:func:`row_sets`,
    :mod:`overrep.model.prefix`), the rest (the generation check, the latency) by the whole
    compact model's. On the 2-core AVX2 EPYC (1311e80's `make run`) the dense figures took 265 s
    and this predicted 141 s for 158 s taken; scaling the whole by the parameters kept (0.71), as
    before, had predicted 210 s for 160 s (db90953's run). :data:`RUN_LIMIT_RESERVE` covers the
    difference. Where this run timed the unrecovered model's rows, the whole is scaled by
    :func:`measured_pace`. None where the dense cost is unknown."""
    dense = p.eval_cost.get("dense", 0.0)  # (not scored at all: nothing to predict from, 0)
    if dense is None:  # cached before its cost was recorded
        return None
    seq_len = p.cfg.data.seq_len
    compact = per_token_macs(p.pruned, seq_len) / per_token_macs(p.dense, seq_len)
    rows = p.eval_rows_cost.get("dense") or 0.0
    rows_part = _rows_seconds(p, row_sets(p, p.pruned, p.eval_data)) or 0.0
    return (rows_part + (dense - rows) * compact) * (measured_pace(p) or 1.0)


def measured_pace(p) -> float | None:
    """What the unrecovered model's perplexity rows took in this run over what
    :func:`_rows_seconds` priced them at (None: not scored here, read back from a cache, or
    nothing to price them from): the machine's pace now, measured on the compact architecture
    the final evaluation runs, on 32 to 224 rows, where the dense figures' cost is another
    hour's (a cache) or another machine's scaled by the fastest of three batches of four rows
    (the package's entry: 0.89x and 1.22x in two runs of one hour on one machine)."""
    timed = p.eval_rows_timed.get("pruned")  # (seconds, row_sets as they were scored)
    priced = _rows_seconds(p, timed[1]) if timed else None
    return timed[0] / priced if priced else None


def unrecovered_test_cost(p) -> tuple[float | None, float | None]:
    """``(test, validation)``: the seconds pipeline ``p``'s unrecovered model should take on the
    test and on the validation rows, from what the dense model's perplexity rows took per token,
    scaled by the MACs per token of the pruned model's blocks it would run on each and its head
    (:func:`_rows_seconds`); ``(None, None)`` where the dense cost is unknown."""
    test, validation = row_sets(p, p.pruned, p.eval_data.baseline())
    return _rows_seconds(p, [test]), _rows_seconds(p, [validation])


def unrecovered_rows(p) -> tuple[str, str | None]:
    """``eval.unrecovered: auto`` made concrete for pipeline ``p`` (rank 0): ``("test", None)``
    where no run limit applies, where its cost is unknown, where scoring the unrecovered model's
    test rows still leaves the whole ``recovery.time_budget`` inside ``recovery.run_limit``
    (:func:`cut_to_run_limit`'s arithmetic, with the final evaluation predicted), else
    ``("validation", why)``: the seconds go to training, and the report's recovery check reads
    validation. The caller reads a cached test figure back whatever this says."""
    r = p.cfg.recovery
    limit = r.resolved_run_limit
    if limit is None or p.run_started is None or not p.budgeted:  # (a limit cuts nothing but a time budget)
        return "test", None
    final = predict_final_eval(p)
    test, validation = unrecovered_test_cost(p)
    if final is None or test is None:
        return "test", None
    elapsed = time.perf_counter() - p.run_started + validation + test  # as it will stand once they are scored
    budget = parse_duration(r.time_budget)
    if limit_left(parse_duration(limit, "recovery.run_limit"), elapsed, final) >= budget:
        return "test", None
    return "validation", (f"its test rows (about {test:.0f} s) would have cut the {budget:.0f}-s time budget to fit "
                          f"recovery.run_limit {limit}; --set eval.unrecovered=test scores them")


def run_limit_budget(p) -> tuple[float | None, dict | None]:
    """Pipeline ``p``'s time budget under ``recovery.run_limit`` as ``(seconds, record)``, the
    seconds None where the limit leaves the budget whole; ``(None, None)`` where no limit
    applies (none set, or a run not started by :meth:`~overrep.app.pipeline.Pipeline.run`).
    The final evaluation is :func:`predict_final_eval`'s (the record keeps :func:`measured_pace`
    where it scaled it: ``final_eval_pace``). Rank 0 decides."""
    r = p.cfg.recovery
    limit = r.resolved_run_limit
    if limit is None or p.run_started is None:
        return None, None
    final = predict_final_eval(p) if p.world.is_main else None
    got = cut_to_run_limit(parse_duration(r.time_budget), parse_duration(limit, "recovery.run_limit"),
                           p.recovery_started - p.run_started, final) if p.world.is_main else None
    if got is not None and (pace := measured_pace(p)) is not None:
        got[1]["final_eval_pace"] = round(pace, 3)
    seconds, record = p.world.broadcast(got)
    return (seconds if "cut_to" in record else None), record


def fit_budget(method: Method, inputs: MethodInputs, *, cache_mode: str, started: float, world: World,
               make_trainer: Callable, resumed_total: int | None, measure: bool = True,
               prepared: dict | None = None, seconds: float | None = None, warm: bool = False,
               timed: tuple | None = None, timed_by: str | None = None) -> BudgetFit | None:
    """``recovery.time_budget`` as a step count (and, for a method on the disk cache, a number
    of training rows), so that the schedules complete inside it, features included.

    ``inputs``: what the method will be built from; ``started``: when the budget began
    (:func:`time.perf_counter`); ``make_trainer(objective)``: a trainer for a measurement;
    ``resumed_total``: a resumed run's step count, which is kept; ``prepared``: what the
    closed-form preparation already did to ``inputs.pruned`` (the probe copies it rather than
    fitting a warm start a second time; empty: a warm start whose map is fitted after the probe,
    which times its layout all the same); ``seconds``: the budget where :func:`cut_to_run_limit`
    cut it (None: ``recovery.time_budget``); ``warm``: the run starts from a closed form (its
    floor is :data:`MIN_WARM_BUDGET_STEPS`, and a budget too short raises
    :class:`~overrep.errors.WarmStartTooShort`); ``timed``: ``(costs, rebuild, extras_row)`` a
    probe of this run measured already (:attr:`BudgetFit.timed`: the warm start's, before its
    map was fitted, or after ``auto`` fell back to the cold start, whose steps cost less), so
    that none is run again, and ``timed_by`` says which in ``metrics.json``. None where nothing
    is decided (``measure=False`` and nothing to resume)."""
    r = inputs.config
    budget = parse_duration(r.time_budget) if seconds is None else seconds
    asked = r.time_budget if seconds is None else f"{r.time_budget} (cut to {seconds:.0f} s by recovery.run_limit)"
    per_step = r.batch_size * r.grad_accum
    sizes_cache = method.needs_features and cache_mode == "disk"
    fresh = fresh_share(r.loss, r.loss_switch) if sizes_cache else 0.0  # rows a next-token phase sees once
    info: dict = {"seconds": budget}
    total, costs = resumed_total, None
    if total is None:
        if not measure:
            return None
        if timed is None:
            costs, rebuild, extras_row = probe_costs(method, inputs, prepared, make_trainer, sizes_cache, fresh,
                                                     within=PROBE_SHARE * budget)
        else:  # a layout of the same run timed already: its live share is this plan's
            costs, rebuild, extras_row = timed
            costs = dataclasses.replace(costs, live_share=inputs.teacher.live_share) if sizes_cache else costs
            if timed_by:
                info["timed_by"] = timed_by
        left = budget - (time.perf_counter() - started) - max(0.0, rebuild)
        costs = world.broadcast(costs)  # rank 0's figures decide
        info.update({f"measured_{k}": v for k, v in (("seconds_per_step", costs.step),
                     ("later_phase_seconds_per_step", costs.later if costs.later_share else None),
                     ("validation_seconds", costs.validation),
                     ("later_phase_validation_seconds", costs.later_validation if costs.later_share else None),
                     ("checkpoint_seconds", costs.checkpoint),
                     ("feature_seconds_per_row", costs.row), ("extras_seconds_per_row", extras_row)) if v})
        validations = validation_plan(budget, r.validation_share, costs)
        # recovery.keep_best after a warm start: the closed form is scored before the first step
        # (Trainer.score_the_start) and the last step after it, whatever validation_share affords,
        # so that a budget too short for training to pass the closed form ships the closed form
        guard = warm and r.keep_best
        validations = max(validations, int(guard))
        scored = validations + int(guard)
        # 3% kept for what is not measured; the trainer re-fits once it has timed real steps
        total = world.broadcast(fit_steps(0.97 * left - costs.validations_seconds(scored), costs, 0, r.checkpoint_every))
        floor = r.budget_min_steps or (MIN_WARM_BUDGET_STEPS if warm else MIN_BUDGET_STEPS)
        if total < floor:  # e.g. a 1-minute warm start on a 2-core CPU: measured far worse than no training
            needed = budget - left + (costs.run_seconds(floor, 0, r.checkpoint_every)
                                      + costs.validations_seconds(scored)) / 0.97
            short = f"{total} optimiser step(s) on this machine after its set-up; at least {floor} are needed"
            message = (f"recovery.time_budget {asked} leaves {method.name} {short}{' from a warm start' if warm else ''}"
                       f" (about {needed:.0f} s here; recovery.budget_min_steps sets the floor), "
                       # a cold start sets no map up and keeps no closed form to score: on a 2-core CPU,
                       # a minute's default run is refused warm and beats the closed form cold (docs/results-log.md)
                       + ("start cold (--set recovery.warm_start=none) " if warm else "")
                       + "or use a closed form such as --method replaceme, which trains nothing")
            if not warm:
                raise OverRepError(message)
            raise WarmStartTooShort(message, why=f"{total} of the {floor} optimiser steps it needs (about {needed:.0f} s "
                                    "here)", timed=(costs, rebuild, extras_row))
        eval_every = info["eval_every"] = spread(total, validations)
        later = f" ({costs.later_steps(total)} of them at {costs.later:.2f} s)" if costs.later_share else ""
        log.info("time budget %.0f s: %.2f s per step, %.3f s per row of features, %.0f s left -> %d steps%s on "
                 "%d rows", budget, costs.step, costs.row, left, total, later, costs.rows(total) if sizes_cache
                 else inputs.train_ids.shape[0])
    info["steps"] = total
    rows = None
    if sizes_cache:
        rows = info["rows"] = StepCosts(0, 0, 0, rows_per_step=per_step, max_rows=inputs.train_ids.shape[0],
                                        passes=r.budget_passes, fresh_share=fresh).rows(total)
    return BudgetFit(total, rows, costs, info, eval_every if costs is not None else None,
                     (costs, rebuild, extras_row) if costs is not None else None)


def probe_costs(method: Method, inputs: MethodInputs, prepared: dict | None, make_trainer: Callable,
                sizes_cache: bool, fresh: float, within: float | None = None) -> tuple[StepCosts, float, float]:
    """What a step, a validation and a row of features cost this run, timed on a copy of the
    method built on a copy of the pruned model, and what building it again will cost (seconds
    the budget must keep), and a row's per-loss extras: ``(costs, rebuild, extras_row)``.
    ``within``: the seconds its timed steps may take (:meth:`~overrep.recovery.trainer.Trainer.measure`)."""
    r = inputs.config
    teacher = dataclasses.replace(inputs.teacher, mode="probe") if sizes_cache else inputs.teacher
    probe = dataclasses.replace(inputs, pruned=copy.deepcopy(inputs.pruned), teacher=teacher)
    t0, cached = time.perf_counter(), teacher.seconds
    run = build_recovery(probe, method, prepared=prepared)
    # what building it again costs: not the cache, nor a search it reads back, nor the probe's features
    rebuild = time.perf_counter() - t0 - (teacher.seconds - cached) - (
        run.search_seconds if run.searched_now else 0.0) - (PROBE_ROWS * teacher.row_seconds if sizes_cache else 0.0)
    # a loss's per-row extras (the teacher's top-K) are built for every cached row: a row's
    # cost, not a fixed one (the probe built them for its few rows only); a repeated run that
    # reads them back has the time left over, which the trainer's re-fits give to steps
    rebuild -= run.extras_train_seconds
    extras_row = run.extras_row_seconds if sizes_cache else 0.0
    costs = make_trainer(run.objective).measure(within=within)
    del run, probe
    # the rows bound a one-pass later phase (StepCosts.later_steps); a method on the disk cache also pays for them
    costs = dataclasses.replace(costs, rows_per_step=r.batch_size * r.grad_accum, max_rows=inputs.train_ids.shape[0])
    if sizes_cache:
        costs = dataclasses.replace(costs, row=teacher.row_seconds + extras_row, passes=r.budget_passes,
                                    fresh_share=fresh, live_share=teacher.live_share)
    return costs, rebuild, extras_row


def budget_outcome(trainer) -> dict:
    """What a budgeted run's training spent, for ``metrics.json``'s ``time_budget``: the seconds
    it used (features + training, over every process that trained it: a resumed run adds the
    seconds spent up to the checkpoint it resumed from), where it stopped at its deadline, and
    its re-fitted step count."""
    out = {"used_seconds": trainer.budget_seconds_used(), "stopped_at_step": trainer.stopped_at}
    if trainer.resumed_from is not None:
        out.update(resumed_from_step=trainer.resumed_from, seconds_before_resume=trainer.budget_seconds_before)
    if trainer.refit is not None:
        out.update(steps=trainer.total, refit=trainer.refit)
    return out


def compute_spent(p, trainer) -> dict:
    """The compute a run's recovery spent, for ``metrics.json``: ``train_flops`` (a step's
    count, :meth:`~overrep.recovery.trainer.Trainer.count_flops`, times the steps trained; a
    live teacher's forward is inside the steps) and ``feature_flops`` (the dense forward passes that cached
    the training rows' features: ``2 x MACs`` per token up to the last block a module needs)."""
    out = {"train_flops": trainer.flops_per_step * trainer.step if trainer.flops_per_step else None,
           "feature_flops": None}
    if p.method.needs_features and p.teacher is not None and p.teacher.cache is not None:
        last = max(g.target_layer for g in p.plan.groups)
        seq_len = p.cfg.data.seq_len
        per_token = 2 * blocks_macs(decoder_layers(p.dense)[:last + 1], p.dense.config, seq_len)
        out["feature_flops"] = float(per_token * p.train_ids.shape[0] * seq_len)
    return out
