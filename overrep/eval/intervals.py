"""95% intervals for perplexity: a bootstrap over documents, and a paired one for two models.

Perplexity is ``exp(total NLL / total tokens)``. Tokens of one document are not independent
draws, so the resampled unit is the *document* (:mod:`overrep.data.splits` records the
document of every token; a document cut across two rows stays one unit). Each resample
draws, within every stratum (a domain of the test mixture, so the mix stays fixed), as many
documents as it holds, with replacement, and recomputes ``exp(ΣNLL / Σtokens)``; the
interval is the 2.5th and 97.5th percentile of the resamples (Efron's percentile
bootstrap).

Two models scored on the same rows are compared with the *same* resampled documents for
both (:func:`paired_ratio`): the interval of ``ppl_a / ppl_b`` is far narrower than the two
separate intervals suggest, because most of the sampling noise (which documents are hard)
is shared. A model compared with itself gives exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import OverRepError

RESAMPLES = 1000
LEVEL = 0.95
SEED = 0  # fixed: the same rows always give the same interval


@dataclass
class Scored:
    """Per-document sums of a model on some rows: ``nll`` (nats), ``tokens`` and ``strata``
    (the domain index of each document), 1-D arrays of one length, documents in a fixed order."""

    nll: np.ndarray
    tokens: np.ndarray
    strata: np.ndarray

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.sum() / self.tokens.sum()))

    def to_state(self) -> dict:
        return {"nll": torch.from_numpy(self.nll), "tokens": torch.from_numpy(self.tokens),
                "strata": torch.from_numpy(self.strata)}

    @classmethod
    def from_state(cls, state: dict) -> "Scored":
        return cls(*(state[k].numpy() for k in ("nll", "tokens", "strata")))

    def select(self, stratum: int) -> "Scored":
        keep = self.strata == stratum
        return Scored(self.nll[keep], self.tokens[keep], self.strata[keep])


def by_document(token_nll: torch.Tensor, units: torch.Tensor, row_strata: torch.Tensor | None = None) -> Scored:
    """Sum per-token NLL ``[N, T-1]`` (target ``t + 1`` at ``[r, t]``) by the document of each
    target (``units [N, T]``); ``row_strata [N]``: the stratum of each row (default all 0)."""
    if units.shape[0] != token_nll.shape[0] or units.shape[1] != token_nll.shape[1] + 1:
        raise OverRepError(f"units {tuple(units.shape)} do not match the scored rows {tuple(token_nll.shape)}")
    owner = units[:, 1:].reshape(-1)
    ids, index = torch.unique(owner, return_inverse=True)
    nll = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, index, token_nll.reshape(-1).double())
    tokens = torch.bincount(index, minlength=len(ids)).double()
    strata = torch.zeros(len(ids), dtype=torch.long)
    if row_strata is not None:
        strata[index] = row_strata[:, None].expand_as(units[:, 1:]).reshape(-1)
    return Scored(nll.numpy(), tokens.numpy(), strata.numpy())


def _draws(scored: Scored, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, documents]`` counts: how often each document is drawn, within its stratum."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((resamples, len(scored.nll)))
    for s in np.unique(scored.strata):
        members = np.flatnonzero(scored.strata == s)
        picks = rng.integers(0, len(members), size=(resamples, len(members)))
        for r in range(resamples):
            counts[r] += np.bincount(members[picks[r]], minlength=len(scored.nll))
    return counts


def _bounds(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = 100 * (1 - level) / 2
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def perplexity_interval(scored: Scored, *, resamples: int = RESAMPLES, level: float = LEVEL,
                        seed: int = SEED) -> dict:
    """``{"value", "low", "high", "tokens", "documents"}``: perplexity and its bootstrap interval."""
    counts = _draws(scored, resamples, seed)
    log_ppl = (counts @ scored.nll) / (counts @ scored.tokens)
    low, high = _bounds(np.exp(log_ppl), level)
    return {"value": scored.perplexity, "low": low, "high": high, "tokens": int(scored.tokens.sum()),
            "documents": len(scored.nll)}


def paired_ratio(a: Scored, b: Scored, *, resamples: int = RESAMPLES, level: float = LEVEL,
                 seed: int = SEED) -> dict:
    """``ppl_a / ppl_b`` and ``ppl_a - ppl_b`` with paired bootstrap intervals (the same
    documents drawn for both models); ``a`` and ``b`` must score the same documents."""
    if not (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.strata, b.strata)):
        raise OverRepError("a paired comparison needs both models scored on the same rows")
    counts = _draws(a, resamples, seed)
    tokens = counts @ a.tokens
    pa, pb = np.exp((counts @ a.nll) / tokens), np.exp((counts @ b.nll) / tokens)
    ratio, diff = _bounds(pa / pb, level), _bounds(pa - pb, level)
    return {"ratio": {"value": a.perplexity / b.perplexity, "low": ratio[0], "high": ratio[1]},
            "difference": {"value": a.perplexity - b.perplexity, "low": diff[0], "high": diff[1]}}


def format_interval(figure: dict | None, digits: int = 1) -> str:
    """``"24.6 [23.9, 25.4]"`` for ``{"value", "low", "high"}``; ``"–"`` for none."""
    if not figure or figure.get("value") is None:
        return "–"
    v, lo, hi = figure["value"], figure.get("low"), figure.get("high")
    fmt = (lambda x: f"{x:,.{digits}f}") if abs(v) < 1e4 else (lambda x: f"{x:.3g}")
    return fmt(v) if lo is None else f"{fmt(v)} [{fmt(lo)}, {fmt(hi)}]"
