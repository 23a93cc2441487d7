"""What a recovery method optimises: one small class per training objective.

The :class:`~overrep.recovery.trainer.Trainer` (optimiser, schedule, clipping, checkpoints, resume)
is the same for every method; an objective supplies the trainable parameters, the loss
of a micro-batch of training-row indices, and any state of its own.

* :class:`Layerwise` -- OverRep and the layer-wise baselines (paper ``eq:ours``):
  each recovery module's output against the dense model's hidden state after the
  removed segment, on cached (or live) teacher features, compared by ``recovery.loss``
  (:mod:`overrep.recovery.losses`; ``mse``, the paper's, by default).
* :class:`LanguageModeling` -- next-token cross-entropy of the whole pruned model
  (LoRA, AdaLoRA, full fine-tuning).
* :class:`LogitDistillation` -- forward KL ``KL(p_teacher || p_student)`` at temperature
  ``tau`` over the whole vocabulary, the dense model as teacher (logit-KD, OverRep-KD).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..core.experts import is_fused_experts
from ..core.precision import autocast
from ..core.projection import OvercompleteLinear
from ..model.lm_loss import CausalLMLoss
from .losses import LOSSES, LossOptions, parse_loss

# indices -> per module {"inputs": [B,T,H], "targets": [B,T,H]}
BatchSource = Callable[[list[int]], list[dict]]


def pretrained_matrix_ids(module: nn.Module) -> set[int]:
    """ids of pretrained weight matrices: the only tensors that get weight decay.

    W and D (identity-initialised reparameterisations), norms, biases and adapters are
    never decayed (the reference code decays D towards 0, away from its initialisation).
    """
    ids = set()
    for m in module.modules():
        if isinstance(m, OvercompleteLinear):
            ids.add(id(m.base_layer.weight))
        elif type(m) is nn.Linear:
            ids.add(id(m.weight))
        elif is_fused_experts(m):  # the stacked expert matrices (wrapped or not), found by structure
            ids.update((id(m.gate_up_proj), id(m.down_proj)))
    return ids


class Objective:
    """Interface used by the Trainer; subclasses override what they need."""

    #: the annealed activations this objective's model contains (stepped by the Trainer);
    #: an immutable default, so no two objectives can share (and mutate) one list
    activations: tuple | list = ()
    #: whether the step count may change after training has started (a budget's re-fit)
    retargetable: bool = True
    #: steps in one pass over the training rows (the Trainer sets it; None: not known)
    pass_steps: int | None = None
    #: rows past the cached ones (row indices from the cached count on) that a one-pass later
    #: phase may read, their features computed when read (:attr:`Loss.live
    #: <overrep.recovery.losses.Loss.live>`); 0: the cached rows only
    live_rows: int = 0

    def parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def decayed_ids(self) -> set[int]:
        return set()

    def loss(self, idx: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def validation_loss(self) -> float | None:
        return None

    def validation_ppl(self) -> float | None:
        """Held-out perplexity of the pruned model as it stands (a few rows; None: not measured)."""
        return None

    @contextmanager
    def validation_sample(self, fraction: float) -> Iterator[float]:
        """Inside, a validation reads only about ``fraction`` of its rows, so that a budget
        can time one cheaply; yields the factor from that timing to a whole validation's."""
        yield 1.0

    def train(self, mode: bool = True) -> None:
        pass

    def after_optimizer_step(self, step: int) -> None:
        """Called after ``optimizer.step()`` and before gradients are cleared."""

    def set_total_steps(self, total: int) -> None:
        """The run now lasts ``total`` steps (phases that are fractions of it follow)."""

    def phase_starts(self) -> list[int]:
        """Steps at which the objective changes what a step computes (a budget times each phase)."""
        return []

    def step_limit(self) -> int | None:
        """The most steps the run may last as things stand (None: no limit)."""
        return None

    def later_phase(self) -> tuple[float, bool] | None:
        """``(share of the steps, one pass over the rows at most)`` of the phase a loss
        switches to, for a time budget's arithmetic (None: one phase)."""
        return None

    def phase(self) -> str | None:
        """What the next step computes, where the objective has phases (None: one phase)."""
        return None

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass


def _kept(rows: int, fraction: float) -> int:
    """Rows a validation sample of ``fraction`` keeps: at least one, at most all."""
    return min(rows, max(1, math.ceil(rows * fraction)))


def unique_trainable(modules) -> list[nn.Parameter]:
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class Layerwise(Objective):
    """OverRep's objective: each recovery module reproduces the dense segment's output.

    ``options.loss`` names the comparison (an entry of :data:`overrep.recovery.losses.LOSSES`;
    ``mse``, the paper's, when no options are given), or two joined as ``"A>B"``: A until
    ``options.loss_switch`` (fraction of ``total_steps``), then B; the losses read their other
    settings (``loss_lambda``, ``loss_sinks``, ...) from the same options (a run passes its whole
    recovery config). ``aux[i]`` holds module i's constants (what the losses prepared); a batch
    dict may carry per-row extras (a loss's ``rows``).
    ``ppl_model`` / ``ppl_ids``: the pruned model (modules in place) and held-out rows for
    :meth:`validation_ppl`; ``prefix``: the first blocks it shares with the dense model, which a
    validation then runs once (:mod:`overrep.model.prefix`).
    """

    def __init__(self, modules, contexts: list[list[dict]], source: BatchSource | None,
                 val_batch: list[dict] | None = None, options: LossOptions | None = None,
                 aux: list[dict] | None = None, total_steps: int = 1, ppl_model=None, ppl_ids=None, prefix=None):
        self.modules, self.contexts, self.source, self.val_batch = modules, contexts, source, val_batch
        self.activations = [m.activation for m in modules]
        self.options = options or LossOptions(loss="mse")
        self.phases = parse_loss(self.options.loss)
        self.aux = aux or [{} for _ in modules]
        self.set_total_steps(total_steps)
        self.ppl_model, self.ppl_ids, self.prefix = ppl_model, ppl_ids, prefix
        self.step = 0

    def _later_phase_began(self) -> bool:
        return len(self.phases) > 1 and 0 < getattr(self, "switch_step", 0) <= getattr(self, "step", 0)

    def set_total_steps(self, total: int) -> None:
        if self._later_phase_began():
            return  # it stays where it began (budget.refit_late_phase shortens it; step_limit bounds it)
        switch = int(round(self.options.loss_switch * total))
        if self._one_pass_phase():
            switch = max(switch, total - self.pass_steps)
        self.switch_step = switch

    def _one_pass_phase(self) -> bool:
        """Whether the later phase learns the training text itself (``Loss.fresh``), so that
        it runs for one pass over the rows at most: a second pass learns them by heart. On a
        CPU with fast bf16, 800 steps of ``normed>ce`` on 768 rows scored 49.8 on validation
        60 steps into the ``ce`` phase and 53.6 at its end, 160 steps (1.7 passes) in
        (docs/losses.md). The steps it gives up go to the first phase."""
        return len(self.phases) > 1 and LOSSES[self.phases[-1]].fresh and bool(self.pass_steps)

    def step_limit(self) -> int | None:
        # before the switch set_total_steps keeps the phase to one pass; after it, this does
        return self.switch_step + self.pass_steps if self._one_pass_phase() and self._later_phase_began() else None

    def later_phase(self) -> tuple[float, bool] | None:
        return (1 - self.options.loss_switch, self._one_pass_phase()) if len(self.phases) > 1 else None

    def phase_starts(self) -> list[int]:
        return [self.switch_step] if len(self.phases) > 1 else []

    def phase(self) -> str | None:
        return self.current() if len(self.phases) > 1 else None

    def current(self) -> str:
        """The loss the modules train with now."""
        return self.phases[-1] if len(self.phases) > 1 and self.step >= self.switch_step else self.phases[0]

    def parameters(self):
        return unique_trainable(self.modules)

    def decayed_ids(self):
        return set().union(*(pretrained_matrix_ids(m) for m in self.modules))

    def batch_loss(self, batch: list[dict]) -> torch.Tensor:
        loss = LOSSES[self.current()]
        losses, parts = [], list(zip(self.modules, self.contexts, batch, self.aux))
        if loss.tail and self.options.loss_tail == "once" and len(parts) > 1:
            # the first module's tail runs every later one: the pruned model's own loss from its first gap on
            parts = [min(parts, key=lambda part: part[0].compact_indices[0])]
        for m, ctx, feats, aux in parts:
            p = next(m.parameters())
            pred = m(feats["inputs"].to(p.device, p.dtype), ctx)
            losses.append(loss.compute(pred, feats, aux, self.options))
        return torch.stack(losses).mean()

    def loss(self, idx):
        return self.batch_loss(self.source(idx))

    def after_optimizer_step(self, step: int) -> None:
        self.step = step + 1

    def extra_state(self) -> dict:
        return {"step": self.step, "switch_step": self.switch_step}

    def load_extra_state(self, state: dict) -> None:
        self.step = state.get("step", 0)
        self.switch_step = state.get("switch_step", self.switch_step)

    @torch.no_grad()
    def validation_loss(self):
        if not self.val_batch:
            return None
        self.train(False)
        loss = self.batch_loss(self.val_batch).item()
        self.train(True)
        return loss

    @contextmanager
    def validation_sample(self, fraction):
        batch, ids = self.val_batch, self.ppl_ids
        factors = [1.0]
        if batch:
            keep = _kept(len(batch[0]["inputs"]), fraction)
            self.val_batch = [{k: v[:keep] for k, v in f.items()} for f in batch]
            factors.append(len(batch[0]["inputs"]) / keep)
        if ids is not None:
            self.ppl_ids = ids[:_kept(len(ids), fraction)]
            factors.append(len(ids) / len(self.ppl_ids))
        try:
            yield max(factors)
        finally:
            self.val_batch, self.ppl_ids = batch, ids

    @torch.no_grad()
    def validation_ppl(self):
        if self.ppl_model is None or self.ppl_ids is None:
            return None
        from ..model.perplexity import row_token_nll

        was = self.ppl_model.training
        ppl = math.exp(row_token_nll(self.ppl_model, self.ppl_ids, prefix=self.prefix).mean().item())
        self.ppl_model.train(was)
        self.train(True)
        return ppl

    def train(self, mode=True):
        for m in self.modules:
            m.train(mode)


class _WholeModel(Objective):
    """Shared by the objectives that run the whole pruned model on token rows."""

    def __init__(self, model: nn.Module, train_ids: torch.Tensor, val_ids: torch.Tensor | None,
                 params: list[nn.Parameter] | None = None, activations: list | None = None,
                 decayed: set[int] | None = None, precision: str = "fp32"):
        """``params``: what trains (default: every trainable parameter of ``model``);
        ``decayed``: ids of the parameters given weight decay (default: pretrained matrices);
        ``precision``: the training forward's (``recovery.precision``: ``bf16`` autocasts it over
        the fp32 weights, as the layer-wise methods do; validation always runs in fp32)."""
        self.model, self.train_ids, self.val_ids = model, train_ids, val_ids
        self.precision = precision
        self._params, self._decayed = params, decayed
        self.activations = activations or []

    @property
    def device(self):
        return next(self.model.parameters()).device

    def parameters(self):
        return self._params if self._params is not None else unique_trainable([self.model])

    def decayed_ids(self):
        return pretrained_matrix_ids(self.model) if self._decayed is None else self._decayed

    def rows_loss(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, idx):
        with autocast(self.precision, self.device):
            return self.rows_loss(self.train_ids[idx].to(self.device))

    @torch.no_grad()
    def validation_loss(self):
        if self.val_ids is None:
            return None
        self.train(False)
        losses = [self.rows_loss(self.val_ids[i:i + 4].to(self.device)).item()
                  for i in range(0, self.val_ids.shape[0], 4)]
        self.train(True)
        return sum(losses) / len(losses)

    @contextmanager
    def validation_sample(self, fraction):
        ids = self.val_ids
        if ids is None:
            yield 1.0
            return
        self.val_ids = ids[:_kept(len(ids), fraction)]
        try:
            yield len(ids) / len(self.val_ids)
        finally:
            self.val_ids = ids

    @torch.no_grad()
    def validation_ppl(self):
        if self.val_ids is None:
            return None
        from ..model.perplexity import perplexity

        ppl = perplexity(self.model, self.val_ids, progress=False)
        self.train(True)
        return ppl

    def train(self, mode=True):
        self.model.train(mode)


class LanguageModeling(_WholeModel):
    """Mean next-token cross-entropy (plus whatever regulariser the model adds to it,
    e.g. AdaLoRA's orthogonality penalty, which PEFT adds when labels are passed)."""

    #: the loss through the frozen head without the batch's logits (:class:`~overrep.model.lm_loss.CausalLMLoss`)
    fused_loss = True

    def rows_loss(self, ids):
        if getattr(self, "_lm_loss", None) is None:
            self._lm_loss = CausalLMLoss(self.model, fused=self.fused_loss)
        return self._lm_loss(ids)


class LogitDistillation(_WholeModel):
    """Forward KL from the dense teacher's next-token distribution, temperature ``tau``
    (loss scaled by ``tau**2`` so its gradient scale does not depend on ``tau``)."""

    def __init__(self, model, teacher: nn.Module, train_ids, val_ids, params=None, activations=None,
                 decayed=None, tau: float = 1.0, precision: str = "fp32"):
        super().__init__(model, train_ids, val_ids, params, activations, decayed, precision)
        self.teacher, self.tau = teacher, tau

    def rows_loss(self, ids):
        with torch.no_grad():
            t = self.teacher(input_ids=ids, use_cache=False).logits.float()
            log_t = F.log_softmax(t / self.tau, dim=-1)
            del t
        s = self.model(input_ids=ids, use_cache=False).logits.float()
        log_s = F.log_softmax(s / self.tau, dim=-1)
        kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)
        return kl.mean() * self.tau ** 2
