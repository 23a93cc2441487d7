"""LoRA, AdaLoRA and iso-parameter LoRA through PEFT, trained on the language-model loss
and merged into the weights at the end.

LoRA defaults follow the paper's Table ``tab:post-train-config`` (r=16, alpha=32); AdaLoRA
starts at rank 2r and is steered to an average of r (twice LoRA's trainable parameters at
the start, as in the paper's Table ``tab:runtime``), with ``update_and_allocate`` called
after every optimiser step; ``lora-iso`` picks the rank whose trainable count matches
OverRep's on the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import OverRepError
from ...model.accounting import recovery_account
from ...model.arch import block_parts, decoder_layers
from ..objectives import LanguageModeling
from ..teacher import MethodInputs
from .base import Method, MethodRun, check_fold, logits_of


@dataclass
class LoraOptions:
    """``recovery`` options of the PEFT adapters (lora, adalora, lora-iso, rankadaptor)."""

    lora_rank: int = 16  # lora / adalora: rank r (adalora starts at 2r and allocates down to an average of r)
    lora_alpha: float = 32.0  # lora / adalora: scaling alpha (lora-iso keeps alpha / r)
    lora_dropout: float = 0.05  # lora / adalora: dropout on the adapter input

    def check_lora(self) -> None:
        if self.lora_rank < 1:
            raise OverRepError(f"recovery.lora_rank must be >= 1, got {self.lora_rank}")


def projections_by_block(model: nn.Module) -> list[list[str]]:
    """Fully qualified names of the dense projections (q..down) of each block, in block order
    (a block without any, e.g. a Mamba-2 mixer's, has an empty list)."""
    names = {id(m): n for n, m in model.named_modules()}
    return [[names[id(getattr(parent, attr))] for parent, attr in block_parts(layer, i).projections.values()]
            for i, layer in enumerate(decoder_layers(model))]


#: adapters on models up to this size are merged and checked in float64 (see AdapterRun.finish)
EXACT_MERGE_MAX_PARAMS = 2_000_000_000


def projection_names(model: nn.Module) -> list[str]:
    """Fully qualified names of every dense projection (q..down) in every block."""
    out = [name for block in projections_by_block(model) for name in block]
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


def lora_config(r, targets: list[str], rank: int, alpha: float, **patterns):
    """PEFT's LoraConfig from the ``recovery`` section ``r``; ``patterns``: ``rank_pattern`` /
    ``alpha_pattern`` (regular expressions matched against module names -> rank / alpha)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=r.lora_dropout, target_modules=targets,
                      task_type="CAUSAL_LM", **patterns)


class AdaLoraLanguageModeling(LanguageModeling):
    """Language modelling plus AdaLoRA's rank allocation after every optimiser step.

    The allocator's importance statistics and the current rank pattern are training
    state, so a resumed run allocates exactly as an unbroken one. Its allocation schedule
    is fixed to the step count when PEFT builds it, so a budget does not re-fit it.
    """

    retargetable = False
    fused_loss = False  # PEFT adds the orthogonality penalty to the loss the model computes

    def after_optimizer_step(self, step: int) -> None:
        self.model.base_model.update_and_allocate(step)

    def extra_state(self) -> dict:
        alloc = self.model.base_model.rankallocator
        return {"ipt": alloc.ipt, "exp_avg_ipt": alloc.exp_avg_ipt, "exp_avg_unc": alloc.exp_avg_unc,
                "rank_pattern": self.model.peft_config["default"].rank_pattern}

    def load_extra_state(self, state: dict) -> None:
        if state:
            alloc = self.model.base_model.rankallocator
            device = next(self.model.parameters()).device  # a checkpoint is loaded onto the CPU
            alloc.ipt, alloc.exp_avg_ipt, alloc.exp_avg_unc = (
                {k: v.to(device) for k, v in state[name].items()} for name in ("ipt", "exp_avg_ipt", "exp_avg_unc"))
            self.model.peft_config["default"].rank_pattern = state["rank_pattern"]


class AdapterRun(MethodRun):
    """A PEFT adapter on every projection of every retained block, merged at the end."""

    #: the language-model objective that trains the adapters
    objective_class = LanguageModeling

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        from peft import get_peft_model

        r = inputs.config
        model = inputs.pruned
        targets = projection_names(model)
        self.rank, self.alpha = self.rank_and_alpha(r.lora_rank, r.lora_alpha)
        self.peft_model = get_peft_model(model, self.adapter_config(targets, self.rank, self.alpha))
        # adapters start at (or near) zero: no weight decay
        self.objective = self.objective_class(self.peft_model, inputs.train_ids, inputs.val_ids, decayed=set(),
                                              precision=r.precision)

    def rank_and_alpha(self, rank: int, alpha: float) -> tuple[int, float]:
        """The rank and scaling the adapters get (``recovery.lora_rank`` / ``lora_alpha``)."""
        return rank, alpha

    def adapter_config(self, targets: list[str], rank: int, alpha: float):
        """PEFT's configuration of the adapters on ``targets``."""
        return self.lora_config(targets, rank, alpha)

    def lora_config(self, targets: list[str], rank: int, alpha: float):
        """The LoraConfig of ``lora`` and ``lora-iso`` (a subclass may give projections ranks of their own)."""
        return lora_config(self.inputs.config, targets, rank, alpha)

    def ranks(self) -> dict[str, int]:
        """Current rank of every adapted projection where an allocation changes it (AdaLoRA)."""
        return {}

    def finish(self) -> dict:
        """Merge the adapters (PEFT ``merge_and_unload``) and check the merge.

        The check runs in float64 where the model is small enough (``EXACT_MERGE_MAX_PARAMS``):
        the trained function and the merged model are both evaluated in float64, so the check
        sees the merge's algebra, not fp32 rounding that an ill-conditioned pruned network
        amplifies (a magnitude width-pruned SmolLM2 turned PEFT's fp32 rounding of W + s·BA into
        6e-4 of its logit scale). The merged weights are then rounded once to the model's dtype;
        how far that model's logits are from the trained fp32 function is reported as
        ``merge_rounding_max_abs_diff``, not checked. Larger models are checked in their own
        dtype at 1e-4 relative."""
        probe = self.inputs.heldout_ids[:2]
        dtype = next(self.peft_model.parameters()).dtype
        before_native = logits_of(self.peft_model, probe)
        ranks = self.ranks()
        exact = sum(p.numel() for p in self.peft_model.parameters()) <= EXACT_MERGE_MAX_PARAMS
        if exact:
            try:
                self.peft_model.double()
                before = logits_of(self.peft_model, probe)
            except RuntimeError:  # a kernel without float64 (e.g. flash attention): the model's dtype
                self.peft_model.to(dtype)
                exact = False
        self.model = self.peft_model.merge_and_unload()
        if exact:
            out = check_fold(before, logits_of(self.model, probe), "adapter merge", torch.float64)
            self.model.to(dtype)
            out["merge_rounding_max_abs_diff"] = (logits_of(self.model, probe) - before_native).abs().max().item()
        else:
            out = check_fold(before_native, logits_of(self.model, probe), "adapter merge", dtype, rel=1e-4)
        if ranks:
            out["adalora_ranks"] = {"min": min(ranks.values()), "max": max(ranks.values()),
                                    "mean": sum(ranks.values()) / len(ranks)}
        return out

    def describe(self) -> dict:
        d = {**super().describe(), "lora_rank": self.rank, "lora_alpha": self.alpha}
        if hasattr(self, "iso_target"):
            d["iso_target_params"] = self.iso_target
        return d


class IsoLoraRun(AdapterRun):
    """LoRA whose rank gives it OverRep's trainable parameter count on the same plan."""

    def rank_and_alpha(self, rank: int, alpha: float) -> tuple[int, float]:
        r = self.inputs.config
        target = recovery_account(self.inputs.dense.config, self.inputs.plan.removed, r.preset, blocks=r.blocks,
                                  block1_init=r.block1_init, final_block=r.final_block)["trainable_params"]
        self.iso_target = target
        iso = iso_rank(self.inputs.pruned, target)
        return iso, iso * alpha / rank  # keep LoRA's scaling alpha / r


class AdaLoraRun(AdapterRun):
    """AdaLoRA: starts at rank 2r, allocated down to an average of r after every step."""

    objective_class = AdaLoraLanguageModeling

    def adapter_config(self, targets: list[str], rank: int, alpha: float):
        from peft import AdaLoraConfig

        total = self.inputs.total_steps
        tinit, tfinal = int(0.1 * total), int(0.3 * total)
        if tinit >= total - tfinal:
            raise OverRepError(f"AdaLoRA needs more optimiser steps to allocate ranks (got {total})")
        return AdaLoraConfig(init_r=2 * rank, target_r=rank, lora_alpha=alpha,
                             lora_dropout=self.inputs.config.lora_dropout, target_modules=targets, tinit=tinit,
                             tfinal=tfinal, deltaT=1, total_step=total, task_type="CAUSAL_LM")

    def ranks(self) -> dict[str, int]:
        pattern = getattr(self.peft_model.peft_config["default"], "rank_pattern", None)
        return {k: int(sum(v)) for k, v in pattern.items()} if pattern else {}
