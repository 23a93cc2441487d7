"""Parameter and memory account of a pruning + recovery setup, from a config alone.

The model is instantiated on PyTorch's ``meta`` device (shapes, no storage), pruned and
wrapped exactly as a real run would be, and counted. So the account can never drift
from what training does, and a 70B config costs nothing to inspect.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from .arch import decoder_layers
from .flops import blocks_macs
from .presets import Preset, get_preset
from .wrap import apply_preset, count_parameters, plan_recovery
from .surgery import prune

_ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32


def meta_model(config: PretrainedConfig | str):
    """A weightless model of ``config`` (a copy: pruning the result never touches the caller's)."""
    config = AutoConfig.from_pretrained(config) if isinstance(config, str) else copy.deepcopy(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def pruning_account(dense, pruned, removed: list[int]) -> dict:
    """What removing ``removed`` took from ``dense`` (``pruned``: the result): blocks and parameters."""
    n = len(decoder_layers(dense))
    dense_params, compact_params = count_parameters(dense), count_parameters(pruned)
    return {"num_layers_before": n, "num_layers_after": n - len(removed), "layer_fraction_removed": len(removed) / n,
            "param_fraction_removed": 1 - compact_params / dense_params,
            "param_fraction_removed_head_counted": (dense_params - compact_params) / counted_parameters(dense)[0],
            "dense_params": dense_params, "pruned_params": compact_params}


def counted_parameters(model) -> tuple[int, int]:
    """``(total, per-block mean)``; the output head counts as its own matrix even when tied.

    This is how the paper's pruning ratios resolve to whole blocks: with it, 25% of
    LLaMA3-3B is 9 of 28 blocks and 50% of LLaMA3-8B is 18 of 32 (Table
    ``tab:backbone-config``).
    """
    total = count_parameters(model)
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        total += head.weight.numel()
    layers = decoder_layers(model)
    return total, sum(count_parameters(l) for l in layers) // len(layers)


def blocks_for_ratio(model, ratio: float) -> int:
    """Number of whole decoder blocks whose removal is closest to ``ratio`` of the parameters."""
    from ..errors import OverRepError

    if not 0.0 < ratio < 1.0:
        raise OverRepError(f"pruning ratio must be between 0 and 1 (exclusive), got {ratio}")
    total, per_block = counted_parameters(model)
    n = int(round(ratio * total / per_block))
    num_layers = len(decoder_layers(model))
    if n < 1:
        raise OverRepError(f"pruning ratio {ratio} removes less than one block ({per_block:,} parameters each)")
    if n >= num_layers:
        raise OverRepError(f"pruning ratio {ratio} would remove {n} of {num_layers} blocks, leaving none")
    return n


def recovery_account(config: PretrainedConfig | str, removed: list[int], preset: Preset | str = "hybrid", *,
                     blocks: int | str = 2, block1_init: str = "stitched", train_bytes: int = 4,
                     seq_len: int | None = None, final_block: bool = True) -> dict:
    """Trainable parameters and training memory of ``preset`` for removing ``removed``.

    Memory counts weights, gradients and AdamW state of the recovery module (activations
    excluded; they depend on batch and sequence length), at ``train_bytes`` per value.
    With ``seq_len``, also ``module_macs_per_token``: the multiply-adds one token costs in
    the forward of all recovery modules in their training form (:mod:`overrep.model.flops`).
    """
    preset = get_preset(preset)
    model = meta_model(config)
    dense_params = count_parameters(model)
    num_layers = len(decoder_layers(model))
    plan = plan_recovery(model, removed, preset, blocks=blocks, block1_init=block1_init, final_block=final_block)
    prune(model, plan)
    compact_params = count_parameters(model)
    modules = apply_preset(model, plan, preset)
    trainable = sum(count_parameters(m, trainable_only=True) for m in modules)
    module_params = sum(count_parameters(m) for m in modules)
    frozen = module_params - trainable
    extra = {} if seq_len is None else {
        "module_macs_per_token": sum(blocks_macs(m.blocks, model.config, seq_len) for m in modules)}
    return {
        "preset": preset.name,
        "num_layers_before": num_layers,
        "num_layers_after": num_layers - len(plan.removed),
        "removed_layers": plan.removed,
        "dense_params": dense_params,
        "compact_params": compact_params,
        "param_fraction_removed": 1 - compact_params / dense_params,
        "layer_fraction_removed": len(plan.removed) / num_layers,
        "trainable_params": trainable,
        "recovery_module_params": module_params,
        "recovery_ratio": trainable / compact_params,
        "train_state_bytes": trainable * (2 * train_bytes + _ADAMW_STATE_BYTES) + frozen * train_bytes,
        **extra,
    }
