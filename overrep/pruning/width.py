"""Width criteria: which attention heads and MLP channels of every block to keep.

Channels are scored as *coupled groups* (LLM-Pruner, Ma et al. 2023): an MLP channel is
row j of ``gate`` and ``up`` plus column j of ``down``; a query head is its ``head_dim``
rows of ``q`` plus the matching columns of ``o``; a key/value head (pruned only when every
group has a single query head) adds its rows of ``k`` and ``v``. A group's importance is
the sum over its weights of

* ``magnitude``: ``w^2`` (the group's squared L2 norm), or
* ``taylor``: ``|w * dL/dw|``, LLM-Pruner's element-wise first-order Taylor estimate of
  the loss change from zeroing the weight, with the gradient of the language-model loss
  accumulated over the calibration rows.

:func:`plan_width` turns a ratio of parameters into uniform widths (every block keeps the
same number of heads and channels, so a standard config describes the result; LLM-Pruner
prunes a range of blocks by the same ratio) and keeps the top-scoring groups per block.
The dependency bookkeeping is written out here rather than taken from ``torch-pruning``:
the coupled groups of these decoders are fixed (above), and a graph tracer over Hugging
Face attention code would add a dependency for three index lists.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..errors import OverRepError
from ..model.accounting import counted_parameters
from ..model.arch import block_parts, decoder_layers
from ..model.width import WidthPlan, attention_shape, check_width_supported

log = logging.getLogger(__name__)

WIDTH_CRITERIA = {
    "taylor": "first-order Taylor importance |w * dL/dw| of each coupled group on calibration data (LLM-Pruner)",
    "magnitude": "squared L2 norm of each coupled group's weights",
}


def _calibration_grads(model: nn.Module, ids: torch.Tensor, batch: int = 4) -> None:
    """Accumulate the language-model loss's gradient over ``ids`` into ``.grad`` (in place)."""
    was = {id(p): p.requires_grad for p in model.parameters()}
    model.requires_grad_(False)
    for layer in decoder_layers(model):
        for parent, attr in block_parts(layer).projections.values():
            getattr(parent, attr).weight.requires_grad_(True)
    device = next(model.parameters()).device
    for i in range(0, ids.shape[0], batch):
        rows = ids[i:i + batch].to(device)
        loss = model(input_ids=rows, labels=rows, use_cache=False).loss
        (loss * rows.shape[0] / ids.shape[0]).backward()
    for p in model.parameters():
        p.requires_grad_(was[id(p)])


def _importance(weight: torch.Tensor, criterion: str) -> torch.Tensor:
    w = weight.detach().float()
    if criterion == "magnitude":
        return w.pow(2)
    if weight.grad is None:
        raise OverRepError("the taylor width criterion found no gradient for a projection")
    return (w * weight.grad.float()).abs()


@torch.no_grad()
def _layer_scores(layer: nn.Module, index: int, criterion: str, head_dim: int) -> dict[str, torch.Tensor]:
    proj = {k: getattr(p, a).weight for k, (p, a) in block_parts(layer, index).projections.items()}
    imp = {k: _importance(w, criterion) for k, w in proj.items()}
    mlp = imp["gate"].sum(1) + imp["up"].sum(1) + imp["down"].sum(0)
    q_rows = imp["q"].sum(1) + imp["o"].sum(0)
    heads = q_rows.reshape(-1, head_dim).sum(1)
    kv = (imp["k"].sum(1) + imp["v"].sum(1)).reshape(-1, head_dim).sum(1)
    return {"channels": mlp, "heads": heads, "kv_heads": kv}


def width_scores(model: nn.Module, criterion: str, calibration: torch.Tensor | None) -> list[dict]:
    """Per block: scores of its MLP channels, query heads and key/value heads."""
    if criterion not in WIDTH_CRITERIA:
        raise OverRepError(f"unknown width criterion '{criterion}'; available: {', '.join(WIDTH_CRITERIA)}")
    check_width_supported(model)
    _, _, head_dim = attention_shape(model)
    if criterion == "taylor":
        if calibration is None:
            raise OverRepError("the taylor width criterion needs calibration rows")
        model.zero_grad(set_to_none=True)
        _calibration_grads(model, calibration)
    try:
        return [_layer_scores(layer, i, criterion, head_dim) for i, layer in enumerate(decoder_layers(model))]
    finally:
        model.zero_grad(set_to_none=True)


def width_counts(model: nn.Module, ratio: float, heads: bool = True) -> dict:
    """Uniform widths that remove ``ratio`` of the parameters (output head counted as its own
    matrix, as for block pruning: :func:`~overrep.model.accounting.counted_parameters`).

    Heads go first, by the same fraction as the block's parameters, rounded to whole heads
    per key/value group (``heads=False``: MLP channels only); MLP channels make up the rest."""
    if not 0.0 < ratio < 1.0:
        raise OverRepError(f"pruning ratio must be between 0 and 1 (exclusive), got {ratio}")
    n_heads, n_kv, hd = attention_shape(model)
    layers = decoder_layers(model)
    parts = block_parts(layers[0], 0).projections
    lin = {k: getattr(p, a) for k, (p, a) in parts.items()}
    per_channel = lin["gate"].in_features + lin["up"].in_features + lin["down"].out_features
    per_channel += sum(lin[k].bias is not None for k in ("gate", "up"))
    per_q_head = hd * (lin["q"].in_features + lin["o"].out_features + (lin["q"].bias is not None))
    per_kv_head = hd * (lin["k"].in_features + lin["v"].in_features + (lin["k"].bias is not None) * 2)
    total, per_block = counted_parameters(model)
    target = ratio * total / len(layers)  # parameters each block gives up
    group = n_heads // n_kv
    keep_heads, keep_kv = n_heads, n_kv
    if heads:
        frac = min(target / per_block, 1.0)
        if group > 1:  # query heads within each key/value group
            keep_heads = n_kv * max(1, group - int(round(frac * group)))
        else:  # plain multi-head attention: whole heads (q, k, v and o)
            keep_kv = keep_heads = max(1, n_kv - int(round(frac * n_kv)))
    removed_attn = (n_heads - keep_heads) * per_q_head + (n_kv - keep_kv) * per_kv_head
    intermediate = lin["gate"].out_features
    drop = int(round((target - removed_attn) / per_channel))
    if drop >= intermediate:
        raise OverRepError(f"pruning ratio {ratio} needs more than the blocks' width can give "
                           f"({intermediate} MLP channels a block)")
    if drop < 0:
        drop = 0
    if drop == 0 and removed_attn == 0:
        raise OverRepError(f"pruning ratio {ratio} removes less than one channel a block")
    return {"heads": keep_heads, "kv_heads": keep_kv, "channels": intermediate - drop, "head_dim": hd}


def _top(scores: torch.Tensor, k: int) -> list[int]:
    return sorted(torch.topk(scores, k).indices.tolist())


def plan_width(model: nn.Module, ratio: float, criterion: str, calibration: torch.Tensor | None = None,
               heads: bool = True) -> tuple[WidthPlan, list[dict]]:
    """The :class:`WidthPlan` for ``ratio`` by ``criterion``, and the per-block scores."""
    counts = width_counts(model, ratio, heads)
    scores = width_scores(model, criterion, calibration)
    n_heads, n_kv, hd = attention_shape(model)
    group, new_group = n_heads // n_kv, counts["heads"] // counts["kv_heads"]
    plan_heads, plan_kv, plan_ch = {}, {}, {}
    for i, s in enumerate(scores):
        plan_ch[i] = _top(s["channels"], counts["channels"])
        if counts["kv_heads"] < n_kv:  # whole groups, scored with their query heads
            kv_score = s["kv_heads"] + s["heads"].reshape(n_kv, group).sum(1)
            plan_kv[i] = _top(kv_score, counts["kv_heads"])
            plan_heads[i] = [g * group + j for g in plan_kv[i] for j in range(group)]
        else:  # the best query heads of every group
            plan_kv[i] = list(range(n_kv))
            per = s["heads"].reshape(n_kv, group)
            plan_heads[i] = [g * group + j for g in range(n_kv) for j in _top(per[g], new_group)]
    plan = WidthPlan(len(scores), hd, plan_heads, plan_kv, plan_ch, criterion=criterion)
    log.info("width plan (%s): %s", criterion, plan.widths())
    return plan, [{k: v.tolist() for k, v in s.items()} for s in scores]


def width_account(config, ratio: float, heads: bool = True, train_bytes: int = 4) -> dict:
    """Widths, parameters and the width preset's training state for ``ratio``, from a config
    alone (a weightless model; which channels go does not change any count)."""
    import copy

    from ..model.accounting import meta_model
    from ..model.presets import get_preset
    from ..model.width import slice_width
    from ..model.wrap import apply_preset, count_parameters

    model = meta_model(config)
    check_width_supported(model)
    counts = width_counts(model, ratio, heads)
    n = len(decoder_layers(model))
    group = counts["heads"] // counts["kv_heads"]
    plan = WidthPlan(n, counts["head_dim"], {i: [g * group + j for g in range(counts["kv_heads"]) for j in range(group)]
                                             for i in range(n)},
                     {i: list(range(counts["kv_heads"])) for i in range(n)},
                     {i: list(range(counts["channels"])) for i in range(n)}, criterion="(config only)")
    dense = count_parameters(model)
    compact = count_parameters(slice_width(copy.deepcopy(model), plan))
    wrapped = meta_model(config)
    modules = apply_preset(wrapped, plan, get_preset("width"))
    trainable = sum(count_parameters(m, trainable_only=True) for m in modules)
    total, _ = counted_parameters(model)
    return {"granularity": "width", "ratio": ratio, "widths": plan.widths(),
            "dense_params": dense, "compact_params": compact,
            "param_fraction_removed_head_counted": (dense - compact) / total,
            "preset": "width", "trainable_params": trainable,
            "train_state_bytes": trainable * (2 * train_bytes + 8)}
