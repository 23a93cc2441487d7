"""Training-free methods (``replaceme``, ``replaceme-cos``, ``prunecomp``) and what any method may apply to the
pruned model before it starts: Prune&Comp's scale (``recovery.compensate``) and a
closed-form warm start (``recovery.warm_start``).

``replaceme`` fits one linear map per removed run in closed form and folds it into the
``down_proj`` of the block before the run (:mod:`overrep.recovery.closed_form`);
``replaceme-cos`` fits it by Adam on the cosine distance. Neither trains the model: the
pipeline records zero training steps and exports the compact model as it is.

A warm start folds the same map into the pruned model *before* the method sets up what it
trains, so any method that trains may start from the fitted weights: OverRep, Plain and
Streamline (block 1 of each module is the block the map folds into), and the methods trained
end to end, LoRA among them (its adapters then train on ReplaceMe's compact model, the
baseline a fair comparison of warm starts needs). Prune&Comp's scale multiplies the
stream before each gap; a layer-wise module is trained on the dense model's unscaled
features and learns the gap itself, so there the scale is refused (it would not be the
function the features describe).

``recovery.warm_start: auto`` warm-starts where it is measured to help and the fit applies
(:func:`resolve_warm_start`): a method whose entry says ``auto_warm_start`` (OverRep at any step
count; Plain up to :data:`PLAIN_AUTO_WARM_MAX_STEPS` steps and Streamline up to
:data:`STREAMLINE_AUTO_WARM_MAX_STEPS`, where the map was measured to
pay them: docs/closed-forms.md), block pruning, a mask of
one removed run (several runs measured worse warm: docs/results-log.md), and every removed run
foldable (:func:`~overrep.recovery.closed_form.fold_blocker`);
anywhere else the run starts cold and ``metrics.json`` says why.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from ...errors import OverRepError
from ...model.arch import decoder_layers
from ...model.surgery import AUTO_BLOCKS, contiguous_runs, plan_pruning, resolve_blocks
from ..closed_form import FitOptions, check_tokens, fit_and_fold, fold_blocker
from ..compensation import prunecomp
from ..teacher import MethodInputs
from .base import Method, MethodRun

log = logging.getLogger(__name__)

COMPENSATE = ("none", "prunecomp")
#: closed forms a method that trains may start from (the fit each one is)
WARM_STARTS = {"none": None, "replaceme": "lstsq", "replaceme-cos": "cosine"}
#: ``recovery.warm_start: auto``: this closed form where it applies (:func:`resolve_warm_start`), else none
AUTO = "auto"
AUTO_WARM_START = "replaceme"
#: why ``auto`` started a run cold, as ``metrics.json`` records it (``warm_start.cold``) beside
#: its sentence (``warm_start.why``), each in a few words for a table (``resumed``: a resumed
#: fall-back of older code; a resumed run now keeps its first reason's code)
COLD_STARTS = {"budget": "too short for the warm start", "resumed": "too short for the warm start",
               "method": "not measured to gain from it", "width": "width pruning", "runs": "a mask of several runs",
               "no-map": "the map does not apply", "steps": "past the steps where the map pays"}
#: the most optimiser steps at which ``auto`` warms Plain and Streamline (``Method.auto_warm_max_steps``;
#: OverRep has none: on one-run masks its map paid at every step count measured, by less with
#: more steps, never worse: 2.5% on validation on the paper's mask at 1,671-2,411 steps, three
#: seeds, on the family 6 model 167 Xeon at 10 minutes, docs/results-log.md; level at 3,000 steps
#: on one H100). Measured on the cosine mask at 25%, on validation, the steps the warm start
#: trained (docs/closed-forms.md): the map paid Plain 13% at
#: 186-207 steps (bf16, 5 minutes), 8% at 233-242 (fp32, 10 minutes) and 0.1-4% at 363-388 (fp32,
#: 15 minutes), and cost it 6% at 426-472 (bf16, 10 minutes); it paid Streamline 11% at
#: 215-224 (bf16, 5 minutes), 15% at 251-261 (fp32, 10 minutes) and 10% at 318 (fp32, 12.5
#: minutes, one seed), was level with the cold start over three seeds at 367-420 (fp32, 15 minutes:
#: 3-4% worse on two, 0.8% better on one) and cost it 5% at 479-490 (bf16, 10 minutes); three
#: seeds, every seed, where not said. Plain's crossover is near 400; Streamline's is lower, near
#: 370 (its gain at 318 steps, level on average at 367-420), so its ceiling sits below that. Near
#: a crossover the two starts are level, so an error in a ceiling costs little
PLAIN_AUTO_WARM_MAX_STEPS = 400
STREAMLINE_AUTO_WARM_MAX_STEPS = 350
#: the preset ``auto``'s warm start trains instead of the default ``hybrid``: the annealed activation
#: loses the closed form's head start (2.5 min: validation 120 linear against 144 annealed,
#: docs/closed-forms.md)
WARM_PRESETS = {"hybrid": "hybrid-linear"}
#: the module layout ``auto``'s warm start trains where the method lets the preset be chosen
#: (OverRep) and the mask removes one run with room for it (:func:`warm_layout_fits`): block 1
#: is the retained block the fit folds into (ReplaceMe's own layout), and three recovery blocks
#: where ``recovery.blocks`` is ``auto``. Chosen on validation by fixed-step sweeps whose step
#: counts match the 2-core CPU's cost of each layout (three seeds each, docs/results-log.md, "The
#: warm start's own layout"): the cosine mask at 25%, 78.9 against 81.3 for the stitched
#: two-block module; the cosine mask at 50%, 199 against 428.
WARM_BLOCK1 = "retained"
WARM_BLOCKS_ONE_RUN = 3


def warm_layout_fits(num_layers: int, removed: list[int], final_block: bool) -> str | None:
    """Why the warm start's own layout does not apply to ``removed``, a mask of one removed run
    (None: it does; :func:`resolve_warm_start` starts a mask of several runs cold). It needs two
    blocks after the run that a module may take (the final block only where
    ``recovery.final_block``), so that the module reaches its three blocks. On the paper's mask
    (run 18-28 of 30: one block after it) the module stays two blocks and retained block 1 lost
    to the stitched one: validation 142.4 against 128.1, three seeds (docs/results-log.md)."""
    # the module the layout would plan, laid out as the run will lay it out
    layers = plan_pruning(num_layers, removed, blocks=WARM_BLOCKS_ONE_RUN, block1_init=WARM_BLOCK1,
                          final_block=final_block).groups[0].module_layers
    if len(layers) < WARM_BLOCKS_ONE_RUN:
        return (f"{len(layers) - 1} block(s) after the removed run leave no room for {WARM_BLOCKS_ONE_RUN} "
                "recovery blocks")
    return None


@dataclass
class ClosedFormOptions:
    """The ``recovery`` keys of the closed forms (docs/closed-forms.md)."""

    compensate: str = "none"  # any method but the layer-wise ones: "prunecomp" scales the stream before each gap by mean|X_after|/mean|X_before| (Prune&Comp, folded exactly) before the method starts | "none"
    warm_start: str = "auto"  # "auto": replaceme for overrep (its preset hybrid trained as hybrid-linear; on a one-run mask with two blocks after the run, block 1 retained and, where blocks is auto, three blocks) where the fit applies and a time budget leaves it 20 steps, else none (metrics.json says why) | any method that trains: "replaceme" | "replaceme-cos" folds the closed-form map into the down_proj before each removed run before training (a layer-wise module's block 1) | "none": a cold start
    closed_rows: int = 64  # training rows the closed forms are fitted on (streamed; never validation or test rows)
    closed_tokens: str = "balanced"  # tokens the fit counts: "balanced" (every token; the attention sinks, the first token and any with RMS > 10x the row's median, weighted to count 3x the other tokens together) | "all" (the published fit) | a +-joined subset of skip-first | sinks (the sinks left out) | rms (each row divided by the target's RMS); chosen on validation rows over four samples of calibration rows, docs/closed-forms.md
    closed_ridge: float = 1e-4  # least squares: ridge, relative to the mean diagonal of M^T M (the published fit: 0)
    closed_cos_steps: int = 300  # replaceme-cos: Adam steps on 1 - cos
    closed_cos_lr: float = 1e-3  # replaceme-cos: Adam learning rate
    closed_cos_seconds: float | None = None  # replaceme-cos: stop after this many seconds (None: closed_cos_steps only)

    def check_closed_form(self, method: Method) -> None:
        """The closed-form keys against the method they would apply to (no model needed)."""
        if self.compensate not in COMPENSATE:
            raise OverRepError(f"recovery.compensate must be one of {', '.join(COMPENSATE)}, got '{self.compensate}'")
        if self.warm_start not in (*WARM_STARTS, AUTO):
            raise OverRepError(f"recovery.warm_start must be one of {', '.join(WARM_STARTS)}, {AUTO}; "
                               f"got '{self.warm_start}'")
        if self.warm_start in WARM_STARTS and self.warm_start != "none" and not method.trains:
            raise OverRepError(f"recovery.warm_start starts a method that trains from the closed form; '{method.name}' "
                               "trains nothing (for the closed form alone: --method replaceme)")
        if self.compensate != "none" and method.objective == "layerwise":
            raise OverRepError(f"recovery.compensate scales the stream before each gap, but '{method.name}' learns the "
                               "gap from unscaled dense features; use it with replaceme or a method trained end to end")
        check_tokens(self.closed_tokens)
        if self.closed_rows < 1 or self.closed_ridge < 0 or self.closed_cos_steps < 0 or self.closed_cos_lr <= 0:
            raise OverRepError("recovery.closed_rows must be >= 1, closed_ridge >= 0, closed_cos_steps >= 0 and "
                               "closed_cos_lr > 0")


def fit_options(r) -> FitOptions:
    """The ``recovery.closed_*`` keys as :class:`FitOptions`."""
    return FitOptions(rows=r.closed_rows, tokens=r.closed_tokens, ridge=r.closed_ridge, cos_steps=r.closed_cos_steps,
                      cos_lr=r.closed_cos_lr, cos_seconds=r.closed_cos_seconds, precision=r.precision)


def resolve_warm_start(r, method: Method, model, removed: list[int] | None, probe,
                       cold_because: tuple[str, str] | None = None, steps: int | None = None) -> tuple[object, dict]:
    """``r`` (the ``recovery`` section) with ``warm_start`` and ``preset`` made concrete before
    the recovery is planned, and its record for ``metrics.json`` (what ``auto`` chose and why).
    ``model``: the dense model; ``removed``: its removed blocks (None: width pruning);
    ``probe``: a training row or two for :func:`~overrep.recovery.closed_form.fold_blocker`;
    ``cold_because``: why ``auto`` starts cold whatever the mask, ``(code, sentence)`` (a time
    budget that left the warm start fewer steps than its floor: :func:`~overrep.app.warm_start.start_cold`);
    ``steps``: the run's step count where it is known before the plan (no time budget; under one,
    :func:`~overrep.app.warm_start.fit_budget_warm_or_cold` applies ``method.auto_warm_max_steps``);
    the record names the reason of a cold start by its :data:`COLD_STARTS` code (``cold``)."""
    if r.warm_start != AUTO:
        if r.warm_start != "none" and removed is None:  # (prepare would fold nothing and say it had)
            raise OverRepError(f"recovery.warm_start: {r.warm_start} folds a map over each removed run of blocks; "
                               "width pruning removes none (use recovery.warm_start: none or auto)")
        return r, {"setting": r.warm_start, "used": r.warm_start}
    cold = None
    if cold_because is not None:
        cold, why = cold_because
    elif not method.auto_warm_start:
        cold, why = "method", (f"{method.name} is not measured to gain from it (recovery.warm_start: replaceme "
                               "starts it warm)")
    elif (cap := method.auto_warm_max_steps) is not None and steps is not None and steps > cap:
        cold, why = "steps", too_many_steps(method, steps)
    elif removed is None:
        cold, why = "width", "the closed forms replace removed blocks, not pruned widths"
    elif len(runs := contiguous_runs(removed)) > 1:
        # measured: on Block Influence's mask of four runs (one map and one stitched block a run)
        # the warm start was 7-9% worse on validation than the cold one on each of three seeds at
        # 2.5 minutes, and 15% and 9% worse at 5 and 10 minutes (seed 0; docs/closed-forms.md);
        # recovery.warm_start: replaceme still warms it
        cold, why = "runs", (f"the mask removes {len(runs)} separate runs, where the warm start measured worse "
                             "(recovery.warm_start: replaceme starts it warm)")
    else:
        blocker = fold_blocker(model, removed, probe)
        cold, why = ("no-map", f"ReplaceMe's map does not apply: {blocker}") if blocker else (None, None)
    used = "none" if cold else AUTO_WARM_START
    if why and method.auto_warm_start:
        log.warning("recovery.warm_start auto: starting cold (%s)", why)
    record = {"setting": AUTO, "used": used, "preset": method.preset or r.preset,
              **({"why": why, "cold": cold} if cold else {})}
    if used == "none" or method.preset is not None:  # cold, or a method that forces its own preset (Plain's)
        return dataclasses.replace(r, warm_start=used), record
    # the recipe measured for the warm start: its preset and, where the mask leaves it room,
    # block 1 retained and three blocks; elsewhere the layout configured
    unfit = warm_layout_fits(len(decoder_layers(model)), removed, r.final_block)
    block1 = r.block1_init if unfit else WARM_BLOCK1
    blocks = WARM_BLOCKS_ONE_RUN if not unfit and r.blocks == AUTO_BLOCKS else r.blocks
    warm = dataclasses.replace(r, warm_start=used, preset=WARM_PRESETS.get(r.preset, r.preset),
                               block1_init=block1, blocks=blocks)
    record.update(preset=warm.preset, block1_init=block1, blocks=resolve_blocks(blocks, removed),
                  **({"layout_why": f"the layout configured: {unfit}"} if unfit else {}))
    return warm, record


def too_many_steps(method: Method, steps: int) -> str:
    """Why ``auto`` starts ``method`` cold at ``steps`` optimiser steps (past its ceiling)."""
    return (f"{method.name} trains {steps} steps, past the {method.auto_warm_max_steps} up to which the map was "
            "measured to pay it (recovery.warm_start: replaceme starts it warm)")


def fits_warm_start(r, method: Method) -> bool:
    """Whether :func:`prepare` fits a map for the (resolved) ``recovery`` section ``r``: a
    warm start named or chosen by ``auto``, for a method that trains."""
    return WARM_STARTS.get(r.warm_start) is not None and method.trains


def prepare(inputs: MethodInputs, method: Method) -> dict:
    """Apply ``recovery.compensate`` and ``recovery.warm_start`` to ``inputs.pruned`` in place;
    what was done (empty: nothing)."""
    r, out = inputs.config, {}
    ids = inputs.train_ids
    if r.compensate == "prunecomp":
        t0 = time.perf_counter()
        out["prunecomp"] = prunecomp(inputs.pruned, inputs.dense, inputs.plan, ids[:r.closed_rows],
                                     tokens=r.closed_tokens)  # (only which tokens count)
        out["prunecomp"]["seconds"] = time.perf_counter() - t0
    if fits_warm_start(r, method):
        kind = WARM_STARTS[r.warm_start]
        fit = out["warm_start"] = fit_and_fold(inputs.pruned, inputs.dense, inputs.plan, ids, fit_options(r), kind)
        log.info("warm start: ReplaceMe's map (%s) fitted on %d rows and folded into block(s) %s in %.1f s", kind,
                 fit["rows"], ", ".join(str(x["block"]) for x in fit["runs"]), sum(x["seconds"] for x in fit["runs"]))
    return out


class ClosedFormRun(MethodRun):
    """ReplaceMe: the map fitted and folded when the method is set up; nothing trains
    (its :class:`Method` entry says ``trains=False``)."""

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        self.objective = None
        self.fit: dict = {}
        if with_data and method.objective == "scale":  # Prune&Comp alone
            t0, r = time.perf_counter(), inputs.config
            self.fit = prunecomp(self.model, inputs.dense, inputs.plan, inputs.train_ids[:r.closed_rows],
                                 tokens=r.closed_tokens)
            self.fit["seconds"] = time.perf_counter() - t0
        elif with_data:
            kind = method.objective  # "lstsq" | "cosine": the fit is the method's objective
            self.fit = fit_and_fold(self.model, inputs.dense, inputs.plan, inputs.train_ids, fit_options(inputs.config),
                                    kind)

    @property
    def trainable_params(self) -> int:
        return 0

    def finish(self) -> dict:
        return {"closed_form": self.fit} if self.fit else {}

    def describe(self) -> dict:
        r = self.inputs.config
        return {**super().describe(), "closed_form": {"rows": r.closed_rows, "tokens": r.closed_tokens,
                                                      "ridge": r.closed_ridge}}
