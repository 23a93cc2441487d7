"""Perplexity of the test (and validation) rows, by domain, and of text from domains the
recovery never trained on -- each figure with its 95% interval over documents.

Per-domain numbers cost nothing extra: every row is scored once, per token, and summed per
document (:func:`overrep.eval.intervals.by_document`); the overall perplexity is
``exp(total NLL / total tokens)`` over the domains together.
"""

from __future__ import annotations

import torch

from ..data.documents import corpus_domain, load_documents
from ..data.packing import _pack
from ..data.text import mixture_parts
from ..errors import OverRepError
from ..model.perplexity import row_token_nll
from ..model.prefix import SharedPrefix
from .intervals import Scored, by_document


def unseen_domain_rows(names: str | None, tokenizer, *, training_source: str, seq_len: int, rows: int,
                       seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (rows [rows, seq_len], units)}`` for each named corpus (e.g. ``"ptb,lambada"``):
    test-only text, packed from the corpus's documents in file order; a corpus whose domain
    the training source covers is refused (its text would not be unseen)."""
    if not names:
        return {}
    trained = {corpus_domain(p): p for p in mixture_parts(training_source)}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    for name in wanted:  # every name is checked before any text loads
        if corpus_domain(name) in trained:
            raise OverRepError(f"eval.domains lists '{name}', whose domain ({corpus_domain(name)}) data.source "
                               f"'{training_source}' trains on ('{trained[corpus_domain(name)]}'); an unseen "
                               "domain must not be trained on")
    out = {}
    for name in wanted:
        docs = load_documents(name, seed=seed)
        packed, _, units = _pack(docs, tokenizer, seq_len, rows, False, units=True)
        if packed.shape[0] < rows:
            raise OverRepError(f"unseen corpus '{name}' yields only {packed.shape[0]} rows of {seq_len} tokens, "
                               f"fewer than eval.domain_sequences = {rows}")
        out[name] = (packed, units)
    return out


def score_rows(model, rows: torch.Tensor, units: torch.Tensor, strata: torch.Tensor | None = None, *,
               desc: str = "perplexity", progress: bool = False, prefix: SharedPrefix | None = None) -> Scored:
    """Every row scored on its own, summed per document (``strata``: the domain of each row;
    ``prefix``: blocks shared with a model scored before, :mod:`overrep.model.prefix`)."""
    return by_document(row_token_nll(model, rows, desc=desc, progress=progress, prefix=prefix), units, strata)


def row_strata(components: list[dict] | None, rows_key: str, n: int) -> tuple[torch.Tensor, list[str]]:
    """The domain index of each of ``n`` rows of a mixture (``rows_key``: ``test_rows`` or
    ``validation_rows`` of ``info["components"]``), and the domains' names."""
    strata = torch.zeros(n, dtype=torch.long)
    names = []
    for i, c in enumerate(components or []):
        a, b = c[rows_key]
        strata[a:b] = i
        names.append(c["source"])
    return strata, names
