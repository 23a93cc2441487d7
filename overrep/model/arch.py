"""Architecture discovery: where a decoder model keeps its blocks, projections and norms.

Everything here is found from the model's modules and config, never from its name, so
any LLaMA-style decoder works: LLaMA 2/3, SmolLM2, Mistral, Qwen2, Qwen3 (q_norm /
k_norm inside attention), Gemma 3 (four norms per block, sliding-window layer types,
GELU), Qwen3-MoE (fused experts plus a router). A block is a token mixer plus a
feed-forward part, each found by the first matching adapter in :data:`PART_ADAPTERS`
(registering one is how a new kind of block is taught). A model that lacks one of the
pieces gets one :class:`OverRepError` that names the missing piece and the known kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ..errors import OverRepError
from ..registry import Registry
from ..core.experts import is_fused_experts

ATTN_PROJ = ("q", "k", "v", "o")
MLP_PROJ = ("gate", "up", "down")
ALL_PROJ = ATTN_PROJ + MLP_PROJ

# The naming every supported family uses inside a block.
_ATTN_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_MLP_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass
class BlockParts:
    """Handles into one decoder block.

    ``projections`` maps ``q..down`` to ``(parent module, attribute name)`` for dense
    MLPs; for a fused-experts MoE block the MLP entries are absent and ``experts`` is set
    (``(parent, attribute)``) along with ``router``.
    """

    attention: nn.Module
    mlp: nn.Module
    projections: dict[str, tuple[nn.Module, str]]
    norms: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    experts: tuple[nn.Module, str] | None = None
    router: nn.Module | None = None


def _model_name(model: nn.Module) -> str:
    return type(model).__name__


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder blocks of a causal LM."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise OverRepError(f"unsupported architecture {_model_name(model)}: no decoder block list at "
                           "model.model.layers (overrep supports LLaMA-style decoders: Llama, Mistral, Qwen2/3, "
                           "Gemma 3, Qwen3-MoE)")
    return layers


def final_norm(model: nn.Module) -> nn.Module:
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is None:
        raise OverRepError(f"unsupported architecture {_model_name(model)}: no final norm at model.model.norm")
    return norm


def _is_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return "norm" in type(module).__name__.lower() and w is not None and w.dim() == 1


# ---- block parts: one registered adapter per kind -------------------------------------
@dataclass
class Found:
    """What an adapter found in a block: the part's module, its dense projections
    (``key -> (parent, attribute)``), and for a fused-experts MoE the experts and router."""

    module: nn.Module
    projections: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    experts: tuple[nn.Module, str] | None = None
    router: nn.Module | None = None


@dataclass(frozen=True)
class PartAdapter:
    """How to find one kind of block part (an architecture adapter): ``role`` is ``mixer``
    (the token mixer, e.g. attention) or ``feed-forward``; ``find`` returns a :class:`Found`
    or None when the block does not have this kind of part."""

    name: str
    description: str
    role: str
    find: Callable[[nn.Module], Found | None]


def _linears(parent: nn.Module | None, names: dict[str, str]) -> dict[str, tuple[nn.Module, str]] | None:
    if parent is None or not all(isinstance(getattr(parent, n, None), nn.Linear) for n in names.values()):
        return None
    return {key: (parent, name) for key, name in names.items()}


def _attention(layer: nn.Module) -> Found | None:
    attn = getattr(layer, "self_attn", None)
    projections = _linears(attn, _ATTN_NAMES)
    return None if projections is None else Found(attn, projections)


def _gated_mlp(layer: nn.Module) -> Found | None:
    mlp = getattr(layer, "mlp", None)
    projections = _linears(mlp, _MLP_NAMES)
    return None if projections is None else Found(mlp, projections)


def _fused_experts(layer: nn.Module) -> Found | None:
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not is_fused_experts(getattr(mlp, "experts", None)):
        return None
    return Found(mlp, experts=(mlp, "experts"), router=getattr(mlp, "gate", None))


#: Every kind of block part overrep can prune around and recover. Registering an adapter
#: here is the one edit that teaches discovery a new kind of block (tried in this order).
PART_ADAPTERS: Registry[PartAdapter] = Registry("block part adapter")
for _a in [
    PartAdapter("attention", "self_attn.q_proj/k_proj/v_proj/o_proj (LLaMA, Mistral, Qwen2/3, Gemma 3)",
                "mixer", _attention),
    PartAdapter("gated-mlp", "mlp.gate_proj/up_proj/down_proj (SwiGLU / GeGLU)", "feed-forward", _gated_mlp),
    PartAdapter("fused-experts", "mlp.experts.gate_up_proj/down_proj with a router mlp.gate (Qwen3-MoE)",
                "feed-forward", _fused_experts),
]:
    PART_ADAPTERS.register(_a)


def _find(layer: nn.Module, role: str, where: str) -> Found:
    adapters = [a for a in PART_ADAPTERS.values() if a.role == role]
    for adapter in adapters:
        found = adapter.find(layer)
        if found is not None:
            return found
    known = "; ".join(f"{a.name}: {a.description}" for a in adapters)
    raise OverRepError(f"unsupported architecture: {where} has no {role} overrep knows ({known})")


def block_parts(layer: nn.Module, index: int | None = None) -> BlockParts:
    """Find attention, MLP, projections and norms of one decoder block."""
    where = f"decoder block {index} ({type(layer).__name__})" if index is not None else type(layer).__name__
    mixer, ffn = _find(layer, "mixer", where), _find(layer, "feed-forward", where)
    norms = {name: (layer, name) for name, child in layer.named_children() if _is_norm(child)}
    norms.update({f"self_attn.{n}": (mixer.module, n) for n, c in mixer.module.named_children() if _is_norm(c)})
    return BlockParts(mixer.module, ffn.module, {**mixer.projections, **ffn.projections}, norms, ffn.experts,
                      ffn.router)


def mlp_activation(layer: nn.Module):
    """The block's own MLP activation (SiLU for LLaMA/Qwen, tanh-GELU for Gemma)."""
    mlp = layer.mlp
    act = getattr(mlp, "act_fn", None) or getattr(getattr(mlp, "experts", None), "act_fn", None)
    if act is None:
        raise OverRepError(f"unsupported architecture: {type(layer).__name__}.mlp has no act_fn")
    return act


def check_supported(model: nn.Module) -> None:
    """Raise one clear error if any block of ``model`` is not supported."""
    final_norm(model)
    for i, layer in enumerate(decoder_layers(model)):
        block_parts(layer, i)
