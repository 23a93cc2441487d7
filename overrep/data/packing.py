"""Documents split by document into training and held-out sets, and packed into token rows.

The split (:func:`split_documents`) is at the document level, so held-out text never
overlaps training text; each side is packed into rows of exactly ``seq_len`` tokens
(:func:`pack_documents`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..errors import OverRepError

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- splitting


def _permutation(n: int, seed: int) -> list[int]:
    """A seeded shuffle of ``range(n)``; shared by the split and the held-out sizing."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def _heldout_count(heldout: int | float, n: int) -> int:
    """Number of held-out documents: ``heldout`` itself if an int, else that share of ``n``."""
    if isinstance(heldout, bool) or not isinstance(heldout, (int, float)):
        raise OverRepError(f"heldout must be a document count or a fraction, got {heldout!r}")
    if isinstance(heldout, float):
        if not 0.0 < heldout < 1.0:
            raise OverRepError(f"a held-out fraction must lie in (0, 1), got {heldout}")
        count = max(1, round(heldout * n))
    else:
        count = heldout
    if not 0 <= count < n:
        raise OverRepError(f"cannot hold out {count} of {n} documents and keep some for training")
    return count


def split_documents(
    docs: list[str],
    *,
    heldout: int | float,
    seed: int = 42,
) -> tuple[list[str], list[str]]:
    """Split documents into ``(train, heldout)`` at the document level.

    The documents are shuffled with ``seed``; the first ``heldout`` of the shuffle (a
    count, or a fraction of ``len(docs)``) are held out, the rest train, in shuffled
    order. Training documents identical to a held-out one are dropped, so no held-out
    text is ever trained on.
    """
    count = _heldout_count(heldout, len(docs))
    order = _permutation(len(docs), seed)
    held = [docs[i] for i in order[:count]]
    held_texts = set(held)
    train = [docs[i] for i in order[count:] if docs[i] not in held_texts]
    dropped = len(docs) - count - len(train)
    if dropped:
        logger.info("dropped %d training documents that duplicate held-out ones", dropped)
    if not train:
        raise OverRepError("no training documents remain after removing duplicates of held-out ones")
    return train, held


# --------------------------------------------------------------------------- packing


def _eos_id(tokenizer) -> int:
    """The tokenizer's end-of-sequence id, used as the separator between documents."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise OverRepError("the tokenizer has no eos token to separate documents; set tokenizer.eos_token")
    return int(eos)


#: Documents longer than this many characters are tokenised piece by piece, so that a
#: huge document costs only the pieces the requested rows need (a 50 MB file is not
#: tokenised whole to fill a few rows). Pieces end at whitespace; documents shorter than
#: this are tokenised exactly as before.
PIECE_CHARS = 100_000


def _pieces(docs: Sequence[str]) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` for every document, long ones cut into pieces."""
    for doc in docs:
        start = 0
        while len(doc) - start > PIECE_CHARS:
            cut = doc.rfind(" ", start + PIECE_CHARS // 2, start + PIECE_CHARS)
            cut = start + PIECE_CHARS if cut < 0 else cut
            yield doc[start:cut], False
            start = cut
        yield doc[start:], True


def _batches(pieces: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    """Consecutive runs of ``pieces``: 16 long at first, doubling up to 512, and never much
    more than ``PIECE_CHARS`` characters.

    Small first batches keep a request for a few rows cheap; large later ones let the
    fast tokenizer parallelise over a whole corpus.
    """
    size, batch, chars = 16, [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if len(batch) == size or chars >= PIECE_CHARS:
            yield batch
            batch, chars, size = [], 0, min(size * 2, 512)
    if batch:
        yield batch


def _pack(
    docs: Sequence[str],
    tokenizer,
    seq_len: int,
    max_sequences: int | None,
    progress: bool,
    units: bool = False,
):
    """Pack ``docs`` into rows; returns ``(rows [N, seq_len], number of documents tokenised)``,
    and with ``units`` a third tensor ``[N, seq_len]``: the index in ``docs`` of the document
    each token belongs to (its eos included), which a bootstrap over documents resamples by."""
    if seq_len < 1:
        raise OverRepError(f"seq_len must be at least 1, got {seq_len}")
    if max_sequences is not None and max_sequences < 1:
        raise OverRepError(f"max_sequences must be at least 1, got {max_sequences}")
    eos = _eos_id(tokenizer)
    needed = None if max_sequences is None else max_sequences * seq_len
    ids: list[int] = []
    owner: list[int] = []  # with units: the document of every token in ids
    used, partial = 0, False  # documents tokenised (wholly, or partly when the rows filled up)
    with tqdm(total=len(docs), unit="doc", desc="tokenising", disable=not progress) as bar:
        for batch in _batches(_pieces(docs)):
            # verbose=False: documents longer than model_max_length are fine here, they
            # are cut into rows, so the "sequence too long" warning would only mislead.
            encoded = tokenizer([text for text, _ in batch], add_special_tokens=False, verbose=False,
                                return_attention_mask=False)["input_ids"]
            for row, (_, ends) in zip(encoded, batch):
                ids.extend(row)
                if units:
                    owner.extend([used] * (len(row) + ends))
                partial = not ends
                if ends:
                    ids.append(eos)  # after every document, so the next one starts after an eos
                    used += 1
                    bar.update(1)
                if needed is not None and len(ids) >= needed:
                    break
            bar.set_postfix(sequences=len(ids) // seq_len, refresh=False)
            if needed is not None and len(ids) >= needed:
                break
    used += partial
    rows = len(ids) // seq_len
    if max_sequences is not None:
        rows = min(rows, max_sequences)
    if rows < 1:
        raise OverRepError(
            f"{len(docs)} documents give only {len(ids)} tokens, fewer than one sequence of {seq_len}"
        )
    packed = torch.tensor(ids[:rows * seq_len], dtype=torch.long).view(rows, seq_len)
    if units:
        return packed, used, torch.tensor(owner[:rows * seq_len], dtype=torch.long).view(rows, seq_len)
    return packed, used


def pack_documents(
    docs: list[str],
    tokenizer,
    seq_len: int,
    *,
    max_sequences: int | None = None,
    progress: bool = True,
) -> torch.LongTensor:
    """Tokenise and pack documents into rows of exactly ``seq_len`` tokens.

    Each document is tokenised without special tokens and followed by the tokenizer's
    eos id; the stream is concatenated and cut into rows, the incomplete tail dropped.
    Tokenisation is lazy: it stops as soon as ``max_sequences`` rows exist.

    Returns:
        ``LongTensor [N, seq_len]`` with ``1 <= N <= max_sequences``.
    """
    packed, _ = _pack(docs, tokenizer, seq_len, max_sequences, progress)
    return packed
