"""Width (channel-wise) pruning: which channels of each block survive, and the surgery.

A :class:`WidthPlan` keeps, in every decoder block, a subset of

* the MLP's intermediate channels -- rows of ``gate`` and ``up`` and the matching columns
  of ``down``, pruned together; and
* the attention heads -- rows of ``q`` (head by head) and the matching columns of ``o``;
  with grouped-query attention every key/value group keeps the same number of query
  heads, so the grouping stays valid; when each group has a single query head (plain
  multi-head attention) whole groups go (their ``k`` and ``v`` rows too).

The head dimension never changes, so rotary embeddings and per-head norms (``q_norm``,
``k_norm``) are untouched. Every block keeps the same widths, which a standard config
expresses (``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, and
``head_dim`` written out explicitly): the pruned model saves and reloads as a plain
Hugging Face folder.

The plan's :attr:`~WidthPlan.groups` has one recovery group per block (input: the dense
block's input, target: its output), so the layer-wise machinery of block pruning (teacher
features, losses, recovery modules) applies to width pruning unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .arch import block_parts, decoder_layers
from .surgery import RecoveryGroup
from ..errors import OverRepError

#: the side of each projection that width pruning narrows (where a rectangular D sits)
PRUNED_SIDE = {"q": "output", "k": "output", "v": "output", "o": "input",
               "gate": "output", "up": "output", "down": "input"}


@dataclass
class WidthPlan:
    """Kept channels per block (dense indices). ``heads[i]``: kept query heads of block i;
    ``kv_heads[i]``: kept key/value heads; ``channels[i]``: kept MLP intermediate channels."""

    num_layers: int
    head_dim: int
    heads: dict[int, list[int]]
    kv_heads: dict[int, list[int]]
    channels: dict[int, list[int]]
    criterion: str = "explicit"

    def __post_init__(self) -> None:
        sizes = {(len(self.heads[i]), len(self.kv_heads[i]), len(self.channels[i])) for i in self.channels}
        if sorted(self.channels) != self.kept or set(self.heads) != set(self.channels) or len(sizes) != 1:
            raise OverRepError("a width plan must give every block the same widths (a standard config cannot "
                               "express per-block widths)")

    # -- the interface block pruning's plan offers (nothing is removed) --
    removed: tuple = ()

    @property
    def kept(self) -> list[int]:
        return list(range(self.num_layers))

    def compact_index(self, dense_index: int) -> int:
        return dense_index

    @property
    def groups(self) -> list[RecoveryGroup]:
        """One recovery group per pruned block: its own dense input -> output."""
        return [RecoveryGroup([], [i], i, False) for i in sorted(self.channels)]

    def widths(self) -> dict:
        i = min(self.channels)
        return {"intermediate_size": len(self.channels[i]), "num_attention_heads": len(self.heads[i]),
                "num_key_value_heads": len(self.kv_heads[i]), "head_dim": self.head_dim}

    def applied_to(self, model: nn.Module) -> bool:
        """Whether ``model`` is already at the planned widths (sliced, or wrapped for them)."""
        c, w = model.config, self.widths()
        return all(getattr(c, k, None) == v for k, v in w.items())

    def keep_indices(self, layer: int) -> dict[str, torch.Tensor]:
        """Projection key -> kept indices on its :data:`PRUNED_SIDE` (rows of q/k/v/gate/up,
        columns of o/down)."""
        hd = self.head_dim

        def rows(heads: list[int]) -> torch.Tensor:
            return torch.tensor([h * hd + j for h in heads for j in range(hd)], dtype=torch.long)

        q, kv = rows(self.heads[layer]), rows(self.kv_heads[layer])
        mlp = torch.tensor(self.channels[layer], dtype=torch.long)
        return {"q": q, "k": kv, "v": kv, "o": q, "gate": mlp, "up": mlp, "down": mlp}

    def to_dict(self) -> dict:
        return {"granularity": "width", "num_layers": self.num_layers, "criterion": self.criterion,
                "widths": self.widths(), "head_dim": self.head_dim,
                "heads": {str(k): v for k, v in self.heads.items()},
                "kv_heads": {str(k): v for k, v in self.kv_heads.items()},
                "channels": {str(k): v for k, v in self.channels.items()}}


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head_dim)`` of the model, from its config."""
    c = model.config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return heads, kv, head_dim


def check_width_supported(model: nn.Module) -> None:
    for i, layer in enumerate(decoder_layers(model)):
        parts = block_parts(layer, i)
        if parts.experts is not None:
            raise OverRepError(f"width pruning of mixture-of-experts blocks is not supported (block {i} has fused "
                               "experts); prune whole blocks instead (--prune blocks)")


def set_attention_groups(layer: nn.Module, heads: int, kv_heads: int) -> None:
    """Tell a block's attention how many query heads share a key/value head now."""
    attn = block_parts(layer).attention
    attn.num_key_value_groups = heads // kv_heads
    for name, value in (("num_heads", heads), ("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if hasattr(attn, name):
            setattr(attn, name, value)


def patch_width_config(config, plan: WidthPlan) -> None:
    w = plan.widths()
    config.head_dim = w["head_dim"]  # written out: the default (hidden / heads) would change with the heads
    config.num_attention_heads = w["num_attention_heads"]
    config.num_key_value_heads = w["num_key_value_heads"]
    config.intermediate_size = w["intermediate_size"]


def _narrow(linear: nn.Linear, keep: torch.Tensor, side: str) -> nn.Linear:
    w = linear.weight.detach()
    keep = keep.to(w.device)
    out = nn.Linear(len(keep) if side == "input" else w.shape[1], len(keep) if side == "output" else w.shape[0],
                    bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w.index_select(0 if side == "output" else 1, keep))
        if linear.bias is not None:
            out.bias.copy_(linear.bias[keep] if side == "output" else linear.bias)
    return out


def slice_width(model: nn.Module, plan: WidthPlan) -> nn.Module:
    """Narrow every planned block of ``model`` in place (the plain width-pruned model)."""
    check_width_supported(model)
    layers = decoder_layers(model)
    w = plan.widths()
    for i in sorted(plan.channels):
        parts = block_parts(layers[i], i)
        for key, keep in plan.keep_indices(i).items():
            parent, attr = parts.projections[key]
            setattr(parent, attr, _narrow(getattr(parent, attr), keep, PRUNED_SIDE[key]))
        set_attention_groups(layers[i], w["num_attention_heads"], w["num_key_value_heads"])
    patch_width_config(model.config, plan)
    return model
