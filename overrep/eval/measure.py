"""Generation latency (perplexity: :mod:`overrep.model.perplexity`)."""

from __future__ import annotations

import time

import torch

from ..model.placement import input_device


@torch.no_grad()
def generation_latency(model, tokenizer, prompt: str, new_tokens: int = 32) -> dict:
    """Greedy generation of ``new_tokens`` tokens: seconds per token and the text."""
    model.eval()
    enc = tokenizer(prompt, return_tensors="pt").to(input_device(model))
    model.generate(**enc, max_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    dt = time.perf_counter() - t0
    generated = out.shape[1] - enc["input_ids"].shape[1]
    return {"seconds_per_token": dt / max(1, generated), "tokens": generated,
            "text": tokenizer.decode(out[0], skip_special_tokens=True)}
