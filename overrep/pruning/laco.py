"""``laco``: Layer Collapse.

Yang et al., 2024, "LaCo: Large Language Model Pruning via Layer Collapse": blocks are
merged into the block before them with Reserving-Differences-while-Seeking-Common,
``θ_l ← θ_l + Σ_k (θ_{l+k} − θ_l)``, and a merge is kept when the collapsed model's
representation stays close to the dense model's (see :func:`laco`). Besides the removed
blocks, the selection carries the merged weights of each retained block that absorbed
others (``Selection.replaced``); loading them into those blocks before removing the
others gives the collapsed model.
"""

from __future__ import annotations

import copy
import logging
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import OverRepError
from ..model.arch import decoder_layers
from ..model.surgery import _patch_config
from .selection import Selection, _check_calibration, _check_n, _inference, _stream_hidden

log = logging.getLogger(__name__)


# Dense reference representations kept on the model's device up to this size, the rest on CPU.
_REFERENCE_DEVICE_BYTES = 1 << 30


def rdsc_merge(base: dict[str, torch.Tensor], others: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Reserving-Differences-while-Seeking-Common: ``θ ← θ_base + Σ_k (θ_k − θ_base)``.

    Applied to every floating-point entry of the block's ``state_dict`` (computed in
    float32, stored in the entry's dtype); other entries keep the base block's value.
    """
    merged = {}
    for key, value in base.items():
        if not value.is_floating_point():
            merged[key] = value.clone()
            continue
        acc = value.float().clone()
        for other in others:
            acc += other[key].to(device=value.device, dtype=torch.float32) - value.float()
        merged[key] = acc.to(value.dtype)
    return merged


def _same_layout(states: list[dict[str, torch.Tensor]]) -> bool:
    """Whether all block ``state_dict`` s have the same entries with the same shapes."""
    first = {k: tuple(v.shape) for k, v in states[0].items()}
    return all({k: tuple(v.shape) for k, v in st.items()} == first for st in states[1:])


@contextmanager
def _swapped_blocks(model: nn.Module, blocks: list[nn.Module], kept: list[int]):
    """Temporarily run ``model`` with ``blocks`` (dense indices ``kept``) as its decoder.

    The config's per-layer fields (``layer_types`` and the like) are sliced to ``kept``
    the same way :func:`overrep.model.surgery.remove_layers` does it, so each block keeps its
    own attention type; the block list and every config field are restored afterwards.
    """
    inner = model.model
    original = inner.layers
    configs = {id(c): c for c in (model.config, getattr(inner, "config", model.config))}.values()
    saved = [(c, dict(vars(c))) for c in configs]
    try:
        inner.layers = nn.ModuleList(blocks)
        for c in configs:
            _patch_config(c, kept)
        yield
    finally:
        inner.layers = original
        for c, state in saved:
            for key in [k for k in vars(c) if k not in state]:
                delattr(c, key)
            vars(c).update(state)


def _row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row cosine of the flattened ``[tokens, hidden]`` representations (float32)."""
    return F.cosine_similarity(a.flatten(1).float(), b.flatten(1).float().to(a.device), dim=1)


def laco_similarity(model: nn.Module, reference: list[torch.Tensor], calibration: torch.Tensor,
                    batch_size: int = 8) -> float:
    """Mean over calibration rows of :func:`_row_cosine` between ``model``'s final-normed
    hidden states and ``reference`` (one tensor per batch, as from :func:`laco_reference`).
    """
    sims: list[torch.Tensor] = []

    def on_final(rows, h):
        sims.append(_row_cosine(h, reference[rows.start // batch_size]).cpu())

    with _inference(model):
        _stream_hidden(model, calibration, batch_size, on_final=on_final)
    return torch.cat(sims).double().mean().item()


def laco_reference(model: nn.Module, calibration: torch.Tensor, batch_size: int = 8) -> list[torch.Tensor]:
    """Final-normed hidden states of ``model`` on the calibration rows, one tensor per batch."""
    out: list[torch.Tensor] = []
    used = [0]

    def on_final(rows, h):
        h = h.detach()
        if h.device.type != "cpu" and used[0] + h.numel() * h.element_size() > _REFERENCE_DEVICE_BYTES:
            h = h.cpu()
        else:
            used[0] += h.numel() * h.element_size()
            h = h.clone()
        out.append(h)

    with _inference(model):
        _stream_hidden(model, calibration, batch_size, on_final=on_final)
    return out


def laco(model: nn.Module, n_blocks: int, calibration=None, *, merge_size: int = 4, low: int = 1,
         high: int | None = None, interval: int = 2, threshold: float = 0.65, threshold_step: float = 0.05,
         batch_size: int = 8) -> Selection:
    """Layer Collapse (LaCo, Yang et al. 2024): merge blocks into earlier ones with RDSC.

    Hyper-parameters (the paper's symbols in brackets, defaults as in the paper):

    * ``merge_size`` (C = 4): blocks per collapse; a merge folds blocks ``l+1..l+C-1``
      into block ``l`` (fewer near the end, so exactly ``n_blocks`` are removed).
    * ``low``, ``high`` (L = 1, H = number of blocks): the dense block range searched;
      the absorbing block ``l`` goes from ``H - C`` down to ``L`` (block 0 never absorbs).
    * ``interval`` (I = 2): after an accepted merge the next ``l`` is ``I`` lower.
    * ``threshold`` (T = 0.65): a merge is accepted when the similarity exceeds ``T``.

    Search, over the current (already collapsed) block list, from the top: try merging
    ``m = min(C-1, blocks still to remove)`` blocks into ``l``; the candidate model is
    evaluated against the dense model and accepted if its similarity is above ``T``,
    then ``l`` drops by ``I`` (and is clamped so the window fits the shrunk list),
    otherwise by 1. Merges compound: a block that already absorbed others may later be
    absorbed itself, the formula applied to its current weights.

    Similarity (following the authors' reference code): for each calibration row, the
    cosine between the flattened ``[tokens, hidden]`` final-normed hidden states of the
    candidate and of the dense model, averaged over rows.

    Exact count: if a sweep down to ``L`` ends with fewer than ``n_blocks`` removed, the
    sweep restarts from the top with ``T`` lowered by ``threshold_step``; once ``T`` is
    below -1 every finite candidate is accepted, so the search ends.

    Only runs of blocks with the same parameter names and shapes are merged (a run
    mixing dense-MLP and MoE blocks is skipped; if no run fits, an :class:`OverRepError`
    says so). The absorbing block keeps its own kind of attention (e.g. sliding window).
    Each candidate costs one forward over the calibration rows; the dense model's
    final-normed hidden states are kept (on the model's device up to 1 GiB, the rest on
    CPU).

    The model is not changed: candidates are copies of the absorbing block placed,
    together with the untouched blocks, in a temporary block list (see
    :func:`_swapped_blocks`).
    """
    layers = decoder_layers(model)
    num_layers = len(layers)
    _check_n("laco", n_blocks, num_layers)
    calibration = _check_calibration("laco", calibration)
    high = num_layers if high is None else high
    if merge_size < 2:
        raise OverRepError(f"laco merge_size (C) must be >= 2, got {merge_size}")
    if interval < 1:
        raise OverRepError(f"laco interval (I) must be >= 1, got {interval}")
    if not threshold_step > 0:
        raise OverRepError(f"laco threshold_step must be > 0, got {threshold_step}")
    if not 0 <= low < high <= num_layers:
        raise OverRepError(f"laco range [low={low}, high={high}] is invalid for {num_layers} blocks "
                           f"(need 0 <= low < high <= {num_layers})")
    if n_blocks > high - low - 1:
        raise OverRepError(f"criterion 'laco' can merge away at most {high - low - 1} of {num_layers} blocks with "
                           f"range [low={low}, high={high}] (blocks {low + 1}..{high - 1} merge into earlier ones)")

    # Copies of blocks share the model's config object instead of copying it.
    memo_shared = {id(c): c for c in (model.config, getattr(model.model, "config", model.config))}
    blocks: list[nn.Module] = list(layers)   # current block list (dense blocks or merged copies)
    kept: list[int] = list(range(num_layers))  # dense index of each current block
    merges: list[dict] = []
    removed = 0
    sweeps = lowered = 0
    t = float(threshold)

    with _inference(model):
        reference = laco_reference(model, calibration, batch_size)
        while removed < n_blocks:
            sweeps += 1
            log.info("laco sweep %d: threshold %.2f, %d of %d blocks merged away so far", sweeps, t, removed,
                     n_blocks)
            accepted = evaluated = 0
            top = high - removed  # current position just past the searched range
            m = min(merge_size - 1, n_blocks - removed)
            pos = top - m - 1
            while pos >= low and removed < n_blocks:
                base = blocks[pos]
                states = [b.state_dict() for b in blocks[pos: pos + m + 1]]
                if not _same_layout(states):
                    pos -= 1  # blocks of different structure (e.g. dense and MoE) cannot merge
                    continue
                evaluated += 1
                merged_state = rdsc_merge(states[0], states[1:])
                candidate = copy.deepcopy(base, memo=dict(memo_shared))
                candidate.load_state_dict(merged_state)
                new_blocks = blocks[:pos] + [candidate] + blocks[pos + m + 1:]
                new_kept = kept[:pos] + kept[pos:pos + 1] + kept[pos + m + 1:]
                with _swapped_blocks(model, new_blocks, new_kept):
                    sim = laco_similarity(model, reference, calibration, batch_size)
                if math.isfinite(sim) and sim > t:
                    merges.append({"into": kept[pos], "merged": kept[pos + 1: pos + m + 1],
                                   "similarity": sim, "threshold": t})
                    blocks, kept = new_blocks, new_kept
                    removed += m
                    accepted += 1
                    m = min(merge_size - 1, n_blocks - removed)
                    top = high - removed
                    pos = min(pos - interval, top - m - 1)
                else:
                    pos -= 1
            if removed < n_blocks:
                if not evaluated:
                    raise OverRepError(f"criterion 'laco' cannot remove {n_blocks - removed} more block(s): no run of "
                                       f"{m + 1} blocks in range [low={low}, high={high}] has blocks of one structure "
                                       "(merging needs equal parameter names and shapes)")
                if not accepted and t < -1.0:
                    raise OverRepError("criterion 'laco' found no merge with a finite similarity "
                                       "(the collapsed model's hidden states are not finite)")
                lowered += 1
                t = round(float(threshold) - lowered * threshold_step, 12)

    gone = sorted(set(range(num_layers)) - set(kept))
    absorbed = {mrg["into"] for mrg in merges} & set(kept)
    replaced = {}
    for pos, dense in enumerate(kept):
        if dense in absorbed:
            replaced[dense] = {k: v.detach().to("cpu", copy=True) for k, v in blocks[pos].state_dict().items()}
    return Selection(gone, replaced, {"merges": merges, "threshold": float(threshold),
                                      "final_threshold": t, "sweeps": sweeps})
