"""Perplexity of a causal language model: the one implementation the project uses.

:func:`perplexity_windows` scores a token stream (or independent rows) with windows of
``seq_len`` tokens advancing by ``stride``; :func:`perplexity` is its non-overlapping case
on packed rows, each scored on its own. It lives with the model layer because training
needs it too (held-out perplexity while a recovery trains); evaluation re-exports it.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..errors import OverRepError
from .placement import input_device
from .prefix import SharedPrefix, WholeScorer, token_nll


def sliding_windows(length: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_target)`` of each window over a row of ``length`` tokens.

    Window ``k`` covers tokens ``[k*stride, k*stride + seq_len)`` (clipped to the row) and
    scores the targets in ``[first_target, end)`` not scored by an earlier window; token 0
    has no context and is never scored.
    """
    if seq_len < 2:
        raise OverRepError(f"seq_len must be at least 2, got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise OverRepError(f"stride must be between 1 and seq_len ({seq_len}), got {stride}")
    windows, scored_to, begin = [], 1, 0
    while True:
        end = min(begin + seq_len, length)
        first = max(scored_to, begin + 1)
        if end > first:
            windows.append((begin, end, first))
        scored_to = max(scored_to, end)
        if end >= length:
            return windows
        begin += stride


@torch.no_grad()
def perplexity_windows(model, ids: torch.Tensor, seq_len: int, stride: int | None = None, *,
                       batch_size: int = 8, progress: bool = False, desc: str = "perplexity") -> dict:
    """Sliding-window perplexity of ``model`` on ``ids``.

    Args:
        ids: one token stream ``[T]`` or independent rows ``[N, T]`` (no context crosses rows).
        seq_len: tokens per window (the model's context for the scored tokens).
        stride: how far windows advance (default ``seq_len``: no overlap). A smaller stride
            gives each scored token more context: token ``t`` of a window sees at least
            ``seq_len - stride`` earlier tokens, except in the first window.
        batch_size: windows per forward pass.

    Returns:
        ``{"perplexity", "nll" (mean, nats/token), "tokens" (scored), "windows", "seq_len", "stride"}``.
    """
    stride = seq_len if stride is None else int(stride)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise OverRepError(f"ids must be [T] or [N, T] with T >= 2, got shape {tuple(ids.shape)}")
    ids = ids.long()
    jobs = [(r, w) for r in range(ids.shape[0]) for w in sliding_windows(ids.shape[1], seq_len, stride)]
    by_len: dict[int, list] = {}
    for r, (b, e, f) in jobs:
        by_len.setdefault(e - b, []).append((r, b, e, f))
    device = input_device(model)
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    try:
        bar = tqdm(total=len(jobs), desc=desc, unit="window", disable=not progress, leave=False)
        for length, group in by_len.items():
            for i in range(0, len(group), batch_size):
                chunk = group[i:i + batch_size]
                x = torch.stack([ids[r, b:e] for r, b, e, _ in chunk]).to(device)
                logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), dim=-1)
                for j, (r, b, e, f) in enumerate(chunk):
                    pos = torch.arange(f - b - 1, e - b - 1, device=device)  # positions predicting f..e-1
                    tgt = x[j, f - b:e - b]
                    total_nll -= logp[j, pos, tgt].double().sum().item()
                    total_tokens += e - f
                bar.update(len(chunk))
        bar.close()
    finally:
        model.train(was_training)
    mean = total_nll / total_tokens
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": total_tokens, "windows": len(jobs),
            "seq_len": seq_len, "stride": stride}


def perplexity(model, ids: torch.Tensor, *, batch_size: int = 4, desc: str = "perplexity",
               progress: bool = True) -> float:
    """exp(mean next-token cross-entropy) over packed rows ``ids`` ``[N, T]``, every row on its
    own (no context carried across rows): ``N * (T - 1)`` predicted tokens."""
    return perplexity_windows(model, ids, ids.shape[-1], batch_size=batch_size, progress=progress,
                              desc=desc)["perplexity"]


@torch.no_grad()
def row_token_nll(model, ids: torch.Tensor, *, batch_size: int = 4, progress: bool = False,
                  desc: str = "perplexity", prefix: SharedPrefix | None = None) -> torch.Tensor:
    """Next-token negative log-likelihood of every target of packed rows ``ids`` ``[N, T]``,
    each row on its own: ``[N, T - 1]`` float64 (entry ``[r, t]`` scores token ``t + 1``).
    ``exp(mean)`` is :func:`perplexity`; per-token values let an interval resample documents.
    With ``prefix``, a model that shares its first blocks with one scored before on the same
    rows runs only the rest (:mod:`overrep.model.prefix`)."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise OverRepError(f"ids must be [N, T] with T >= 2, got shape {tuple(ids.shape)}")
    device = input_device(model)
    was_training = model.training
    model.eval()
    out = torch.empty(ids.shape[0], ids.shape[1] - 1, dtype=torch.float64)
    scorer = prefix.scorer(model, ids) if prefix is not None else WholeScorer(model)
    try:
        for i in tqdm(range(0, ids.shape[0], batch_size), desc=desc, unit="batch", disable=not progress, leave=False):
            x = ids[i:i + batch_size].long().to(device)
            out[i:i + batch_size] = token_nll(scorer.logits(i, x), x).double().cpu()
        scorer.done()
    finally:
        model.train(was_training)
    return out
