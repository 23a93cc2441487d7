"""Recovery methods: OverRep and the baselines it is compared with, behind one interface.

Every method starts from the same pruned model (built by the pipeline from one plan),
trains with the same :class:`~overrep.recovery.trainer.Trainer` (AdamW, cosine schedule, clipping,
checkpoints, exact resume) and ends as the same kind of output: a plain, compact Hugging
Face model. A method only decides *what* trains and *which* objective it minimises.

=============  ===============================================  ======================
method         what trains                                      objective
=============  ===============================================  ======================
overrep        recovery blocks, overcomplete (``recovery.preset``)  layer-wise (``recovery.loss``)
plain          the same recovery blocks without W, D, annealing     layer-wise (``recovery.loss``)
streamline     one block replaces the removed run (all weights)     layer-wise (``recovery.loss``)
lora           PEFT LoRA on every projection of every block          language modelling
adalora        PEFT AdaLoRA (rank re-allocated every step)           language modelling
lora-iso       LoRA whose rank matches OverRep's trainable count     language modelling
full-ft        every retained block, all weights                     language modelling
logit-kd       every retained block, all weights                     KL to dense logits
overrep-kd     OverRep's recovery blocks                             KL to dense logits
=============  ===============================================  ======================

Streamline (Chen et al., 2024) replaces the pruned run with one trained layer; here that
layer is the retained block just before the run, trained on the run's input -> output
mapping, so its compact model has exactly the size of every other method's (the
original inserts an extra layer). LoRA defaults follow the paper's Table
``tab:post-train-config`` (r=16, alpha=32); AdaLoRA starts at rank 2r and is steered to
an average of r (twice LoRA's trainable parameters at the start, as in the paper's
Table ``tab:runtime``), with ``update_and_allocate`` called after every optimiser step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import OverRepError
from ..registry import Registry
from ..model.arch import block_parts, decoder_layers
from ..model.hooks import capture_layer_context, module_context
from ..model.presets import get_preset
from ..model.wrap import apply_preset, merge_recovery
from .losses import (Tail, cached_fisher, cached_topk, centred_gram, downstream_gain, module_phases,
                     teacher_topk)
from .objectives import (Layerwise, LanguageModeling, LogitDistillation, Objective, pretrained_matrix_ids,
                         unique_trainable)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    family: str  # "layerwise" (cached features) | "adapter" (PEFT) | "full" (whole blocks) | "overcomplete-kd"
    objective: str  # "mse" | "lm" | "kd"
    default_lr: float
    preset: str | None = None  # forced preset (None: recovery.preset)
    blocks: int | None = None  # forced recovery blocks per run (None: recovery.blocks)


#: Every recovery method: registering a Method here is the one edit that makes it known
#: (``recovery.method`` validation, ``overrep methods``, ``overrep compare``).
METHODS: Registry[Method] = Registry("recovery method")
for _m in [
    Method("overrep", "OverRep: overcomplete recovery blocks, layer-wise loss (recovery.loss), folded back exactly",
           "layerwise", "mse", 1e-3),
    Method("plain", "the same recovery blocks and layer-wise loss without W, D or annealing", "layerwise", "mse",
           1e-3, preset="plain"),
    Method("streamline", "Streamline: one block (all weights) trained to replace the removed run",
           "layerwise", "mse", 1e-3, preset="plain-full", blocks=1),
    Method("lora", "PEFT LoRA on all projections, language-model loss, merged", "adapter", "lm", 1e-3),
    Method("adalora", "PEFT AdaLoRA, rank re-allocated every step, language-model loss, merged",
           "adapter", "lm", 1e-3),
    Method("lora-iso", "LoRA with the rank that matches OverRep's trainable parameters", "adapter", "lm", 1e-3),
    Method("full-ft", "full fine-tuning of every retained block, language-model loss", "full", "lm", 1e-4),
    Method("logit-kd", "every retained block trained on forward KL to the dense model's logits (tau=1)",
           "full", "kd", 1e-4),
    Method("overrep-kd", "OverRep's parameterisation trained with the logit-KD objective",
           "overcomplete-kd", "kd", 1e-3),
]:
    METHODS.register(_m)


def get_method(name: str) -> Method:
    return METHODS[name]


# ---- shared helpers -----------------------------------------------------------------
def projection_names(model: nn.Module) -> list[str]:
    """Fully qualified names of every dense projection (q..down) in every block."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        for parent, attr in block_parts(layer, i).projections.values():
            out.append(names[id(getattr(parent, attr))])
    if not out:
        raise OverRepError("no dense projections found to attach adapters to (fused-expert MoE blocks are not "
                           "supported by the PEFT baselines)")
    return out


def lora_params_per_rank(model: nn.Module) -> int:
    """Trainable parameters one unit of LoRA rank adds across all projections."""
    total = 0
    for name in projection_names(model):
        m = model.get_submodule(name)
        total += m.in_features + m.out_features
    return total


def iso_rank(model: nn.Module, target_params: int) -> int:
    return max(1, int(round(target_params / lora_params_per_rank(model))))


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    was = model.training
    model.eval()
    out = model(input_ids=ids.to(next(model.parameters()).device), use_cache=False).logits.float()
    model.train(was)
    return out


def _check_fold(before: torch.Tensor, after: torch.Tensor, what: str, dtype: torch.dtype) -> dict:
    """The merge guarantee: the folded model computes what training optimised.

    ``before`` is the trained function's output (at the alpha of the last training step),
    ``after`` the merged model's. Tolerance: 1e-5 relative to the output scale, or a few
    rounding steps of a low-precision ``dtype``.
    """
    diff = (after.double() - before.double()).abs().max().item()
    scale = before.abs().max().item()
    tol = max(1e-5, 16 * torch.finfo(dtype).eps) * max(scale, 1e-6)
    if not diff <= tol:
        raise OverRepError(f"{what} check failed: the merged model differs from the trained one by {diff:.3g} "
                           f"(output scale {scale:.3g}, tolerance {tol:.3g})")
    return {"merge_max_abs_diff": diff, "merge_max_rel_diff": diff / scale if scale else 0.0}


def _at_last_trained_step(activations) -> None:
    """Put every annealed activation back at the alpha the last training step used: the
    function the merge must reproduce (the schedule ends every run with alpha = 0)."""
    for a in activations:
        if a.schedule is not None:
            a.set_step(a.schedule.total_steps - 1)


# ---- recoveries ---------------------------------------------------------------------
class Recovery:
    """A method set up on a pipeline's pruned model: an objective to train, then ``finish``."""

    objective: Objective

    def __init__(self, pipe, method: Method):
        self.pipe, self.method = pipe, method

    @property
    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.objective.parameters())

    def finish(self) -> dict:
        """Fold whatever training added back into ``pipe.pruned`` (a compact HF model)."""
        return {}

    def describe(self) -> dict:
        return {"method": self.method.name, "objective": self.method.objective, "family": self.method.family}


class LayerwiseRecovery(Recovery):
    """OverRep, Plain and Streamline: recovery modules on teacher features."""

    def __init__(self, pipe, method: Method, *, with_data: bool = True):
        super().__init__(pipe, method)
        self.preset = get_preset(method.preset or pipe.cfg.recovery.preset)
        self.modules = apply_preset(pipe.pruned, pipe.plan, self.preset)
        for m in self.modules:
            m.precision = pipe.cfg.recovery.precision
        full_ctx = capture_layer_context(pipe.pruned, pipe.cfg.data.seq_len)
        self.contexts = [module_context(full_ctx, m) for m in self.modules]
        self.val_probe = pipe.teacher_batch(pipe.heldout_ids[:16])
        r = pipe.cfg.recovery
        self.loss = r.loss
        per_module = [module_phases(r.loss, g.final_norm) for g in pipe.plan.groups]
        phases = sorted({p for ph in per_module for p in ph})
        aux = self.loss_constants(pipe, per_module, full_ctx) if with_data else None
        source = pipe.features() if with_data else None
        if with_data and "kl-topk" in phases:
            values, indices = cached_topk(pipe)
            source = _with_topk(source, values, indices)
            v, i = teacher_topk(pipe.dense, pipe.heldout_ids[:16], r.loss_topk)
            self.val_probe = [{**f, "topk_values": v, "topk_indices": i} for f in self.val_probe]
        n_ppl = getattr(r, "val_ppl_sequences", 8)
        self.objective = Layerwise(self.modules, self.contexts, source, self.val_probe, loss=r.loss, aux=aux,
                                   lam=r.loss_lambda, switch=r.loss_switch, total_steps=pipe.total_steps,
                                   ppl_model=pipe.pruned if n_ppl else None,
                                   ppl_ids=pipe.heldout_ids[:n_ppl] if n_ppl else None,
                                   topk_rest=r.loss_topk_rest)

    def loss_constants(self, pipe, per_module: list[list[str]], full_ctx: list[dict]) -> list[dict]:
        """Per module, what its loss needs besides the features (see :mod:`overrep.losses`)."""
        aux: list[dict] = [{} for _ in self.modules]
        every = {p for ph in per_module for p in ph}
        fisher = cached_fisher(pipe) if "fisher" in every else None
        gram = centred_gram(pipe.dense) if "logit" in every else None
        for i, (m, g, phases) in enumerate(zip(self.modules, pipe.plan.groups, per_module)):
            device = next(m.parameters()).device
            if "normed" in phases and not g.final_norm:
                aux[i]["gain"] = downstream_gain(pipe.dense, g).to(device)
            if "fisher" in phases:
                aux[i]["fisher"] = fisher[i].to(device)
            if "logit" in phases:
                if not g.final_norm:
                    raise OverRepError(f"recovery.loss 'logit' needs a module that ends at the final norm; the "
                                       f"module ending at block {g.target_layer} does not (use normed, fisher or "
                                       "kl-topk)")
                aux[i]["gram"] = gram.to(device)
            if "kl-topk" in phases:
                aux[i]["tail"] = Tail(pipe.pruned, m, full_ctx)
        return aux

    @torch.no_grad()
    def finish(self) -> dict:
        _at_last_trained_step(self.objective.activations)
        probe = [{k: v[:4] for k, v in f.items()} for f in self.val_probe]

        def outputs(precision: str) -> torch.Tensor:
            for m in self.modules:
                m.precision = precision
            return torch.cat([m(f["inputs"], c).flatten() for m, f, c in zip(self.modules, probe, self.contexts)])

        trained = self.pipe.cfg.recovery.precision
        low = outputs(trained) if trained != "fp32" else None
        before = outputs("fp32")  # the trained function, evaluated as the merged model will be
        merged = merge_recovery(self.pipe.pruned)
        out = _check_fold(before, outputs("fp32"), "merge", self.pipe.pruned.dtype)
        if low is not None:  # how far the bf16 training forward sits from that function
            out["train_precision_max_rel_diff"] = (low - before).abs().max().item() / before.abs().max().item()
        return {"merged_wrappers": merged, **out}

    def describe(self) -> dict:
        return {**super().describe(), "preset": self.preset.to_dict(), "loss": self.loss}


def _with_topk(source, values: torch.Tensor, indices: torch.Tensor):
    def wrapped(idx):
        batch = source(idx)
        v, i = values[idx], indices[idx]
        return [{**f, "topk_values": v, "topk_indices": i} for f in batch]
    return wrapped


class OvercompleteKDRecovery(Recovery):
    """OverRep's recovery blocks trained end to end on the logit-KD objective."""

    def __init__(self, pipe, method: Method):
        super().__init__(pipe, method)
        self.preset = get_preset(method.preset or pipe.cfg.recovery.preset)
        self.modules = apply_preset(pipe.pruned, pipe.plan, self.preset)
        params = unique_trainable(self.modules)
        self.objective = LogitDistillation(pipe.pruned, pipe.dense, pipe.train_ids, pipe.heldout_ids[:8],
                                           params=params, activations=[m.activation for m in self.modules],
                                           decayed=set().union(*(pretrained_matrix_ids(m) for m in self.modules)),
                                           tau=pipe.cfg.recovery.kd_tau)

    def finish(self) -> dict:
        _at_last_trained_step(self.objective.activations)
        probe = self.pipe.heldout_ids[:2]
        before = _logits(self.pipe.pruned, probe)
        merged = merge_recovery(self.pipe.pruned)
        return {"merged_wrappers": merged,
                **_check_fold(before, _logits(self.pipe.pruned, probe), "merge", self.pipe.pruned.dtype)}

    def describe(self) -> dict:
        return {**super().describe(), "preset": self.preset.to_dict()}


class FullRecovery(Recovery):
    """Every retained block trainable (embeddings, head and final norm frozen)."""

    def __init__(self, pipe, method: Method):
        super().__init__(pipe, method)
        model = pipe.pruned
        model.requires_grad_(False)
        for layer in decoder_layers(model):
            layer.requires_grad_(True)
        if method.objective == "lm":
            self.objective = LanguageModeling(model, pipe.train_ids, pipe.heldout_ids[:8])
        else:
            self.objective = LogitDistillation(model, pipe.dense, pipe.train_ids, pipe.heldout_ids[:8],
                                               tau=pipe.cfg.recovery.kd_tau)


class AdaLoraLanguageModeling(LanguageModeling):
    """Language modelling plus AdaLoRA's rank allocation after every optimiser step.

    The allocator's importance statistics and the current rank pattern are training
    state, so a resumed run allocates exactly as an unbroken one.
    """

    def after_optimizer_step(self, step: int) -> None:
        self.model.base_model.update_and_allocate(step)

    def extra_state(self) -> dict:
        alloc = self.model.base_model.rankallocator
        return {"ipt": alloc.ipt, "exp_avg_ipt": alloc.exp_avg_ipt, "exp_avg_unc": alloc.exp_avg_unc,
                "rank_pattern": self.model.peft_config["default"].rank_pattern}

    def load_extra_state(self, state: dict) -> None:
        if state:
            alloc = self.model.base_model.rankallocator
            alloc.ipt, alloc.exp_avg_ipt, alloc.exp_avg_unc = state["ipt"], state["exp_avg_ipt"], state["exp_avg_unc"]
            self.model.peft_config["default"].rank_pattern = state["rank_pattern"]


class AdapterRecovery(Recovery):
    """LoRA / AdaLoRA / iso-parameter LoRA through PEFT, merged into the weights at the end."""

    def __init__(self, pipe, method: Method):
        super().__init__(pipe, method)
        from peft import AdaLoraConfig, LoraConfig, get_peft_model

        r = pipe.cfg.recovery
        model = pipe.pruned
        targets = projection_names(model)
        rank, alpha = r.lora_rank, r.lora_alpha
        if method.name == "lora-iso":
            target = pipe.overrep_trainable_params()
            rank = iso_rank(model, target)
            alpha = rank * r.lora_alpha / r.lora_rank  # keep LoRA's scaling alpha / r
            self.iso_target = target
        if method.name == "adalora":
            total = pipe.total_steps
            tinit, tfinal = int(0.1 * total), int(0.3 * total)
            if tinit >= total - tfinal:
                raise OverRepError(f"AdaLoRA needs more optimiser steps to allocate ranks (got {total})")
            config = AdaLoraConfig(init_r=2 * rank, target_r=rank, lora_alpha=alpha, lora_dropout=r.lora_dropout,
                                   target_modules=targets, tinit=tinit, tfinal=tfinal, deltaT=1,
                                   total_step=total, task_type="CAUSAL_LM")
        else:
            config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=r.lora_dropout, target_modules=targets,
                                task_type="CAUSAL_LM")
        self.rank, self.alpha = rank, alpha
        self.peft_model = get_peft_model(model, config)
        # adapters start at (or near) zero: no weight decay
        objective = AdaLoraLanguageModeling if method.name == "adalora" else LanguageModeling
        self.objective = objective(self.peft_model, pipe.train_ids, pipe.heldout_ids[:8], decayed=set())

    def ranks(self) -> dict[str, int]:
        """Current rank of every adapted projection (AdaLoRA: after allocation)."""
        pattern = getattr(self.peft_model.peft_config["default"], "rank_pattern", None)
        if self.method.name == "adalora" and pattern:
            return {k: int(sum(v)) for k, v in pattern.items()}
        return {}

    def finish(self) -> dict:
        probe = self.pipe.heldout_ids[:2]
        before = _logits(self.peft_model, probe)
        ranks = self.ranks()
        self.pipe.pruned = self.peft_model.merge_and_unload()
        out = _check_fold(before, _logits(self.pipe.pruned, probe), "adapter merge", self.pipe.pruned.dtype)
        if ranks:
            out["adalora_ranks"] = {"min": min(ranks.values()), "max": max(ranks.values()),
                                    "mean": sum(ranks.values()) / len(ranks)}
        return out

    def describe(self) -> dict:
        d = {**super().describe(), "lora_rank": self.rank, "lora_alpha": self.alpha}
        if hasattr(self, "iso_target"):
            d["iso_target_params"] = self.iso_target
        return d


def build_recovery(pipe, method: Method, *, with_data: bool = True) -> Recovery:
    if method.family == "layerwise":
        return LayerwiseRecovery(pipe, method, with_data=with_data)
    if method.family == "overcomplete-kd":
        return OvercompleteKDRecovery(pipe, method)
    if method.family == "adapter":
        return AdapterRecovery(pipe, method)
    return FullRecovery(pipe, method)


__all__ = ["METHODS", "Method", "get_method", "build_recovery", "Recovery", "iso_rank", "lora_params_per_rank",
           "projection_names"]
