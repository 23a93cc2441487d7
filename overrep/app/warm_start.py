"""How a run starts: ``recovery.warm_start`` resolved into the plan it trains, and ``auto``'s
fall-back to the cold start where a time budget leaves the warm start fewer steps than its floor,
or more than its method's ceiling (``Method.auto_warm_max_steps``: Plain's and Streamline's).

``auto`` decides warm or cold before the plan (:func:`~overrep.recovery.methods.resolve_warm_start`:
the mask, the method, the architecture, a step count set in the config), but the steps a time
budget buys (against the floor :data:`~overrep.app.budgeting.MIN_WARM_BUDGET_STEPS` and the
ceiling) are known only once they have been timed. The probe times them before the map is fitted
(the fit took 6-10 s of a one-minute budget on a 2-core CPU). Where the steps fall outside, the run
plans the cold start, prunes the model again (the cold start trains the stitched block where
OverRep's warm layout keeps block 1 as it is, and a fit that came before the refusal folded its map
there), scores that unrecovered model as a cold run of the mask would (outside the budget), and
fits the budget again with the warm start's seconds counted (they were spent) on the warm start's
timed steps (a second probe would spend more). The run folder records the fall-back
(:data:`COLD_START_FILE`), and a ``--resume`` starts cold again. A warm start asked for by name is
refused where the budget leaves it too few steps (one line naming the cold start) and trains
any number of steps.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable

from ..atomic import write_json
from ..core.precision import resolve_precision
from ..errors import OverRepError, WarmStartTooShort
from ..model.prefix import SharedPrefix, first_changed_block
from ..model.presets import get_preset
from ..model.wrap import plan_recovery
from ..recovery.methods import prepare_closed_form, resolve_warm_start, too_many_steps
from ..recovery.methods.closed_form import AUTO

#: the record of a run where ``auto`` fell back to the cold start, in its folder: a ``--resume`` starts cold too
COLD_START_FILE = "cold_start.json"


def resolve(p, cold_because: tuple[str, str] | None = None) -> None:
    """Pipeline ``p``'s ``recovery.warm_start`` resolved (``cold_because``: why ``auto`` starts
    cold whatever the mask, ``(code, sentence)``), then what follows from it: the recovery plan (the warm start has
    its own layout), the blocks every model shares, the resolved ``recovery`` section, the step
    count and the teacher."""
    r, p.metrics["warm_start"] = resolve_warm_start(
        p.cfg.recovery, p.method, p.dense, None if p.width else p.selection.removed, p.train_ids[:2],
        cold_because=cold_because, steps=None if p.budgeted else p.cfg.total_steps())
    if not p.width:
        p.plan = plan_recovery(p.dense, p.selection.removed, get_preset(r.preset_name), blocks=r.blocks_per_run,
                               block1_init=r.block1_layout, final_block=r.final_block, keep=p.selection.replaced)
    p.shared_prefix = SharedPrefix(p.dense, 0 if p.width else first_changed_block(p.plan))
    lr = r.lr if r.lr is not None else p.method.default_lr
    p.rcfg = dataclasses.replace(r, lr=lr, warmup_steps=r.resolved_warmup_steps,
                                 precision=resolve_precision(r.precision, p.device))
    p.total_steps = p.cfg.total_steps()
    p.teacher = p.make_teacher()


def auto_warm(p) -> bool:
    """``recovery.warm_start: auto`` resolved to a warm start (which :func:`start_cold` may take back)."""
    return p.metrics["warm_start"]["setting"] == AUTO and p.metrics["warm_start"]["used"] != "none"


def resumes_cold(p) -> tuple[str, str] | None:
    """Why a ``--resume`` of a run where ``auto`` fell back to the cold start starts cold too
    (``(code, sentence)`` for :func:`resolve`; None: it resumes as ``auto`` resolves). The run
    folder keeps that fall-back's record (:data:`COLD_START_FILE`, written by :func:`start_cold`):
    the step count that decided it may have been re-fitted since, and Plain's cold plan is its warm one."""
    if not (p.resume and auto_warm(p)):
        return None
    path = p.out / COLD_START_FILE
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        return saved["cold"], f"the run it resumes started cold: {saved['why']}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise OverRepError(f"cannot read {path} ({type(e).__name__}: {e}): the run folder is damaged") from None


def fit_budget_warm_or_cold(p, fit: Callable[..., object], started: float, prepared: dict, deferred: bool):
    """The time budget's fit, ``fit(started, prepared, warm, timed=None, timed_by=None)``, and
    what the closed-form preparation did to the model trained, as ``(budget, prepared)``.

    ``deferred``: a warm start whose map is not fitted yet. Its probe times the warm layout as it
    stands (a step costs the same before the fit), so that a budget too short for it is known
    before the fit's seconds are spent; the map is then fitted and the steps fitted again on
    the same probe with those seconds counted. Where the budget leaves an ``auto`` warm start
    too few steps, or more than its method's ``auto_warm_max_steps`` (Plain's and Streamline's:
    the map stops paying them), :func:`start_cold` and fit again on the warm start's timed steps
    (a cold step costs less: two blocks against three, and in the same budgets the cold start
    trained 4-25% more steps, docs/closed-forms.md; the trainer's re-fits time the real ones),
    the seconds spent so far counted."""
    warm = deferred or bool(prepared.get("warm_start"))
    try:
        budget = fit(started, prepared, warm)
        too_long = past_ceiling(p, budget)
        if too_long is None and deferred:
            prepared = prepare_closed_form(p.method_inputs(), p.method)  # in the budget
            if budget is not None and budget.timed is not None:
                budget = fit(started, prepared, True, budget.timed, "this run's probe, timed before the warm "
                             "start's map was fitted")
    except WarmStartTooShort as refused:
        if not auto_warm(p):  # a warm start asked for by name
            raise
        return fit_cold(p, fit, started, ("budget", f"the time budget leaves the warm start {refused.why}"),
                        refused.timed, refused.why)
    if too_long is not None:
        return fit_cold(p, fit, started, ("steps", too_long), budget.timed, too_long)
    return budget, prepared


def past_ceiling(p, budget) -> str | None:
    """Why an ``auto`` warm start trains past its method's ``auto_warm_max_steps`` on the steps the
    budget's probe fitted (None: it does not, or the steps came from a checkpoint)."""
    cap = p.method.auto_warm_max_steps
    if cap is None or not auto_warm(p) or budget is None or budget.costs is None or budget.steps <= cap:
        return None
    return too_many_steps(p.method, budget.steps)


def fit_cold(p, fit: Callable[..., object], started: float, because: tuple[str, str], timed: tuple | None,
             tried: str):
    """:func:`start_cold` for ``because`` (``(code, sentence)``), then the budget fitted again on
    the warm start's ``timed`` steps, the seconds spent so far counted; ``tried``: the warm
    start's shortfall, for a refusal of the cold start too."""
    spent = time.perf_counter() - started  # the warm start's probe (and its fit, if it came to that)
    start_cold(p, because)
    prepared = prepare_closed_form(p.method_inputs(), p.method)
    p.recovery_started = started = time.perf_counter() - spent  # (not the unrecovered model's scoring)
    try:
        return fit(started, prepared, False, timed, "the warm start's probe (recovery.warm_start auto fell back to "
                   "the cold start)"), prepared
    except OverRepError as cold_refused:
        raise OverRepError(f"{cold_refused} (recovery.warm_start auto tried the warm start first: {tried})") from None


def start_cold(p, because: tuple[str, str]) -> None:
    """The cold start's plan instead of the warm start's (``because``: ``(code, sentence)``), the
    fall-back recorded in the run folder for a ``--resume``, the model pruned again and, where
    the run scored the unrecovered model, that model scored anew."""
    resolve(p, cold_because=because)  # (logged)
    if p.world.is_main and p.folder is not None:
        write_json(p.out / "plan.json", p.plan.to_dict(), "the pruning plan")
        write_json(p.out / COLD_START_FILE, {"cold": because[0], "why": because[1]}, "the cold start's record")
    p.prune()
    if "pruned" in p.eval_cost:
        p.evaluate_model(p.pruned, "pruned")
