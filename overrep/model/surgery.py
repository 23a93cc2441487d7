"""Model surgery: plan recovery modules, stitch block 1, remove blocks, patch the config.

Indices here are 0-based positions in the *dense* model unless a name says ``compact``.

Recovery module of a run of removed blocks ``[a, b]`` (following the reference code)::

    dense:    ... a-1 | a ... b | b+1 b+2 ...
    compact:  ... B1  |         | B2  ...        (k = 2 blocks)

Block 1 is the retained block just before the run; it absorbs the run. Its
initialisation is ``stitched`` (attention from block a-1, MLP and the block's norms
from block b, the last removed one) or ``retained`` (block a-1 as it is; also what
``stitched`` falls back to where the two blocks are not both attention + MLP blocks, as
in a hybrid Mamba-attention model whose blocks hold one part each). Blocks
2..k are the retained blocks after the run. The module learns
``h_in(a-1) -> h_out(b+k-1)`` of the dense model (``h_out(b)`` for k = 1, the single
replacement block of Streamline); when its last block is the model's
final block, the final norm joins the module and the target is the normed hidden state.
A run that starts at block 0 has no block before it: its module is the k retained
blocks after it, initialised as they are, and learns ``h_in(0) -> ...``: in the compact
model its first block receives the embeddings. Runs whose modules would share a block are
recovered together by one module spanning both.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .arch import block_parts, decoder_layers
from ..errors import OverRepError

log = logging.getLogger(__name__)


def parse_layers(spec: str | list[int] | tuple[int, ...]) -> list[int]:
    """``"21-28"``, ``"3,5,7-9"`` or a list -> sorted unique indices."""
    if isinstance(spec, (list, tuple)):
        return sorted({int(i) for i in spec})
    out: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise OverRepError(f"cannot parse layer list '{spec}': use e.g. '21-28' or '3,5,7-9'") from None
    return sorted(out)


def contiguous_runs(indices: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


AUTO_BLOCKS = "auto"


def resolve_blocks(blocks: int | str, removed: list[int]) -> int:
    """Recovery blocks per removed run: ``blocks`` itself, or for ``"auto"`` two where the mask
    removes one contiguous run and one where it removes several. Measured (docs/results-former-protocol.md):
    on a one-run mask two blocks won at 10 minutes (45.3 against 47.9 on the cosine mask); on
    Block Influence's four-run mask two-block modules merge into three large ones whose steps
    cost twice as much, and one block a module won (61.6 against 74.9; Streamline 70.0)."""
    if blocks == AUTO_BLOCKS:
        return 2 if len(contiguous_runs(removed)) == 1 else 1
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise OverRepError(f"recovery.blocks must be an integer >= 1 or 'auto', got {blocks!r}")
    return blocks


@dataclass
class RecoveryGroup:
    """One recovery module: which dense blocks it spans and how it is initialised.

    ``module_layers``: dense indices of the retained blocks forming the module, in order.
    ``runs`` is empty for width pruning's groups (one per block, nothing removed).
    ``stitch``: dense index of a block 1 -> dense index of the removed block its MLP and
    norms come from. Input: hidden state entering dense block ``input_layer``.
    Target: output of dense block ``target_layer`` (normed if ``final_norm``).
    """

    runs: list[tuple[int, int]]
    module_layers: list[int]
    target_layer: int
    final_norm: bool
    stitch: dict[int, int] = field(default_factory=dict)

    @property
    def input_layer(self) -> int:
        """The dense block whose *input* the module receives: its first block, or, for a run
        that starts at block 0, block 0 itself -- in the compact model the module's first
        block then receives the embeddings, so that is what it must be trained on."""
        return min(self.module_layers[0], self.runs[0][0]) if self.runs else self.module_layers[0]

    def to_dict(self) -> dict:
        return {"runs": [list(r) for r in self.runs], "module_layers": self.module_layers,
                "input_layer": self.input_layer,
                "target_layer": self.target_layer, "final_norm": self.final_norm,
                "stitch": {str(k): v for k, v in self.stitch.items()}}


@dataclass
class PrunePlan:
    num_layers: int
    removed: list[int]
    groups: list[RecoveryGroup]

    @property
    def kept(self) -> list[int]:
        gone = set(self.removed)
        return [i for i in range(self.num_layers) if i not in gone]

    def compact_index(self, dense_index: int) -> int:
        return self.kept.index(dense_index)

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "removed": self.removed, "kept": self.kept,
                "groups": [g.to_dict() for g in self.groups]}


def plan_pruning(num_layers: int, removed: list[int], *, blocks: int | str = 2,
                 block1_init: str = "stitched", recoverable: list[bool] | None = None,
                 final_block: bool = True, stitchable: Callable[[int, int], bool] | None = None) -> PrunePlan:
    """Validate ``removed`` and lay out the recovery module(s) for it.

    A run's module is the retained block before it (block 1) plus the blocks after it, until
    it holds ``blocks`` blocks that ``recoverable`` marks (default: every block, and then the
    module is simply ``blocks`` blocks long). In a hybrid model a block whose only mixer stays
    frozen (Mamba-2) is crossed but not counted: block 1 is the nearest block before the run
    that can learn, and the module extends past the run until ``blocks`` blocks can learn
    (see :func:`overrep.model.wrap.plan_recovery`).

    ``final_block=False`` keeps modules out of the model's final block: where a run ends just
    before it, the module stops before it too and matches the hidden state the final block
    reads, not the final norm's output (``recovery.final_block``; the paper's modules on its
    mask take the final block). A run that removes the final block itself ends there anyway.

    ``stitchable(target, source)``: whether block ``target`` can take block ``source``'s
    feed-forward part (default: always); where it cannot, block 1 is planned ``retained``.
    """
    removed = sorted(set(removed))
    if not removed:
        raise OverRepError("nothing to remove: the removal list is empty")
    bad = [i for i in removed if not 0 <= i < num_layers]
    if bad:
        raise OverRepError(f"layer index {bad[0]} is out of range: the model has {num_layers} decoder blocks "
                           f"(0-{num_layers - 1})")
    if len(removed) >= num_layers:
        raise OverRepError(f"removing {len(removed)} of {num_layers} blocks leaves no block")
    blocks = resolve_blocks(blocks, removed)
    if block1_init not in ("stitched", "retained"):
        raise OverRepError(f"recovery.block1_init must be 'stitched' or 'retained', got '{block1_init}'")
    if recoverable is None:
        recoverable = [True] * num_layers
    if len(recoverable) != num_layers:
        raise OverRepError(f"recoverable marks {len(recoverable)} blocks, the model has {num_layers}")
    gone = set(removed)
    kept = [i for i in range(num_layers) if i not in gone]

    def take(candidates: list[int], need: int) -> list[int]:
        """The shortest prefix of ``candidates`` holding ``need`` recoverable blocks."""
        out: list[int] = []
        for i in candidates:
            if need <= 0:
                break
            out.append(i)
            need -= bool(recoverable[i])
        return out

    def lead_in(before: list[int]) -> list[int]:
        """The retained blocks before a run back to the nearest one that can learn (just the
        adjacent block when none can)."""
        for k in range(len(before) - 1, -1, -1):
            if recoverable[before[k]]:
                return before[k:]
        return before[-1:]

    groups: list[RecoveryGroup] = []
    for a, b in contiguous_runs(removed):
        lead = lead_in([i for i in kept if i < a])
        after = [i for i in kept if i > b and (final_block or i != num_layers - 1)]
        layers = lead + take(after, blocks - bool(lead and recoverable[lead[0]]))
        # block 1 is stitched (the attention of the block before, the MLP of the run's last
        # block) only when it is the block right before the run
        stitch = {a - 1: b} if (block1_init == "stitched" and lead == [a - 1]
                                and (stitchable is None or stitchable(a - 1, b))) else {}
        # The module reproduces the dense model up to its last block; a module that is only
        # the block before the run (blocks=1) reproduces the run's output instead.
        target = layers[-1] if layers[-1] > b else b
        g = RecoveryGroup([(a, b)], layers, target, target == num_layers - 1, stitch)
        prev = groups[-1] if groups else None
        if prev is not None and g.input_layer <= prev.target_layer:
            # Overlapping modules: one module spans both runs.
            span = [i for i in kept if prev.input_layer <= i <= max(prev.target_layer, g.target_layer)]
            groups[-1] = RecoveryGroup(prev.runs + g.runs, span, span[-1], span[-1] == num_layers - 1,
                                       {**prev.stitch, **g.stitch})
        else:
            groups.append(g)
    return PrunePlan(num_layers, removed, groups)


def can_stitch(layers: nn.ModuleList, target: int, source: int) -> bool:
    """Whether block ``target`` can take the feed-forward part of block ``source``: both
    must hold a token mixer *and* a feed-forward part, under the same attribute. A hybrid
    model's blocks (Nemotron-H: one Mamba, attention or MLP part each) mostly cannot."""
    dst, src = block_parts(layers[target], target), block_parts(layers[source], source)
    return (dst.attention is not None and dst.mlp is not None and src.mlp is not None
            and src.attention is not None and dst.mlp_attr == src.mlp_attr)


def _stitch_block(layers: nn.ModuleList, target: int, source: int) -> None:
    """Give block ``target`` the MLP and block-level norms of block ``source`` (copies); the
    plan asked for it, so the blocks must allow it (:func:`can_stitch`)."""
    if not can_stitch(layers, target, source):
        raise OverRepError(f"the plan stitches block {target} from block {source}, which the model's blocks do not "
                           "allow (plan with overrep.model.wrap.plan_recovery, which knows the blocks)")
    dst, src = block_parts(layers[target], target), block_parts(layers[source], source)
    setattr(layers[target], src.mlp_attr, copy.deepcopy(src.mlp))
    for name, (parent, attr) in src.norms.items():
        if "." in name:  # norms inside attention (q_norm, k_norm) stay with the attention
            continue
        if name not in dst.norms:
            raise OverRepError(f"cannot stitch block {target} from block {source}: norm '{name}' missing")
        setattr(layers[target], attr, copy.deepcopy(getattr(parent, attr)))


# Config fields holding one entry per layer, besides any list of exactly num_hidden_layers.
_PER_LAYER_FIELDS = ("layer_types", "no_rope_layers", "layers_block_type")
# Lists that can have num_hidden_layers entries by chance but are not per layer.
_NOT_PER_LAYER = ("mlp_only_layers", "mtp_layers_block_type")


def _per_layer(name: str, value, n_old: int) -> bool:
    """A per-layer list, or a per-layer pattern string (one character per layer, e.g. a
    hybrid's ``hybrid_override_pattern`` ``"M*-M-*"``)."""
    if name in _NOT_PER_LAYER:
        return False
    if isinstance(value, str):
        return "pattern" in name and len(value) == n_old
    return isinstance(value, (list, tuple)) and len(value) == n_old and (
        name in _PER_LAYER_FIELDS or all(isinstance(v, (str, bool, int)) for v in value))


def _is_layer_index_list(name: str, value) -> bool:
    """A list of layer *indices* (Bamba's ``attn_layer_indices``): renumbered, not sliced."""
    return name.endswith("_layer_indices") and isinstance(value, (list, tuple)) and all(
        isinstance(v, int) for v in value)


def _patch_config(config, kept: list[int]) -> None:
    n_old = config.num_hidden_layers
    for name, value in list(vars(config).items()):
        if _is_layer_index_list(name, value):
            setattr(config, name, type(value)(kept.index(i) for i in value if i in kept))
        elif _per_layer(name, value, n_old):
            sliced = [value[i] for i in kept]
            setattr(config, name, "".join(sliced) if isinstance(value, str) else type(value)(sliced))
    if getattr(config, "num_experts", 0) and hasattr(config, "decoder_sparse_step"):
        # Qwen-MoE decides per layer index which blocks are sparse; renumbering would flip
        # them on reload, so the dense ones are listed explicitly.
        step, only = config.decoder_sparse_step, set(config.mlp_only_layers or [])
        dense = [j for j, i in enumerate(kept) if i in only or (i + 1) % step != 0]
        config.mlp_only_layers = dense
        config.decoder_sparse_step = 1
    # Some configs (Nemotron-H) derive the depth from the per-layer types and ignore this.
    config.num_hidden_layers = len(kept)


def remove_layers(model: nn.Module, removed: list[int]) -> nn.Module:
    """Delete decoder blocks in place; renumber ``layer_idx`` and patch the config.

    After this, ``save_pretrained`` -> ``AutoModelForCausalLM.from_pretrained`` rebuilds
    the same compact model.
    """
    layers = decoder_layers(model)
    gone = set(removed)
    kept = [i for i in range(len(layers)) if i not in gone]
    new_layers = nn.ModuleList([layers[i] for i in kept])
    for j, layer in enumerate(new_layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = j
    model.model.layers = new_layers
    _patch_config(model.config, kept)
    return model


def prune(model: nn.Module, plan: PrunePlan) -> nn.Module:
    """Stitch the recovery blocks as planned, then remove the planned blocks (in place)."""
    layers = decoder_layers(model)
    if len(layers) != plan.num_layers:
        raise OverRepError(f"plan is for {plan.num_layers} blocks but the model has {len(layers)}")
    for g in plan.groups:
        for target, source in g.stitch.items():
            _stitch_block(layers, target, source)
    remove_layers(model, plan.removed)
    log.info("removed %d of %d blocks: %s", len(plan.removed), plan.num_layers, plan.removed)
    return model
