"""Bootstrap intervals over documents (overrep.eval.intervals) and the generation check's measures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from overrep.errors import OverRepError
from overrep.eval.generation import distinct_n, document_starts
from overrep.eval.intervals import Scored, by_document, paired_ratio, perplexity_interval


def _scored(n_docs: int, seed: int, scale: float = 1.0) -> Scored:
    g = np.random.default_rng(seed)
    tokens = g.integers(20, 200, n_docs).astype(float)
    nll = tokens * g.normal(3.0, 0.4, n_docs) * scale
    return Scored(nll, tokens, np.zeros(n_docs, dtype=np.int64))


def test_by_document_sums_targets_by_their_document():
    nll = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    units = torch.tensor([[0, 0, 1, 1], [1, 2, 2, 2]])  # document 1 crosses the row boundary
    s = by_document(nll, units, torch.tensor([0, 1]))
    # targets: row 0 -> docs 0,1,1 ; row 1 -> docs 2,2,2 (its first token, doc 1, is never a target)
    assert s.nll.tolist() == [1.0, 5.0, 15.0] and s.tokens.tolist() == [1.0, 2.0, 3.0]
    assert s.strata.tolist() == [0, 0, 1]
    assert s.perplexity == pytest.approx(math.exp(21 / 6))
    with pytest.raises(OverRepError, match="do not match"):
        by_document(nll, units[:, :3])


def test_interval_brackets_the_value_and_narrows_with_more_documents():
    small, large = perplexity_interval(_scored(50, 0)), perplexity_interval(_scored(2000, 0))
    for f in (small, large):
        assert f["low"] < f["value"] < f["high"]
    assert (large["high"] - large["low"]) < (small["high"] - small["low"]) / 3
    assert perplexity_interval(_scored(50, 0)) == small  # seeded: the same rows give the same interval


def test_interval_covers_the_truth_about_95_percent_of_the_time():
    """Draw test sets from one known population of documents: the interval holds the
    population's perplexity in roughly 95% of them (a loose band: 200 draws)."""
    population = _scored(20_000, 1)
    truth = population.perplexity
    g = np.random.default_rng(2)
    hits = 0
    for _ in range(200):
        pick = g.integers(0, 20_000, 150)
        sample = Scored(population.nll[pick], population.tokens[pick], population.strata[pick])
        f = perplexity_interval(sample, resamples=300)
        hits += f["low"] <= truth <= f["high"]
    assert 0.88 <= hits / 200 <= 0.99


def test_paired_comparison_of_a_model_with_itself_is_exactly_one_and_zero():
    a = _scored(300, 3)
    pair = paired_ratio(a, a)
    assert pair["ratio"] == {"value": 1.0, "low": 1.0, "high": 1.0}
    assert pair["difference"] == {"value": 0.0, "low": 0.0, "high": 0.0}


def test_paired_interval_is_narrower_than_separate_ones():
    a = _scored(300, 4)
    b = Scored(a.nll * 1.02 + np.random.default_rng(5).normal(0, 2, 300), a.tokens, a.strata)  # 2% worse, correlated
    pair = paired_ratio(b, a)
    assert pair["ratio"]["low"] > 1.0  # the paired bootstrap sees the difference
    fa, fb = perplexity_interval(a), perplexity_interval(b)
    assert fb["low"] < fa["high"]  # the separate intervals overlap
    with pytest.raises(OverRepError, match="same rows"):
        paired_ratio(a, _scored(300, 6))


def test_stratified_resampling_keeps_each_domain_share():
    a, b = _scored(100, 7), _scored(100, 8, scale=2.0)  # a hard and an easy domain
    both = Scored(np.concatenate([a.nll, b.nll]), np.concatenate([a.tokens, b.tokens]),
                  np.repeat([0, 1], 100))
    assert both.select(1).perplexity == pytest.approx(b.perplexity)
    f = perplexity_interval(both)
    assert f["low"] < both.perplexity < f["high"] and f["documents"] == 200


def test_distinct_n_and_document_starts():
    assert distinct_n([[1, 2, 3, 4]], 2) == 1.0
    assert distinct_n([[5, 6, 5, 6, 5, 6]], 2) == pytest.approx(2 / 5)
    assert math.isnan(distinct_n([[1]], 2))
    rows = torch.arange(24).view(2, 12)
    units = torch.tensor([[0] * 3 + [1] * 9, [1] * 10 + [2] * 2])
    prompts = document_starts(rows, units, 5, 4)
    # row 1's document starts too late to fit 4 tokens: its own first tokens stand in
    assert prompts.tolist() == [[3, 4, 5, 6], [12, 13, 14, 15]]
