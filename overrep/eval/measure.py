"""Held-out perplexity, generation latency and parameter counts."""

from __future__ import annotations

import math
import time

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


@torch.no_grad()
def generation_latency(model, tokenizer, prompt: str, new_tokens: int = 32) -> dict:
    """Greedy generation of ``new_tokens`` tokens: seconds per token and the text."""
    model.eval()
    enc = tokenizer(prompt, return_tensors="pt").to(model.device)
    model.generate(**enc, max_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    dt = time.perf_counter() - t0
    generated = out.shape[1] - enc["input_ids"].shape[1]
    return {"seconds_per_token": dt / max(1, generated), "tokens": generated,
            "text": tokenizer.decode(out[0], skip_special_tokens=True)}
