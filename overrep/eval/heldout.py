"""Held-out perplexity by domain: the training mixture's own held-out rows, grouped by
source, and text from domains the recovery never trained on.

Per-domain numbers cost nothing extra: every held-out row is scored once, and the overall
perplexity is the token-weighted combination of the domains' (all rows have one length).
"""

from __future__ import annotations

import math

import torch

from ..data.documents import load_documents
from ..data.packing import pack_documents
from ..data.documents import corpus_domain
from ..data.text import mixture_parts
from ..errors import OverRepError
from ..model.perplexity import perplexity


def unseen_domain_rows(names: str | None, tokenizer, *, training_source: str, seq_len: int, rows: int,
                       seed: int) -> dict[str, torch.Tensor]:
    """``rows`` packed rows of each named corpus (e.g. ``"ptb,lambada"``); a corpus that is
    part of the training source is refused (its text would not be unseen)."""
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
        out[name] = pack_documents(docs, tokenizer, seq_len, max_sequences=rows, progress=False)
    return out


def domain_perplexities(model, heldout: torch.Tensor, components: list[dict] | None,
                        unseen: dict[str, torch.Tensor], *, desc: str = "perplexity",
                        progress: bool = True) -> dict:
    """``{"all": ppl of heldout, "domains": {source: ppl}, "unseen": {name: ppl}}``."""
    groups = [(c["source"], heldout[c["heldout_rows"][0]:c["heldout_rows"][1]]) for c in components or []]
    if not groups:
        groups = [(None, heldout)]
    domains, log_sum, rows = {}, 0.0, 0
    for name, ids in groups:
        ppl = perplexity(model, ids, desc=f"{desc} {name or ''}".strip(), progress=progress)
        log_sum += math.log(ppl) * ids.shape[0]
        rows += ids.shape[0]
        if name is not None:
            domains[name] = ppl
    out = {"all": math.exp(log_sum / rows), "domains": domains}
    out["unseen"] = {name: perplexity(model, ids, desc=f"{desc} {name}", progress=progress)
                     for name, ids in unseen.items()}
    return out


def require_finite(ppl: dict, whose: str) -> None:
    """A one-line error when any perplexity of :func:`domain_perplexities` is NaN or infinite."""
    values = [("all rows", ppl["all"]), *ppl["domains"].items(), *ppl["unseen"].items()]
    bad = [(name, v) for name, v in values if not math.isfinite(v)]
    if bad:
        raise OverRepError(f"{whose} perplexity on {bad[0][0]} is {bad[0][1]}: its outputs are not finite")
