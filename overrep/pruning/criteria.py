"""Pruning criteria: which decoder blocks to remove.

A criterion is called as ``criterion(model, n_blocks, calibration)`` and returns a
:class:`Selection`: the sorted dense indices of the blocks to remove, optionally new
weights for some retained blocks, and JSON-serialisable diagnostics. ``calibration`` is
a ``LongTensor [rows, tokens]`` of token ids (``None`` for criteria that need no data).
Removing the blocks is a separate step (:mod:`overrep.model.surgery`); a criterion never
changes the model it is given (the dense teacher).

Criteria
--------
``last``
    The last ``n`` blocks except the final one (no data needed).
``block-influence``
    ShortGPT's Block Influence (Men et al., 2024, "ShortGPT: Layers in Large Language
    Models are More Redundant Than You Expect"): ``BI_i = 1 - E[cos(x_i, x_{i+1})]``
    over all calibration tokens, with ``x_i`` the hidden state entering block ``i`` and
    ``x_{i+1}`` the one leaving it. The ``n`` blocks of lowest BI are removed, wherever
    they are (the mask may be non-contiguous); ties go to the lower index.
``cosine``
    LLM-Streamline's segment similarity (Chen et al., 2024, "Compressing Large Language
    Models by Streamlining the Unimportant Layer"): for every run of ``n`` consecutive
    blocks ``[i, i+n-1]``, the mean over tokens of the cosine between the input of
    block ``i`` and the output of block ``i+n-1``; the most similar run is removed (ties:
    the lower start).
``laco``
    Layer Collapse (Yang et al., 2024, "LaCo: Large Language Model Pruning via Layer
    Collapse"): blocks are merged into the block before them with Reserving-Differences-
    while-Seeking-Common, ``θ_l ← θ_l + Σ_k (θ_{l+k} − θ_l)``, and a merge is kept when
    the collapsed model's representation stays close to the dense model's (see
    :func:`laco`). Besides the removed blocks, the selection carries the merged weights
    of each retained block that absorbed others (``Selection.replaced``); loading them
    into those blocks before removing the others gives the collapsed model.

All hidden states come from hooks on the decoder blocks (and the final norm), never
from ``output_hidden_states``, so "the output of the last block" is the un-normed one.
The data-driven criteria run under ``torch.no_grad()`` in eval mode (training flags are
restored afterwards), ``batch_size`` calibration rows per forward.
"""

from __future__ import annotations

import copy
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..model.arch import decoder_layers, final_norm
from ..errors import OverRepError
from ..model.surgery import _patch_config

log = logging.getLogger(__name__)


@dataclass
class Selection:
    """What a criterion chose.

    ``removed``: sorted dense indices of the blocks to remove.
    ``replaced``: dense index of a *retained* block -> the full new ``state_dict`` of that
    block (CPU tensors), to load into it before the removal (only ``laco`` uses this).
    ``scores``: JSON-serialisable diagnostics of the choice.
    """

    removed: list[int]
    replaced: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    scores: dict = field(default_factory=dict)


Criterion = Callable[..., Selection]


# ---- shared helpers -----------------------------------------------------------------

def _check_n(name: str, n_blocks: int, num_layers: int) -> None:
    if n_blocks < 1:
        raise OverRepError(f"criterion '{name}' needs at least 1 block to remove, got {n_blocks}")
    if n_blocks >= num_layers:
        raise OverRepError(f"criterion '{name}' cannot remove {n_blocks} of {num_layers} blocks: "
                           "at least one block must remain")


def _check_calibration(name: str, calibration) -> torch.Tensor:
    if calibration is None:
        raise OverRepError(f"criterion '{name}' needs calibration data (token ids [rows, tokens]) but got none")
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.is_floating_point():
        shape = tuple(calibration.shape) if isinstance(calibration, torch.Tensor) else type(calibration).__name__
        raise OverRepError(f"criterion '{name}' needs calibration token ids as an integer tensor [rows, tokens], "
                           f"got {shape}")
    if calibration.numel() == 0:
        raise OverRepError(f"criterion '{name}' got empty calibration data {tuple(calibration.shape)}")
    return calibration.long()


@contextmanager
def _inference(model: nn.Module):
    """``no_grad`` and eval mode, restoring every module's training flag afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _stream_hidden(model: nn.Module, calibration: torch.Tensor, batch_size: int, *,
                   on_block: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                   on_final: Callable[[slice, torch.Tensor], None] | None = None) -> None:
    """Run the calibration rows through the model, ``batch_size`` rows per forward.

    ``on_block(i, x_in, x_out)`` is called as block ``i`` finishes, with the hidden state
    entering it and the one leaving it (``[rows, tokens, hidden]``, un-normed);
    ``on_final(rows, h)`` with the final-normed hidden state of calibration ``rows``.
    Only the base model runs (no LM head). Call inside :func:`_inference`.
    """
    if batch_size < 1:
        raise OverRepError(f"calibration batch size must be >= 1, got {batch_size}")
    layers = decoder_layers(model)
    handles = []
    inputs: dict[int, torch.Tensor] = {}
    current: list[slice] = []
    if on_block is not None:
        for i, layer in enumerate(layers):
            def pre(module, args, kwargs, i=i):
                inputs[i] = args[0] if args else kwargs["hidden_states"]

            def post(module, args, output, i=i):
                on_block(i, inputs.pop(i), _hidden(output))

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(post))
    if on_final is not None:
        handles.append(final_norm(model).register_forward_hook(
            lambda module, args, output: on_final(current[0], _hidden(output))))
    device = model.get_input_embeddings().weight.device
    try:
        for start in range(0, calibration.shape[0], batch_size):
            rows = slice(start, min(start + batch_size, calibration.shape[0]))
            current[:] = [rows]
            model.model(input_ids=calibration[rows].to(device), use_cache=False)
            inputs.clear()
    finally:
        for h in handles:
            h.remove()


def _token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each token's hidden vectors (float32), shape ``[rows, tokens]``."""
    return F.cosine_similarity(a.float(), b.float().to(a.device), dim=-1)


# ---- last -----------------------------------------------------------------------------

def last_but_final(model: nn.Module, n_blocks: int, calibration=None) -> Selection:
    """The paper's shared criterion: the last ``n_blocks`` blocks except the final one.

    Block 1 of the recovery module is then the block before the segment and block 2 the
    model's final block.
    """
    num_layers = len(decoder_layers(model))
    if n_blocks < 1:
        raise OverRepError(f"criterion 'last' needs at least 1 block to remove, got {n_blocks}")
    if n_blocks > num_layers - 2:
        raise OverRepError(f"criterion 'last' can remove at most {num_layers - 2} of {num_layers} blocks "
                           "(it keeps the first and the final block)")
    return Selection(list(range(num_layers - 1 - n_blocks, num_layers - 1)))


# ---- block influence (ShortGPT) --------------------------------------------------------

def block_influence_scores(model: nn.Module, calibration: torch.Tensor, batch_size: int = 8) -> list[float]:
    """``BI_i = 1 - mean over all calibration tokens of cos(input_i, output_i)`` per block."""
    num_layers = len(decoder_layers(model))
    sums = [0.0] * num_layers
    count = [0]

    def on_block(i, x_in, x_out):
        cos = _token_cosine(x_in, x_out)
        sums[i] += cos.double().sum().item()
        if i == 0:
            count[0] += cos.numel()

    with _inference(model):
        _stream_hidden(model, calibration, batch_size, on_block=on_block)
    return [1.0 - s / count[0] for s in sums]


def block_influence(model: nn.Module, n_blocks: int, calibration=None, *, batch_size: int = 8) -> Selection:
    """Remove the ``n_blocks`` blocks of lowest Block Influence (ShortGPT).

    Ties are broken towards the lower block index. The removed blocks need not be
    contiguous.
    """
    num_layers = len(decoder_layers(model))
    _check_n("block-influence", n_blocks, num_layers)
    calibration = _check_calibration("block-influence", calibration)
    bi = block_influence_scores(model, calibration, batch_size)
    order = sorted(range(num_layers), key=lambda i: (bi[i], i))
    return Selection(sorted(order[:n_blocks]), scores={"block_influence": bi})


# ---- segment cosine (LLM-Streamline) -------------------------------------------------------

def segment_cosine_scores(model: nn.Module, n_blocks: int, calibration: torch.Tensor,
                          batch_size: int = 8) -> list[float]:
    """For each start ``i`` in ``0..L-n``: mean over tokens of cos(input of block ``i``,
    output of block ``i+n-1``).

    The inputs of at most ``n`` blocks are held at a time (one batch each).
    """
    num_layers = len(decoder_layers(model))
    starts = num_layers - n_blocks + 1
    sums = [0.0] * starts
    count = [0]
    held: dict[int, torch.Tensor] = {}

    def on_block(j, x_in, x_out):
        if j < starts:
            held[j] = x_in
        i = j - n_blocks + 1
        if i >= 0:
            cos = _token_cosine(held.pop(i), x_out)
            sums[i] += cos.double().sum().item()
            if i == 0:
                count[0] += cos.numel()

    with _inference(model):
        _stream_hidden(model, calibration, batch_size, on_block=on_block)
    return [s / count[0] for s in sums]


def segment_cosine(model: nn.Module, n_blocks: int, calibration=None, *, batch_size: int = 8) -> Selection:
    """Remove the run of consecutive blocks whose input and output agree most (LLM-Streamline).

    Every run ``[i, i+n-1]``, ``i = 0..L-n``, is a candidate; the score is the mean over
    calibration tokens of cos(input of block ``i``, output of block ``i+n-1``); ties go to
    the lower start.
    """
    num_layers = len(decoder_layers(model))
    _check_n("cosine", n_blocks, num_layers)
    calibration = _check_calibration("cosine", calibration)
    sims = segment_cosine_scores(model, n_blocks, calibration, batch_size)
    best = max(range(len(sims)), key=lambda i: (sims[i], -i))
    return Selection(list(range(best, best + n_blocks)),
                     scores={"segment_cosine": {str(i): s for i, s in enumerate(sims)}})


# ---- LaCo: layer collapse ---------------------------------------------------------------------

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


# ---- registry ---------------------------------------------------------------------------------

CRITERIA: dict[str, Criterion] = {
    "last": last_but_final,
    "block-influence": block_influence,
    "cosine": segment_cosine,
    "laco": laco,
}

# Criteria that read calibration data (the others accept ``None``).
NEEDS_CALIBRATION: set[str] = {"block-influence", "cosine", "laco"}


def get_criterion(name: str) -> Criterion:
    if name not in CRITERIA:
        raise OverRepError(f"unknown pruning criterion '{name}'; available: {', '.join(CRITERIA)}")
    return CRITERIA[name]
