"""Architecture discovery: where a decoder model keeps its blocks, projections and norms.

Everything here is found from the model's modules and config, never from its name, so
any LLaMA-style decoder works: LLaMA 2/3, SmolLM2, Mistral, Qwen2, Qwen3 (q_norm /
k_norm inside attention), Gemma 3 (four norms per block, sliding-window layer types,
GELU), Qwen3-MoE (fused experts plus a router), and hybrid Mamba-2/attention decoders:
Nemotron-H, whose blocks each hold *one* part (a Mamba-2 mixer, attention, or an MLP), and
Bamba, whose blocks hold a Mamba-2 or attention mixer plus a gated MLP (see
:mod:`overrep.model.mamba` for what OverRep may touch in a Mamba-2 mixer).
A block is a token mixer and/or a feed-forward part, each found among the block's direct
children by the first matching adapter in :data:`PART_ADAPTERS` (registering one is how a
new kind of block is taught), plus its norms. A block with a child overrep does not know,
or with no part at all, gets one :class:`OverRepError` that names it and the known kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ..errors import OverRepError
from ..registry import Registry
from ..core.experts import is_fused_experts
from .mamba import MAMBA_PROJ, find_mamba2

ATTN_PROJ = ("q", "k", "v", "o")
MLP_PROJ = ("gate", "up", "down")
ALL_PROJ = ATTN_PROJ + MLP_PROJ
#: every projection key a preset may name: the built-in presets use :data:`ALL_PROJ` only,
#: so they keep Mamba mixers frozen (as the paper does for Nemotron-H)
KNOWN_PROJ = ALL_PROJ + MAMBA_PROJ

# The naming every supported family uses inside a block.
_ATTN_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_MLP_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_PLAIN_MLP_NAMES = {"up": "up_proj", "down": "down_proj"}

SUPPORTED = "Llama, Mistral, Qwen2/3, Gemma 3, Qwen3-MoE, hybrid Mamba-2/attention decoders: Nemotron-H, Bamba"


@dataclass
class BlockParts:
    """Handles into one decoder block.

    ``attention`` is the token mixer (attention or a Mamba-2 mixer) and ``mlp`` the
    feed-forward part; in a hybrid model a block may have only one of them (the other is
    None). ``projections`` maps ``q..down`` (and ``in`` for a Mamba-2 mixer) to
    ``(parent module, attribute name)``; for a fused-experts MoE block the MLP entries are
    absent and ``experts`` is set (``(parent, attribute)``) along with ``router``.
    ``mlp_attr`` is the block's attribute holding ``mlp``; ``frozen`` the parts whose
    pretrained weights never train (Mamba-2 mixers).
    """

    attention: nn.Module | None
    mlp: nn.Module | None
    projections: dict[str, tuple[nn.Module, str]]
    norms: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    experts: tuple[nn.Module, str] | None = None
    router: nn.Module | None = None
    mlp_attr: str | None = None
    frozen: list[nn.Module] = field(default_factory=list)


def _model_name(model: nn.Module) -> str:
    return type(model).__name__


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder blocks of a causal LM."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise OverRepError(f"unsupported architecture {_model_name(model)}: no decoder block list at "
                           f"model.model.layers (overrep supports {SUPPORTED})")
    return layers


def final_norm(model: nn.Module) -> nn.Module:
    """``model.model.norm``, or else the one norm among ``model.model``'s direct children
    (Nemotron-H calls it ``norm_f``)."""
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if norm is None and inner is not None:
        found = [child for _, child in inner.named_children() if _is_norm(child)]
        norm = found[0] if len(found) == 1 else None
    if norm is None:
        raise OverRepError(f"unsupported architecture {_model_name(model)}: no final norm at model.model.norm")
    return norm


def input_norm(layer: nn.Module) -> nn.Module:
    """The norm a block applies to its input: ``input_layernorm``, or else its first
    registered norm (Nemotron-H blocks have just one, ``norm``)."""
    norm = getattr(layer, "input_layernorm", None)
    if norm is None:
        norm = next((c for _, c in layer.named_children() if _is_norm(c)), None)
    if norm is None:
        raise OverRepError(f"unsupported architecture: {type(layer).__name__} has no input norm")
    return norm


def _is_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return "norm" in type(module).__name__.lower() and w is not None and w.dim() == 1


# ---- block parts: one registered adapter per kind -------------------------------------
@dataclass
class Found:
    """What an adapter found in a block: the part's module, its dense projections
    (``key -> (parent, attribute)``), for a fused-experts MoE the experts and router, and
    whether the part's pretrained weights stay frozen whatever the preset says."""

    module: nn.Module
    projections: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    experts: tuple[nn.Module, str] | None = None
    router: nn.Module | None = None
    frozen: bool = False


@dataclass(frozen=True)
class PartAdapter:
    """How to find one kind of block part (an architecture adapter): ``role`` is ``mixer``
    (the token mixer, e.g. attention) or ``feed-forward``; ``find`` gets one direct child
    of a block and returns a :class:`Found` or None when it is not this kind of part."""

    name: str
    description: str
    role: str
    find: Callable[[nn.Module], Found | None]


def _linears(parent: nn.Module | None, names: dict[str, str]) -> dict[str, tuple[nn.Module, str]] | None:
    if parent is None or not all(isinstance(getattr(parent, n, None), nn.Linear) for n in names.values()):
        return None
    return {key: (parent, name) for key, name in names.items()}


def _attention(child: nn.Module) -> Found | None:
    projections = _linears(child, _ATTN_NAMES)
    return None if projections is None else Found(child, projections)


def _gated_mlp(child: nn.Module) -> Found | None:
    projections = _linears(child, _MLP_NAMES)
    return None if projections is None else Found(child, projections)


def _plain_mlp(child: nn.Module) -> Found | None:
    # up -> act -> down with no gate (Nemotron-H's ReLU^2 MLP): W/D on up and down only
    if hasattr(child, "gate_proj") or getattr(child, "act_fn", None) is None:
        return None
    projections = _linears(child, _PLAIN_MLP_NAMES)
    return None if projections is None else Found(child, projections)


def _fused_experts(child: nn.Module) -> Found | None:
    if not is_fused_experts(getattr(child, "experts", None)):
        return None
    return Found(child, experts=(child, "experts"), router=getattr(child, "gate", None))


def _mamba2(child: nn.Module) -> Found | None:
    projections = find_mamba2(child)
    return None if projections is None else Found(child, projections, frozen=True)


#: Every kind of block part overrep can prune around and recover. Registering an adapter
#: here is the one edit that teaches discovery a new kind of block (tried in this order).
PART_ADAPTERS: Registry[PartAdapter] = Registry("block part adapter")
for _a in [
    PartAdapter("attention", "q_proj/k_proj/v_proj/o_proj (LLaMA, Mistral, Qwen2/3, Gemma 3, Nemotron-H)",
                "mixer", _attention),
    PartAdapter("mamba2", "in_proj/conv1d/out_proj, kept frozen; W/D only on in_proj (key 'in') "
                "(Nemotron-H, Bamba)", "mixer", _mamba2),
    PartAdapter("gated-mlp", "gate_proj/up_proj/down_proj (SwiGLU / GeGLU)", "feed-forward", _gated_mlp),
    PartAdapter("mlp", "up_proj/down_proj with act_fn (Nemotron-H's ReLU^2 MLP)", "feed-forward", _plain_mlp),
    PartAdapter("fused-experts", "experts.gate_up_proj/down_proj with a router gate (Qwen3-MoE)",
                "feed-forward", _fused_experts),
]:
    PART_ADAPTERS.register(_a)


def _known_parts() -> str:
    return "; ".join(f"{a.name} ({a.role}): {a.description}" for a in PART_ADAPTERS.values())


def _identify(child: nn.Module) -> tuple[str, Found] | None:
    for adapter in PART_ADAPTERS.values():
        found = adapter.find(child)
        if found is not None:
            return adapter.role, found
    return None


def _parts_of(layer: nn.Module, where: str) -> tuple[dict[str, tuple[str, Found]], list[str]]:
    """``role -> (attribute, Found)`` for the block's parts, and the names of its norms.

    Every direct child holding parameters must be a norm or a known part: a block whose
    feed-forward (say) overrep does not know is refused rather than silently left alone."""
    parts: dict[str, tuple[str, Found]] = {}
    norms = []
    for name, child in layer.named_children():
        if _is_norm(child):
            norms.append(name)
            continue
        hit = _identify(child)
        if hit is None:
            if any(True for _ in child.parameters()):
                raise OverRepError(f"unsupported architecture: {where} has a part '{name}' "
                                   f"({type(child).__name__}) overrep does not know ({_known_parts()})")
            continue
        role, found = hit
        if role in parts:
            raise OverRepError(f"unsupported architecture: {where} has two {role} parts "
                               f"('{parts[role][0]}' and '{name}')")
        parts[role] = (name, found)
    if not parts:
        raise OverRepError(f"unsupported architecture: {where} has no mixer or feed-forward part overrep "
                           f"knows ({_known_parts()})")
    return parts, norms


def block_parts(layer: nn.Module, index: int | None = None) -> BlockParts:
    """Find the token mixer, feed-forward part, projections and norms of one decoder block."""
    where = f"decoder block {index} ({type(layer).__name__})" if index is not None else type(layer).__name__
    parts, norm_names = _parts_of(layer, where)
    norms = {name: (layer, name) for name in norm_names}
    projections: dict[str, tuple[nn.Module, str]] = {}
    for attr, found in parts.values():
        projections.update(found.projections)
        if not found.frozen:  # a frozen part's own norms (Mamba's gated norm) stay as they are
            norms.update({f"{attr}.{n}": (found.module, n) for n, c in found.module.named_children()
                          if _is_norm(c)})
    mixer = parts.get("mixer", (None, None))[1]
    ffn_attr, ffn = parts.get("feed-forward", (None, None))
    return BlockParts(None if mixer is None else mixer.module, None if ffn is None else ffn.module,
                      projections, norms, None if ffn is None else ffn.experts, None if ffn is None else ffn.router,
                      ffn_attr, [f.module for _, f in parts.values() if f.frozen])


def mlp_activation(layer: nn.Module):
    """The block's own MLP activation (SiLU for LLaMA/Qwen, tanh-GELU for Gemma, ReLU^2 for
    Nemotron-H), or None for a block without a feed-forward part."""
    mlp = block_parts(layer).mlp
    if mlp is None:
        return None
    act = getattr(mlp, "act_fn", None) or getattr(getattr(mlp, "experts", None), "act_fn", None)
    if act is None:
        raise OverRepError(f"unsupported architecture: {type(layer).__name__}'s feed-forward "
                           f"{type(mlp).__name__} has no act_fn")
    return act


def group_activation(layers: nn.ModuleList, indices: list[int]):
    """The activation the annealed activation of a recovery module anneals: that of the
    first of its blocks (``indices``) with an MLP, else of the model's first block with one
    (in a hybrid model a module may consist of attention and Mamba blocks only)."""
    for i in list(indices) + list(range(len(layers))):
        act = mlp_activation(layers[i])
        if act is not None:
            return act
    raise OverRepError("unsupported architecture: no decoder block has a feed-forward part with an act_fn")


def check_supported(model: nn.Module) -> None:
    """Raise one clear error if any block of ``model`` is not supported."""
    final_norm(model)
    for i, layer in enumerate(decoder_layers(model)):
        block_parts(layer, i)
