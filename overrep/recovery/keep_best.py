"""``recovery.keep_best``: end a recovery at its best validated step that folds exactly.

Every validation scores the perplexity of the model with the recovery in place on the
validation rows (documents no training row uses; never the test rows the report scores).
The run ends at the scored step of lowest perplexity among those whose weights fold
exactly (every annealed activation at α = 0, so only the final linear phase of an OverRep
run; any step of a method without annealing) when it beats the last step, and records
which in ``selected``. A layer-wise loss can keep falling while the language model gets
worse (docs/results-former-protocol.md, Streamline at 10 minutes); this is the guard.

A warm-started run also scores the closed form it starts from, before its first step
(:meth:`overrep.recovery.trainer.Trainer.score_the_start`): every factor is then at its
initialisation (W = 0, D = I, α = 0), so step 0 *is* the closed-form model and folds
exactly. A budget too short for training to pass it then ships the closed form rather than
something worse. Its floor is the warm start's own closed form (ReplaceMe's map in the block the
module trains), not necessarily the best one: on the default mask the stitched block that
``--method replaceme`` exports scored validation 196 where the warm start's retained block scored
232 (docs/closed-forms.md).

The best weights are held as a host (CPU) copy, this rank's shard of them under FSDP, so
the guard costs no accelerator memory.
"""

from __future__ import annotations

import logging
import math

from . import sharding

log = logging.getLogger(__name__)


class KeepBest:
    """The best foldable weights seen so far, and the choice made at the end."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.best: dict | None = None  # step, val_ppl, host copies of the trainable tensors
        self.start: dict | None = None  # step 0's validation, where a warm start scored it
        self.selected: dict | None = None  # which step the run ended at, and why

    def note(self, step: int, val_ppl: float | None, foldable: bool, params: list) -> None:
        if not self.enabled or val_ppl is None or not math.isfinite(val_ppl) or not foldable:
            return
        if self.best is None or val_ppl < self.best["val_ppl"]:
            self.best = {"step": step, "val_ppl": val_ppl, "tensors": [sharding.host_copy(p) for p in params]}

    def restore(self, step: int, scored: dict | None, params: list) -> None:
        """End at the best foldable step when it beats the last one, ``step`` (``scored``: the
        last history record with a validation); ``selected`` says which."""
        best = self.best
        # the last step's own score, or None where it was not validated (no room before the deadline)
        last = scored["val_ppl"] if scored is not None and scored["step"] == step else None
        if best is None:
            return
        if best["step"] == step or last is None or not best["val_ppl"] < last:
            self.selected = {"step": step, "val_ppl": last, "last_step": step, "last_val_ppl": last}
            if last is None:  # kept unvalidated: say which validated step was the last
                validated = scored or self.start
                self.selected.update(validated_step=validated["step"], validated_ppl=validated["val_ppl"])
        else:
            for p, t in zip(params, best["tensors"]):
                sharding.copy_from_host(p, t)
            log.info("keep_best: the recovery ends at step %d (val_ppl %.4g%s), not at its last step %d (%.4g)",
                     best["step"], best["val_ppl"], ", the closed form it started from" if best["step"] == 0 else "",
                     step, last)
            self.selected = {"step": best["step"], "val_ppl": best["val_ppl"], "last_step": step, "last_val_ppl": last}
        if self.start is not None and self.start["val_ppl"] is not None:
            self.selected["start_val_ppl"] = self.start["val_ppl"]  # the closed form's own score
            if self.start.get("val_seconds") is not None:  # and what scoring it cost (inside the budget)
                self.selected["start_val_seconds"] = self.start["val_seconds"]

    def checkpoint(self, step: int, params: list) -> dict:
        """What a checkpoint at ``step`` keeps (every rank calls it: it gathers the shards)."""
        best = None if self.best is None else {
            "step": self.best["step"], "val_ppl": self.best["val_ppl"],
            "tensors": None if self.best["step"] == step else
            [sharding.full_from_host(t, p) for t, p in zip(self.best["tensors"], params)]}
        return {"best": best, "start": self.start}

    def resume(self, state: dict, params: list) -> None:
        """Back to what :meth:`checkpoint` kept (``state``: the checkpoint; ``params``: the
        trainable tensors, already loaded from it)."""
        self.start = state.get("start")
        best = state.get("best")
        if best is not None:
            tensors = [sharding.host_copy(p if t is None else sharding.like(t, p))
                       for t, p in zip(best["tensors"] or [None] * len(params), params)]
            self.best = {"step": best["step"], "val_ppl": best["val_ppl"], "tensors": tensors}
