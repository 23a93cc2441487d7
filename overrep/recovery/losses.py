"""Layer-wise recovery losses: what "the module's output matches the dense model" means.

Every layer-wise method (OverRep, Plain, Streamline) trains its recovery modules on the
same teacher features; ``recovery.loss`` chooses how a module's output ``ĥ`` is compared
with the dense model's hidden state ``h`` at the same point. :data:`LOSSES` is the one
registry (the CLI help, the config validation, ``overrep methods`` and the
:class:`~overrep.recovery.objectives.Layerwise` objective read it): a :class:`Loss` entry
says what it computes per batch and what it prepares once per run, so a new loss is one
entry at the end of this file.

* ``mse`` -- mean squared error on the raw hidden state (the paper's objective).
* ``normed`` -- the comparison the next block actually sees: both states RMS-normalised,
  weighted per channel by the downstream norm's gain γ (the input norm of the dense
  block the target feeds, or the final norm), plus ``λ·(log rms ĥ − log rms h)²`` to keep
  the magnitude later blocks rely on; the attention sinks (tokens carrying massive
  activations) are averaged apart and weighed by ``recovery.loss_sinks``. For a module that
  owns the final norm the target is already ``γ ⊙ x / rms(x)``, so ``normed`` is the MSE on
  that output.
* ``fisher`` -- MSE weighted per channel by the dense model's diagonal Fisher
  ``E[(∂CE/∂h)²]`` at the module's output point (a second-order estimate of the loss
  change, in the spirit of BRECQ), estimated once on calibration rows and cached.
* ``logit`` -- for a module that ends at the final norm: the centred-logit MSE through the
  LM head, ``δᵀGδ / V`` with ``G = W_Uᵀ(I − 11ᵀ/V)W_U`` (d × d, built once), exact and as
  cheap as an MSE. Refused for a module inside the network.
* ``kl-topk`` -- the module's output runs through the remaining frozen blocks, the final
  norm and the LM head; forward KL to the dense model's top-K next-token log-probabilities
  (cached once), over K + 1 outcomes: the K tokens and one bucket for all the others
  (``recovery.loss_topk_rest``; off: renormalised on the K tokens, blind to the mass the
  student puts elsewhere, measured far worse). Equals the full KL when K = vocabulary.
  Lowest held-out perplexity on every mask of the early small-scale sweep (docs/losses.md).
* ``ce`` -- the next-token cross-entropy on the training text itself, through the same
  frozen tail as ``kl-topk``: the objective of a method trained end to end (``overrep-lm``,
  LoRA), on the recovery module's parameters only. Unlike the layer-wise losses it can learn
  what the text does differently from the dense model (the Penn Treebank's lower case,
  ``<unk>`` and ``N``), so after a layer-wise phase (``normed>ce``) it adapts the module to the
  training domains in a few steps (docs/losses.md).
* ``ce+kl`` -- ``(1 − w)·ce + w·kl-topk`` through one pass of the tail (``w`` =
  ``recovery.loss_kd``): the next-token loss of the training text, held towards the dense
  model's own predictions (knowledge distillation with hard labels, as in Hinton et al.'s
  distillation loss). The text's tokens teach what the training domains do differently; the
  teacher's distribution keeps what the dense model knows beyond them (docs/losses.md).
* ``recovery.loss_tail`` -- where a mask removes several runs, ``kl-topk``, ``ce`` and ``ce+kl`` run
  each module from the dense model's state at its input through its own tail (``each``: one tail
  pass per module a step), or the first module through the rest of the pruned model, later
  modules included (``once``, the default: one pass a step, the deployed model's own loss from
  the first gap; far better at the same seconds on Block Influence's five runs, docs/losses.md).
* ``A>B`` (e.g. ``normed>kl-topk``) -- loss A, then loss B from ``recovery.loss_switch``
  (fraction of the steps) on.

"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import OverRepError
from ..registry import Registry
from ..core.linear_ce import head_cross_entropy
from ..core.precision import autocast
from ..model.arch import decoder_layers, final_norm, input_norm
from ..model.hooks import run_to_hidden, run_to_logits
from ..model.placement import execution_device
from .closed_form import sink_mask
from .teacher_stats import cached_fisher, cached_topk, teacher_topk

def parse_loss(spec: str) -> list[str]:
    """``"normed>kl-topk"`` -> ``["normed", "kl-topk"]``; one-line error on an unknown name."""
    parts = [p.strip() for p in str(spec).split(">")]
    if not 1 <= len(parts) <= 2 or any(p not in LOSSES for p in parts):
        bad = next((p for p in parts if p not in LOSSES), spec)
        raise OverRepError(f"unknown recovery.loss '{bad}'; available: {', '.join(LOSSES)} "
                           "(or two joined as A>B: A, then B from recovery.loss_switch)")
    return parts


@dataclass
class LossOptions:
    """``recovery`` options of the methods trained on a layer-wise loss."""

    loss: str = "normed>ce"  # overrep / plain / streamline: mse (the paper's) | normed | fisher | logit | kl-topk | ce, or A>B: A, then B (see `overrep methods`); normed, then the next-token loss for the last fifth of the steps: better on every domain, unseen ones included, than normed alone at the same seconds (docs/losses.md)
    loss_lambda: float = 0.1  # normed: weight of the log-RMS (magnitude) term
    loss_sinks: float = 0.1  # normed: weight of the attention sinks' mean loss beside the other tokens' mean (a plain mean: about 1/255; without it a module can turn a massive activation away and break the model: docs/losses.md)
    loss_switch: float = 0.75  # A>B losses: fraction of the steps after which B replaces A (0.75 chosen on validation, docs/results-log.md; 0.8 before); later where a B that learns the text (ce, ce+kl) would see a row twice
    loss_kd: float = 0.5  # ce+kl: weight w of the KL to the dense model's top-K; the text's cross-entropy weighs 1 - w
    loss_topk: int = 64  # kl-topk, ce+kl: teacher log-probabilities cached per token
    loss_topk_rest: bool = True  # kl-topk: add one bucket for all tokens outside the top-K (else renormalise on it)
    fisher_sequences: int = 32  # fisher: training rows the diagonal Fisher is estimated on
    loss_tail: str = "once"  # kl-topk, ce, ce+kl on a mask with several runs: once (the first module through the rest of the pruned model, later modules included: one tail pass a step; Block Influence's five runs, 5 minutes: validation 66.9 against 96.7, docs/losses.md) | each (every module from the dense model's state at its input, through its own tail)

    def check_loss(self) -> None:
        parse_loss(self.loss)
        if self.loss_tail not in ("each", "once"):
            raise OverRepError(f"recovery.loss_tail must be 'each' or 'once', not '{self.loss_tail}'")
        if (self.loss_lambda < 0 or self.loss_sinks < 0 or not 0 <= self.loss_switch <= 1 or self.loss_topk < 1
                or self.fisher_sequences < 1 or not 0 <= self.loss_kd <= 1):
            raise OverRepError("recovery.loss_lambda and loss_sinks must be >= 0, loss_switch and loss_kd in [0, 1], "
                               "loss_topk and fisher_sequences >= 1")


def loss_help() -> str:
    return "; ".join(f"{k}: {v.description}" for k, v in LOSSES.items())


# ---- per-module constants ----------------------------------------------------------
@torch.no_grad()
def norm_gain(norm: nn.Module, hidden: int) -> torch.Tensor:
    """The effective per-channel gain γ of an RMS-style norm (γ, or 1 + w for Gemma):
    its output for an all-ones input (rms 1), independent of the weight convention."""
    p = next(norm.parameters())  # (on the meta device where accelerate offloaded it: its hook runs it elsewhere)
    return norm(torch.ones(1, 1, hidden, device=execution_device(norm), dtype=p.dtype)).reshape(-1).float()


def downstream_gain(dense: nn.Module, group) -> torch.Tensor:
    """γ of the norm that reads the group's target in the dense model: the input norm of
    the block after ``target_layer``, or the final norm."""
    layers = decoder_layers(dense)
    hidden = dense.config.hidden_size
    if group.final_norm or group.target_layer + 1 >= len(layers):
        return norm_gain(final_norm(dense), hidden)
    return norm_gain(input_norm(layers[group.target_layer + 1]), hidden)


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    head = model.get_output_embeddings()
    if head is None:
        raise OverRepError("the 'logit' and 'kl-topk' losses need a model with an LM head")
    return head.weight


@torch.no_grad()
def centred_gram(model: nn.Module) -> torch.Tensor:
    """``G = W_Uᵀ(I − 11ᵀ/V)W_U / V`` (d × d), so ``δᵀGδ`` is the mean over the vocabulary
    of the squared centred-logit difference."""
    w = lm_head_weight(model).double()
    v = w.shape[0]
    mu = w.mean(0, keepdim=True)
    return ((w.T @ w - v * mu.T @ mu) / v).float()


# ---- the rest of the model after a module (kl-topk) --------------------------------
class Tail:
    """The frozen part of the pruned model after a recovery module: the remaining blocks,
    the final norm (unless the module owns it) and the LM head."""

    def __init__(self, model: nn.Module, module, full_context: list[dict]):
        self.module = module  # the tail runs at the module's training precision
        layers = decoder_layers(model)
        last = module.compact_indices[-1]
        self.blocks = [(layers[i], full_context[i]) for i in range(last + 1, len(layers))]
        self.norm = None if module.norm is not None else final_norm(model)
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        with autocast(getattr(self.module, "precision", "fp32"), h.device):
            return run_to_logits(h, self.blocks, self.norm, self.head, self.softcap)

    def next_token_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of ``h`` [B, T, d] on ``labels`` [B, T] (the rows' own
        tokens), without materialising the logits (:func:`~overrep.core.linear_ce.head_cross_entropy`:
        the default run's tail, forward and backward, 1.23× faster on the family 26 EPYC in
        ``benchmarks/bench_next_token_loss.py``, and a ``ce`` step of the budgeted run 2.54 s → 1.80 s
        (docs/speed.md))."""
        with autocast(getattr(self.module, "precision", "fp32"), h.device):
            x = run_to_hidden(h, self.blocks, self.norm)
            return head_cross_entropy(x[:, :-1].flatten(0, 1), self.head, labels[:, 1:].flatten().to(x.device),
                                      self.softcap)


# ---- the losses themselves -----------------------------------------------------------
def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()


def normed_loss(pred: torch.Tensor, target: torch.Tensor, gain: torch.Tensor, lam: float,
                sink_weight: float) -> torch.Tensor:
    """Per token ``ℓ_t = mean_c (γ̃_c (ĥ/rms ĥ − h/rms h)_c)² + λ (log rms ĥ − log rms h)²``, with
    γ̃ = γ / rms(γ) (so the first term is on the scale of an MSE between unit-RMS vectors);
    the loss is the mean of ℓ_t over the ordinary tokens plus ``sink_weight`` times its mean
    over the attention sinks (:func:`~overrep.recovery.closed_form.sink_mask` on the target:
    tokens carrying massive activations; a plain mean is ``sink_weight`` = sinks / others).

    With a plain mean the one sink of a 256-token row weighed 1/256: a module could turn a
    massive activation's direction away (cosine -0.31 to the dense one, its size right) at a
    cost the loss hardly saw, and every later attention, which reads the sink, broke (test
    perplexity 4,074 against 511 unrecovered, SmolLM2 in fp32; docs/losses.md, "Attention
    sinks")."""
    rp, rt = _rms(pred), _rms(target)
    g = gain / _rms(gain)
    per_token = ((pred / rp - target / rt) * g).pow(2).mean(-1) + lam * (rp.log() - rt.log()).pow(2)[..., 0]
    sinks = sink_mask(rt[..., 0].detach())
    if not sinks.any():
        return per_token.mean()
    return per_token[~sinks].mean() + sink_weight * per_token[sinks].mean()


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return ((pred - target).pow(2) * weight).mean()


def logit_loss(pred: torch.Tensor, target: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    d = pred - target
    return ((d @ gram) * d).sum(-1).mean()


def topk_kl(logits: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, rest: bool = False) -> torch.Tensor:
    """Forward KL(p_teacher || p_student) on the teacher's top-K support.

    ``rest=False``: both distributions renormalised on the support (blind to the mass the
    student puts elsewhere). ``rest=True``: K + 1 outcomes, the support plus one bucket
    for every other token, so mass outside the support is penalised (``values`` must be
    the teacher's log-probabilities). Both equal the full KL when K = vocabulary size.
    """
    if not rest:
        log_p = F.log_softmax(values.float(), dim=-1)
        log_q = F.log_softmax(logits.gather(-1, indices.long()), dim=-1)
        return (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    log_p = values.float()
    lse = logits.logsumexp(-1, keepdim=True)
    log_q = logits.gather(-1, indices.long()) - lse
    p_rest = (1 - log_p.exp().sum(-1)).clamp_min(0)
    q_rest = (1 - log_q.exp().sum(-1)).clamp_min(1e-12)
    kl_support = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl_rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log()),
                          torch.zeros_like(p_rest))
    return (kl_support + kl_rest).mean()


# ---- the registry --------------------------------------------------------------------
@dataclass
class LossSetup:
    """What a loss may read when it prepares, once per run: the dense model, the model the
    recovery modules sit in, the modules and their plan groups, the teacher (features, its
    cache root and rows), the full layer context, the held-out rows and the options."""

    dense: nn.Module
    model: nn.Module
    modules: list
    groups: list
    teacher: object
    full_context: list[dict]
    heldout_ids: torch.Tensor
    options: LossOptions


def _none(setup: LossSetup) -> list[dict]:
    return [{} for _ in setup.modules]


@dataclass(frozen=True)
class Loss:
    """One layer-wise loss. ``compute(pred, feats, aux, options)``: the loss of a module's
    output ``pred`` [B, T, H] against its features ``feats`` (``targets`` [B, T, H] and any
    row extras) with its constants ``aux``. ``prepare(setup)``: those constants, one dict per
    module, computed once. ``rows(setup)``: per-row extras the batches carry (for the
    training rows and for the validation probe's rows), or None. ``fresh``: the loss learns
    the training text itself, so a row it sees twice is partly memorised; a time budget then
    caches enough rows for each step of it to see new ones (:func:`fresh_share`). ``live``: its
    per-row extras exist for every row of the data (the next-token loss's are the row's own
    tokens) and it reads no ``targets``, so as an ``A>B`` loss's later phase it may read rows past
    the feature cache, their ``inputs`` computed when read (:meth:`Teacher.features
    <overrep.recovery.teacher.Teacher.features>`). ``tail``: it runs the module's output through the
    rest of the pruned model (:class:`Tail`), so with ``loss_tail: once`` the first module's loss
    alone trains every module (its tail runs the later ones)."""

    name: str
    description: str
    compute: Callable[..., torch.Tensor]
    prepare: Callable[[LossSetup], list[dict]] = _none
    rows: Callable[[LossSetup], tuple[dict, dict]] | None = field(default=None)
    fresh: bool = False
    live: bool = False
    tail: bool = False


def fresh_share(spec: str, switch: float) -> float:
    """The share of a run's steps whose loss should see each training row once (``fresh``):
    the next-token phase of ``normed>ce`` seeing its rows a second time drove its training loss
    from 3.9 to 3.0 and cost the test domains 10-15% (docs/losses.md)."""
    phases = [LOSSES[name] for name in parse_loss(spec)]
    if len(phases) == 1:
        return 1.0 if phases[0].fresh else 0.0
    return switch * phases[0].fresh + (1 - switch) * phases[1].fresh


def _target(pred: torch.Tensor, feats: dict) -> torch.Tensor:
    return feats["targets"].to(pred.device).float()


def _mse(pred, feats, aux, options):
    return F.mse_loss(pred.float(), _target(pred, feats))


def _normed(pred, feats, aux, options):
    if "gain" not in aux:  # the module owns the final norm: its output is already γ ⊙ x / rms(x)
        return _mse(pred, feats, aux, options)
    return normed_loss(pred.float(), _target(pred, feats), aux["gain"], options.loss_lambda, options.loss_sinks)


def _normed_prepare(setup: LossSetup) -> list[dict]:
    return [{} if g.final_norm else {"gain": downstream_gain(setup.dense, g).to(_device(m))}
            for m, g in zip(setup.modules, setup.groups)]


def _fisher_prepare(setup: LossSetup) -> list[dict]:
    fisher = cached_fisher(setup.teacher, setup.options.fisher_sequences)
    return [{"fisher": f.to(_device(m))} for m, f in zip(setup.modules, fisher)]


def _logit_prepare(setup: LossSetup) -> list[dict]:
    gram = centred_gram(setup.dense)
    for g in setup.groups:
        if not g.final_norm:
            raise OverRepError(f"recovery.loss 'logit' needs a module that ends at the final norm; the module ending "
                               f"at block {g.target_layer} does not (use normed, fisher or kl-topk, or "
                               "recovery.final_block: true where the run ends before the final block)")
    return [{"gram": gram.to(_device(m))} for m in setup.modules]


def _kl_topk(pred, feats, aux, options):
    return topk_kl(aux["tail"](pred), feats["topk_values"].to(pred.device), feats["topk_indices"].to(pred.device),
                   rest=options.loss_topk_rest)


def _kl_topk_rows(setup: LossSetup) -> tuple[dict, dict]:
    from .teacher import PROBE_ROWS

    k, teacher = setup.options.loss_topk, setup.teacher
    if teacher.mode == "probe":  # timing only: the probe rows' top-k, cycled like their features
        values, indices = teacher_topk(setup.dense, teacher.train_ids[:PROBE_ROWS], k)
    else:
        values, indices = cached_topk(teacher, k)
    v, i = teacher_topk(setup.dense, setup.heldout_ids, k)
    return {"topk_values": values, "topk_indices": indices}, {"topk_values": v, "topk_indices": i}


def _text_ce(logits: torch.Tensor, feats: dict) -> torch.Tensor:
    """Next-token cross-entropy of ``logits`` [B, T, V] on the rows' own tokens."""
    labels = feats["labels"].to(logits.device)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _ce(pred, feats, aux, options):
    return aux["tail"].next_token_loss(pred, feats["labels"])


def _ce_rows(setup: LossSetup) -> tuple[dict, dict]:
    from .teacher import PROBE_ROWS

    teacher = setup.teacher
    # every row of the data, those past the feature cache included (Loss.live)
    train = teacher.train_ids[:PROBE_ROWS] if teacher.mode == "probe" else teacher.all_ids
    return {"labels": train}, {"labels": setup.heldout_ids}


def _ce_kl(pred, feats, aux, options):
    logits = aux["tail"](pred).float()
    ce = _text_ce(logits, feats)
    kl = topk_kl(logits, feats["topk_values"].to(pred.device), feats["topk_indices"].to(pred.device),
                 rest=options.loss_topk_rest)
    return (1 - options.loss_kd) * ce + options.loss_kd * kl


def _ce_kl_rows(setup: LossSetup) -> tuple[dict, dict]:
    (ce_train, ce_val), (kl_train, kl_val) = _ce_rows(setup), _kl_topk_rows(setup)
    rows = kl_train["topk_values"].shape[0]  # the teacher's top-K exist for the cached rows only (not live)
    return {"labels": ce_train["labels"][:rows], **kl_train}, {**ce_val, **kl_val}


def _tails(setup: LossSetup) -> list[dict]:
    return [{"tail": Tail(setup.model, m, setup.full_context)} for m in setup.modules]


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


#: Every layer-wise loss (``recovery.loss``; two joined as ``A>B``).
LOSSES: Registry[Loss] = Registry("layer-wise loss")
for _loss in [
    Loss("mse", "raw hidden-state MSE (the paper's objective)", _mse),
    Loss("normed", "RMS-normalised MSE weighted by the downstream norm's gain + lambda * log-RMS term", _normed,
         _normed_prepare),
    Loss("fisher", "MSE weighted per channel by the dense model's diagonal Fisher (cached)",
         lambda pred, feats, aux, options: weighted_mse(pred.float(), _target(pred, feats), aux["fisher"]),
         _fisher_prepare),
    Loss("logit", "centred-logit MSE through the LM head's Gram matrix (modules ending at the final norm)",
         lambda pred, feats, aux, options: logit_loss(pred.float(), _target(pred, feats), aux["gram"]),
         _logit_prepare),
    Loss("kl-topk", "KL to the dense model's cached top-K logits, through the remaining frozen blocks", _kl_topk,
         _tails, _kl_topk_rows, tail=True),
    Loss("ce", "next-token cross-entropy on the training text, through the remaining frozen blocks", _ce, _tails,
         _ce_rows, fresh=True, live=True, tail=True),
    Loss("ce+kl", "(1 - loss_kd) * ce + loss_kd * kl-topk: the text's next tokens held towards the dense model's "
         "predictions, one pass of the frozen tail", _ce_kl, _tails, _ce_kl_rows, fresh=True, tail=True),
]:
    LOSSES.register(_loss)


__all__ = ["LOSSES", "Loss", "LossSetup", "LossOptions", "parse_loss", "fresh_share", "loss_help", "normed_loss", "weighted_mse", "logit_loss", "topk_kl",
           "centred_gram", "downstream_gain", "norm_gain", "fisher_diagonal", "cached_fisher", "teacher_topk",
           "cached_topk", "Tail"]
