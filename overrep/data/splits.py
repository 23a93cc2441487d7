"""Three splits of a data source, disjoint by document: test, validation and train.

* **test** -- what reports score, and nothing else reads: the first documents of a seeded
  shuffle, just enough to fill the test rows;
* **validation** -- what every choice reads (``recovery.keep_best``, a time budget's
  refit, a layer-wise validation loss, any comparison used to pick a default): the next
  documents of the shuffle;
* **train** -- the rest, less any document whose text equals a test or validation one.

A corpus published with official sections (Penn Treebank: sections 0-20 / 21-22 /
23-24, see :func:`overrep.data.documents.official_sections`) takes each split from its
own section instead, so no test sentence shares an article with a training sentence.

Next to the test and validation rows come their *units*: for every token, the document
it belongs to (numbered across the sources of a mixture), so an interval can resample
whole documents (:mod:`overrep.eval.intervals`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ..errors import OverRepError
from .documents import load_documents, official_sections
from ..memo import tensor_digest
from .packing import _eos_id, _pack, _permutation

logger = logging.getLogger(__name__)


class Splits(NamedTuple):
    """Packed rows of one data source: ``train``, ``test`` (what reports score; never read to
    train or choose), ``validation`` (what choices read; ``[0, seq_len]`` when none were
    asked for), ``info`` (counts and fingerprints) and ``units`` (``{"test", "validation"}``:
    the document of every token, ``[N, seq_len]`` each)."""

    train: torch.Tensor
    test: torch.Tensor
    validation: torch.Tensor
    info: dict
    units: dict


def _shuffled(docs: list[str], seed: int) -> list[str]:
    return [docs[i] for i in _permutation(len(docs), seed)]


def _rows(docs: list[str], tokenizer, seq_len: int, rows: int, what: str, source: str, progress: bool):
    """``rows`` rows packed from the head of ``docs``: ``(rows, documents used, units)``."""
    if rows < 1:
        return torch.empty(0, seq_len, dtype=torch.long), 0, torch.empty(0, seq_len, dtype=torch.long)
    try:
        packed, used, units = _pack(docs, tokenizer, seq_len, rows, progress, units=True)
    except OverRepError:
        packed = torch.empty(0, seq_len)
    if packed.shape[0] < rows:
        raise OverRepError(f"data source '{source}' yields only {packed.shape[0]} {what} sequences of {seq_len} "
                           f"tokens, fewer than the {rows} asked for (data.{what}_sequences)"
                           if what != "test" else
                           f"data source '{source}' yields only {packed.shape[0]} sequences of {seq_len} tokens, "
                           f"fewer than the {rows} test ones asked for (data.heldout_sequences)")
    return packed, used, units


def split_source(source: str, tokenizer, *, seq_len: int, train_sequences: int, test_sequences: int,
                 validation_sequences: int = 0, seed: int = 42, text_field: str = "text",
                 limit_documents: int | None = None, progress: bool = True) -> Splits:
    """One source (not a mixture) split three ways by document and packed (module docstring)."""
    sections = official_sections(source)
    if sections is not None:
        train_pool = _shuffled(sections["train"], seed)
        if limit_documents is not None:
            train_pool = train_pool[:limit_documents]
        test_pool, val_pool = _shuffled(sections["test"], seed), _shuffled(sections["validation"], seed)
        documents, how = sum(len(v) for v in sections.values()), "official sections"
    else:
        docs = load_documents(source, limit=limit_documents, text_field=text_field, seed=seed)
        if len(docs) < 2:
            raise OverRepError(f"data source '{source}' holds {len(docs)} document; a split needs at least 2")
        test_pool = _shuffled(docs, seed)
        documents, how = len(docs), "documents shuffled"
    test, n_test, test_units = _rows(test_pool, tokenizer, seq_len, test_sequences, "test", source, progress)
    if sections is None:
        val_pool = test_pool[n_test:]
    validation, n_val, val_units = _rows(val_pool, tokenizer, seq_len, validation_sequences, "validation", source,
                                         progress)
    if sections is None:
        train_pool = val_pool[n_val:]
    held = set(test_pool[:n_test]) | set(val_pool[:n_val])
    train_docs = [d for d in train_pool if d not in held]
    if len(train_docs) < len(train_pool):
        logger.info("data %s: dropped %d training documents that repeat test or validation text", source,
                    len(train_pool) - len(train_docs))
    if not train_docs:
        raise OverRepError(f"data source '{source}' has no documents left to train on after {n_test} test and "
                           f"{n_val} validation documents; use a larger corpus or fewer held-out rows")
    try:
        train, train_used = _pack(train_docs, tokenizer, seq_len, train_sequences, progress)
    except OverRepError:
        train, train_used = torch.empty(0, seq_len, dtype=torch.long), len(train_docs)
    if train.shape[0] < train_sequences:
        raise OverRepError(
            f"data source '{source}' yields {train.shape[0]} training sequences of {seq_len} tokens after "
            f"holding out {test_sequences} test and {validation_sequences} validation ones, but "
            f"{train_sequences} were asked for; ask for at most {train.shape[0]} or use a larger corpus")
    info = {
        "source": source, "seed": seed, "seq_len": seq_len, "text_field": text_field,
        "limit_documents": limit_documents, "split": how, "documents": documents,
        "train_documents": len(train_docs), "train_documents_used": train_used,
        "validation_documents": n_val, "test_documents": n_test,
        "train_sequences": int(train.shape[0]), "validation_sequences": int(validation.shape[0]),
        "test_sequences": int(test.shape[0]), "train_tokens": int(train.numel()),
        "validation_tokens": int(validation.numel()), "test_tokens": int(test.numel()),
        "eos_token_id": _eos_id(tokenizer), "train_fingerprint": tensor_digest(train),
        "validation_fingerprint": tensor_digest(validation), "test_fingerprint": tensor_digest(test),
    }
    logger.info("data %s (%s): %d train, %d validation, %d test rows of %d tokens from %d / %d / %d documents",
                source, how, info["train_sequences"], info["validation_sequences"], info["test_sequences"],
                seq_len, train_used, n_val, n_test)
    return Splits(train, test, validation, info, {"test": test_units, "validation": val_units})


def _shares(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def split_mixture(parts: list[str], tokenizer, *, seq_len: int, train_sequences: int, test_sequences: int,
                  validation_sequences: int, seed: int, text_field: str, limit_documents: int | None,
                  progress: bool) -> Splits:
    """Every source split on its own (equal shares of each split's rows), then joined.

    Test and validation rows stay grouped by source (``info["components"][i]["test_rows"]``
    and ``["validation_rows"]``), so a figure per domain costs nothing extra; training rows
    are shuffled together. Units are numbered across the sources.
    """
    if train_sequences < len(parts) or test_sequences < len(parts):
        raise OverRepError(f"a mixture of {len(parts)} sources needs at least {len(parts)} train and test rows")
    got, components, rows, offset = [], [], [0, 0], 0
    for part, n_train, n_test, n_val in zip(parts, _shares(train_sequences, len(parts)),
                                            _shares(test_sequences, len(parts)),
                                            _shares(validation_sequences, len(parts))):
        s = split_source(part, tokenizer, seq_len=seq_len, train_sequences=n_train, test_sequences=n_test,
                         validation_sequences=n_val, seed=seed, text_field=text_field,
                         limit_documents=limit_documents, progress=progress)
        units = {k: u + offset for k, u in s.units.items()}
        offset = 1 + max([offset - 1] + [int(u.max()) for u in units.values() if u.numel()])
        got.append((s, units))
        components.append({"source": part, "split": s.info["split"], "train_sequences": n_train,
                           "test_sequences": n_test, "validation_sequences": s.info["validation_sequences"],
                           "test_rows": [rows[0], rows[0] + n_test],
                           "validation_rows": [rows[1], rows[1] + s.info["validation_sequences"]],
                           "test_documents": s.info["test_documents"],
                           "validation_documents": s.info["validation_documents"],
                           **{f"{k}_fingerprint": s.info[f"{k}_fingerprint"] for k in ("train", "validation", "test")}})
        rows = [rows[0] + n_test, rows[1] + s.info["validation_sequences"]]
    order = torch.randperm(train_sequences, generator=torch.Generator().manual_seed(seed))
    train = torch.cat([s.train for s, _ in got])[order]
    test, validation = torch.cat([s.test for s, _ in got]), torch.cat([s.validation for s, _ in got])
    units = {k: torch.cat([u[k] for _, u in got]) for k in ("test", "validation")}
    info = {"source": "+".join(parts), "seed": seed, "seq_len": seq_len, "text_field": text_field,
            "limit_documents": limit_documents, "components": components,
            "train_sequences": int(train.shape[0]), "validation_sequences": int(validation.shape[0]),
            "test_sequences": int(test.shape[0]), "train_tokens": int(train.numel()),
            "validation_tokens": int(validation.numel()), "test_tokens": int(test.numel()),
            "eos_token_id": _eos_id(tokenizer), "train_fingerprint": tensor_digest(train),
            "validation_fingerprint": tensor_digest(validation), "test_fingerprint": tensor_digest(test)}
    return Splits(train, test, validation, info, units)


def _held_out(info: dict) -> dict[str, dict]:
    """Per source of a split's ``info``: how its documents were split and how many of the
    shuffle's first documents the test and validation rows hold."""
    parts = info.get("components") or [info]
    return {c["source"]: {"split": c.get("split"), "seed": info.get("seed"), "limit": info.get("limit_documents"),
                          "held": (c.get("test_documents"), c.get("validation_documents"))} for c in parts}


def check_held_out_by(scored: dict, trained: dict, trained_name: str = "the other run") -> None:
    """Refuse unless no document behind ``scored``'s test and validation rows is among the
    training documents of ``trained`` (both a split's ``info``).

    A source split by shuffle holds out its first test + validation documents, so another
    split of the same source, seed and document limit holding out at least as many trains
    on none of them; a source with official sections (Penn Treebank) scores sections no
    split trains on; a source ``trained`` does not use is unseen by it.
    """
    mine, theirs = _held_out(scored), _held_out(trained)
    for source, s in mine.items():
        t = theirs.get(source)
        if t is None or s["split"] == "official sections":
            continue
        if None in s["held"] or None in t["held"]:
            raise OverRepError(f"cannot tell which documents of '{source}' {trained_name} held out (its split "
                               "predates the counts); rerun it")
        if (t["seed"], t["limit"]) != (s["seed"], s["limit"]):
            raise OverRepError(f"{trained_name} shuffled '{source}' with another seed or document limit: it may "
                               "train on the documents these rows hold")
        if sum(t["held"]) < sum(s["held"]):
            raise OverRepError(f"{trained_name} held out the first {sum(t['held'])} documents of '{source}', these "
                               f"rows come from the first {sum(s['held'])}: it trained on some of them (give it "
                               "at least as many test and validation rows of that source)")
