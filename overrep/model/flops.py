"""Multiply-adds per token of decoder blocks, counted from their modules (meta device is enough).

One token through one block costs, in multiply-adds (MACs):

* every ``nn.Linear`` ``[d_out, d_in]``: ``d_out * d_in``;
* an :class:`~overrep.core.projection.OvercompleteLinear` in its two-factor training form:
  ``d_out * d_in`` for ``P + W`` (the sum is formed once per call, not per token) plus
  ``d^2`` for ``D`` (``d = d_out`` on the output side, ``d_in`` on the input side);
* fused experts: ``top_k`` experts per token, each ``3 * I * H`` (gate, up, down), plus
  ``d^2`` per ``D`` of an :class:`~overrep.core.experts.OvercompleteExperts`;
* any other 2-D ``weight`` (a router ``[E, H]``): its size;
* attention scores, in blocks with attention: ``T * heads * head_dim`` for a ``T``-token
  causal sequence (``QK^T`` and ``AV``, each over ``T/2`` keys on average; the convention
  of Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Table 1). A hybrid's
  Mamba-2 scan is left out with the norms (its projections are counted).

Norms, activations, rotary embeddings and the residual sums are left out (a few MACs per
hidden unit, well under 1%). A forward pass costs ``2 x MACs`` FLOPs.

:func:`flop_counter` is the measured counterpart: torch's dispatch-level count of a real
forward (what ``metrics.json``'s ``train_flops`` reports), made to count grouped-query
attention on every torch version.
"""

from __future__ import annotations

from torch import nn

from ..core.experts import OvercompleteExperts, is_fused_experts
from ..core.projection import OvercompleteLinear


def _experts_macs(module: nn.Module, top_k: int) -> int:
    base = module.base_layer if isinstance(module, OvercompleteExperts) else module
    _, two_i, hidden = base.gate_up_proj.shape
    per_expert = 3 * (two_i // 2) * hidden
    if isinstance(module, OvercompleteExperts):
        for name in ("gate", "up", "down"):
            D = getattr(module, f"D_{name}")
            per_expert += 0 if D is None else D.shape[-1] ** 2
    return top_k * per_expert


def _module_macs(module: nn.Module, top_k: int) -> int:
    if isinstance(module, OvercompleteLinear):
        d = 0 if module.D is None else module.D.shape[0] ** 2
        return module.in_features * module.out_features + d
    if isinstance(module, OvercompleteExperts) or is_fused_experts(module):
        return _experts_macs(module, top_k)
    if isinstance(module, nn.Linear):
        return module.in_features * module.out_features
    weight = module._parameters.get("weight")
    own = weight.numel() if weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding) else 0
    return own + sum(_module_macs(child, top_k) for child in module.children())


def attention_dim(config) -> int:
    """``heads * head_dim``: the width of queries (and of the attention output)."""
    heads = config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def _has_attention(layer: nn.Module) -> bool:
    # a hybrid's Mamba or MLP block has no attention scores (its scan is left out, like norms)
    return any(hasattr(m, "q_proj") for m in layer.modules())


def block_macs(layer: nn.Module, config, seq_len: int) -> int:
    """MACs per token of one decoder block (as it is: plain, or wrapped for training)
    in a causal sequence of ``seq_len`` tokens."""
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    scores = seq_len * attention_dim(config) if _has_attention(layer) else 0
    return _module_macs(layer, top_k) + scores


def blocks_macs(layers, config, seq_len: int) -> int:
    """MACs per token of several decoder blocks, one after the other."""
    return sum(block_macs(layer, config, seq_len) for layer in layers)


def _attention_flops(q, k, v, *_, out_shape=None, **__) -> int:
    """Forward FLOPs of a fused attention kernel from its ``[B, H, T, d]`` shapes: ``QK^T`` and
    ``AV`` over every query head, also where key and value have fewer heads (grouped-query
    attention, which torch's own count refuses before 2.13)."""
    b, heads, t_q, d_qk = q
    return 2 * b * heads * t_q * k[-2] * (d_qk + v[-1])


def _attention_backward_flops(grad, q, k, v, *_, out_shape=None, **__) -> int:
    """The scores recomputed (``QK^T``), the scores' and V's gradients (two products over
    ``d_v``), Q's and K's (two over ``d_qk``): torch's own count, for every head layout."""
    b, heads, t_q, d_qk = q
    return 2 * b * heads * t_q * k[-2] * (3 * d_qk + 2 * v[-1])


def flop_counter(cpu_attention: bool = False):
    """torch's ``FlopCounterMode`` (matrix products and fused attention kernels), with a
    grouped-query-aware count for the fused attention kernels on every torch version.
    ``cpu_attention`` also counts the CPU flash-attention kernel, which torch's table leaves out."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    forward = ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_cudnn_attention"]
    backward = [name + "_backward" for name in forward]
    if cpu_attention:
        forward.append("_scaled_dot_product_flash_attention_for_cpu")
        backward.append("_scaled_dot_product_flash_attention_for_cpu_backward")
    mapping = {getattr(aten, n): _attention_flops for n in forward if hasattr(aten, n)}
    mapping.update({getattr(aten, n): _attention_backward_flops for n in backward if hasattr(aten, n)})
    return FlopCounterMode(display=False, custom_mapping=mapping)
