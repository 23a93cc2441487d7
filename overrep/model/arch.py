"""Architecture discovery: where a decoder model keeps its blocks, projections and norms.

Everything here is found from the model's modules and config, never from its name, so
any LLaMA-style decoder works: LLaMA 2/3, SmolLM2, Mistral, Qwen2, Qwen3 (q_norm /
k_norm inside attention), Gemma 3 (four norms per block, sliding-window layer types,
GELU), Qwen3-MoE (fused experts plus a router). A model that lacks one of the pieces
gets one :class:`OverRepError` that names the missing piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..errors import OverRepError
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


def block_parts(layer: nn.Module, index: int | None = None) -> BlockParts:
    """Find attention, MLP, projections and norms of one decoder block."""
    where = f"decoder block {index} ({type(layer).__name__})" if index is not None else type(layer).__name__
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        raise OverRepError(f"unsupported architecture: {where} has no self_attn module")
    projections: dict[str, tuple[nn.Module, str]] = {}
    for key, name in _ATTN_NAMES.items():
        if not isinstance(getattr(attn, name, None), nn.Linear):
            raise OverRepError(f"unsupported architecture: {where} has no linear self_attn.{name} "
                               "(fused or renamed attention projections are not supported)")
        projections[key] = (attn, name)
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        raise OverRepError(f"unsupported architecture: {where} has no mlp module")
    experts, router = None, None
    if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in _MLP_NAMES.values()):
        for key, name in _MLP_NAMES.items():
            projections[key] = (mlp, name)
    elif is_fused_experts(getattr(mlp, "experts", None)):
        experts, router = (mlp, "experts"), getattr(mlp, "gate", None)
    else:
        raise OverRepError(f"unsupported architecture: {where} has neither a gated MLP "
                           "(mlp.gate_proj/up_proj/down_proj) nor fused experts (mlp.experts.gate_up_proj/down_proj)")
    norms = {name: (layer, name) for name, child in layer.named_children() if _is_norm(child)}
    norms.update({f"self_attn.{n}": (attn, n) for n, c in attn.named_children() if _is_norm(c)})
    return BlockParts(attn, mlp, projections, norms, experts, router)


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
