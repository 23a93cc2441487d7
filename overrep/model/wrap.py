"""The Overcomplete Recovery Module (ORM): wrap, run, merge.

:func:`apply_preset` turns the recovery blocks of a pruned model into their overcomplete
training form (paper, appendix "Practical Implementation": block 1 jointly trains its
pretrained weights and W/D, block 2 keeps its pretrained weights frozen and trains only
W/D). :class:`RecoveryModule` runs those blocks on cached hidden states with exactly the
masks and rotary embeddings the model itself would use (captured from one forward
pass), and :func:`merge_recovery` folds every wrapper back (``eq:reparam``) so the model
is again a plain, compact Hugging Face model. In a hybrid Mamba-attention model the
presets act on the attention and MLP projections a block has; a Mamba-2 mixer stays
frozen and takes W/D only on ``in_proj``, and only where a preset names ``in``
(:mod:`overrep.model.mamba` explains why that fold is exact).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .arch import block_parts, decoder_layers, final_norm, group_activation
from ..core.experts import OvercompleteExperts
from ..core.precision import autocast
from .presets import Preset
from ..core.projection import MergeRefused, OvercompleteLinear, ReparamNorm
from ..core.schedule import AlphaSchedule, AnnealedActivation
from .mamba import MAMBA_PROJ
from .surgery import PrunePlan, RecoveryGroup, can_stitch, plan_pruning
from .width import PRUNED_SIDE, WidthPlan, patch_width_config, set_attention_groups
from ..errors import OverRepError

WRAPPERS = (OvercompleteLinear, ReparamNorm, OvercompleteExperts)


class RecoveryModule(nn.Module):
    """The trainable recovery blocks of one :class:`RecoveryGroup` (shared with the model).

    ``forward(h [B, T, H], context) -> [B, T, H]`` where ``context[i]`` holds the keyword
    arguments (attention mask, rotary embeddings, ...) of the module's i-th block.
    ``precision`` (``fp32`` | ``bf16``, see :mod:`overrep.core.precision`) sets the autocast the
    forward runs under; the output is returned in the input's dtype.
    """

    precision: str = "fp32"

    def __init__(self, blocks: list[nn.Module], norm: nn.Module | None, activation: AnnealedActivation,
                 group: RecoveryGroup, compact_indices: list[int]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.activation = activation
        self.group = group
        self.compact_indices = compact_indices

    def forward(self, h: torch.Tensor, context: list[dict]) -> torch.Tensor:
        dtype = h.dtype
        with autocast(self.precision, h.device):
            for block, kwargs in zip(self.blocks, context):
                out = block(h, **kwargs)
                h = out[0] if isinstance(out, tuple) else out
            h = h if self.norm is None else self.norm(h)
        return h.to(dtype)


def _wrap_block(layer: nn.Module, index: int, spec, preset: Preset, act: AnnealedActivation,
                keep: dict | None = None) -> None:
    """``keep`` (width pruning): projection -> kept channels; each such projection gets a
    rectangular D on its narrowed side (:data:`overrep.model.width.PRUNED_SIDE`)."""
    parts = block_parts(layer, index)
    keep = keep or {}
    for p in layer.parameters():
        p.requires_grad_(spec.train_base)
    for part in parts.frozen:  # a Mamba-2 mixer keeps its pretrained weights (overrep.model.mamba)
        part.requires_grad_(False)
    for key, (parent, attr) in parts.projections.items():
        use_w, use_d = key in spec.w, key in spec.d
        if key in keep and not (use_d and preset.side(key) == PRUNED_SIDE[key]):
            raise OverRepError(f"preset '{preset.name}' cannot recover a width-pruned model: '{key}' needs D on "
                               f"its {PRUNED_SIDE[key]} side (use the preset 'width')")
        if use_w or use_d:
            train_base = spec.train_base and parent not in parts.frozen
            setattr(parent, attr, OvercompleteLinear(getattr(parent, attr), use_w=use_w, use_d=use_d,
                                                     side=preset.side(key), train_base=train_base,
                                                     activation=act, keep=keep.get(key)))
    if parts.experts is not None:
        parent, attr = parts.experts
        wanted = {k: (k in spec.w, k in spec.d, preset.d_side[k]) for k in ("gate", "up", "down")
                  if k in spec.w or k in spec.d}
        if wanted:
            setattr(parent, attr, OvercompleteExperts(getattr(parent, attr), wanted,
                                                      train_base=spec.train_base, activation=act))
        if parts.router is not None:  # routing is preserved exactly: never trained
            parts.router.requires_grad_(False)
    if spec.norm_reparam:
        for parent, attr in parts.norms.values():
            setattr(parent, attr, ReparamNorm(getattr(parent, attr), train_base=spec.train_base))


def recoverable_blocks(model: nn.Module, preset: Preset) -> list[bool]:
    """Per decoder block of ``model``: whether ``preset`` trains anything in it beyond its
    norms. False only for a hybrid model's Mamba-2 block (mixer kept frozen) when no block
    spec names ``in``; attention, MLP and MoE blocks always have a part that learns."""
    named = {k for spec in preset.blocks for k in spec.w + spec.d}
    learns = named or any(spec.train_base for spec in preset.blocks)
    marks = []
    for i, layer in enumerate(decoder_layers(model)):
        parts = block_parts(layer, i)
        own = [k for k in parts.projections if k not in MAMBA_PROJ]
        marks.append(bool(learns and (own or parts.experts is not None))
                     or any(k in named for k in parts.projections if k in MAMBA_PROJ))
    return marks


def plan_recovery(model: nn.Module, removed: list[int], preset: Preset, *, blocks: int | str = 2,
                  block1_init: str = "stitched", final_block: bool = True, keep: Iterable[int] = ()) -> PrunePlan:
    """:func:`~overrep.model.surgery.plan_pruning` for ``model``, final as made: each run's
    module holds ``blocks`` blocks that ``preset`` can train (:func:`recoverable_blocks`), and
    block 1 is stitched only where the blocks allow it (:func:`~overrep.model.surgery.can_stitch`)
    and it is not in ``keep`` (blocks whose weights stay as they are, e.g. a block LaCo rewrote)."""
    layers, keep = decoder_layers(model), set(keep)
    return plan_pruning(len(layers), removed, blocks=blocks, block1_init=block1_init,
                        recoverable=recoverable_blocks(model, preset), final_block=final_block,
                        stitchable=lambda target, source: target not in keep and can_stitch(layers, target, source))


def apply_preset(model: nn.Module, plan: PrunePlan | WidthPlan, preset: Preset,
                 schedule: AlphaSchedule | None = None) -> list[RecoveryModule]:
    """Freeze the pruned ``model`` and make its recovery blocks overcomplete (in place).

    For a :class:`~overrep.model.width.WidthPlan` there is one module per block. If ``model``
    is still at full width, every block is wrapped with rectangular D's that narrow it (and
    the config takes the planned widths), so it computes the width-pruned model until
    trained; an already narrowed model is wrapped as it is (presets without D).
    Returns one :class:`RecoveryModule` per group of ``plan``. With ``preset.anneal``
    the activation follows ``schedule`` (set it later with ``module.activation.set_schedule``);
    otherwise it stays the identity.
    """
    model.requires_grad_(False)
    layers = decoder_layers(model)
    modules = []
    widen = isinstance(plan, WidthPlan) and not plan.applied_to(model)
    if widen:  # full-width blocks whose D's narrow them: the model computes at the planned widths
        w = plan.widths()
        for c in plan.channels:
            set_attention_groups(layers[c], w["num_attention_heads"], w["num_key_value_heads"])
        patch_width_config(model.config, plan)
    # Every group's activation is found before any block is wrapped (a hybrid group without
    # an MLP borrows the model's, which may sit in another group's block).
    compacts = [[plan.compact_index(i) for i in group.module_layers] for group in plan.groups]
    fns = [group_activation(layers, compact) for compact in compacts]
    anneals = preset.anneal and any(spec.d for spec in preset.blocks)  # it sits between W and D: no D, no use
    for group, compact, fn in zip(plan.groups, compacts, fns):
        act = AnnealedActivation(fn, schedule, enabled=anneals)
        for i, c in enumerate(compact):
            keep = plan.keep_indices(c) if widen else None
            _wrap_block(layers[c], c, preset.block(i), preset, act, keep)
        norm = None
        if group.final_norm:
            norm = final_norm(model)
            norm.requires_grad_(preset.train_final_norm)
        modules.append(RecoveryModule([layers[c] for c in compact], norm, act, group, compact))
    return modules


def has_wrappers(model: nn.Module) -> bool:
    return any(isinstance(m, WRAPPERS) for m in model.modules())


@torch.no_grad()
def merge_recovery(model: nn.Module) -> int:
    """Fold every wrapper in ``model`` into a plain module (in place); returns how many.

    Raises :class:`MergeRefused` (before changing anything) while any annealed
    activation is not the identity.
    """
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, WRAPPERS)]
    for name, m in targets:
        act = getattr(m, "activation", None)
        if act is not None:
            act.require_identity(f"'{name}'")
    # Deepest first, so a wrapper nested in another's base is folded before its parent.
    for name, m in sorted(targets, key=lambda t: -t[0].count(".")):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, m.merge())
    return len(targets)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


__all__ = ["RecoveryModule", "apply_preset", "merge_recovery", "has_wrappers", "count_parameters", "MergeRefused"]
