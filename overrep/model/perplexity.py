"""Perplexity of a causal language model on packed token rows.

It lives with the model layer because training code needs it too (held-out perplexity
while a recovery trains) and evaluation re-exports it (:mod:`overrep.eval.measure`).
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, *, batch_size: int = 4, desc: str = "perplexity",
               progress: bool = True) -> float:
    """exp(mean next-token cross-entropy) over packed rows ``ids`` ``[N, T]``.

    Every row is scored on its own (no context carried across rows): ``N * (T - 1)``
    predicted tokens.
    """
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for i in tqdm(range(0, ids.shape[0], batch_size), desc=desc, unit="batch", disable=not progress,
                  dynamic_ncols=True, leave=False):
        x = ids[i:i + batch_size].to(model.device)
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                reduction="sum")
        total_nll += nll.item()
        total_tokens += x[:, 1:].numel()
    return math.exp(total_nll / total_tokens)
