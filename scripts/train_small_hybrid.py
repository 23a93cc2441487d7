"""Train a small hybrid Mamba-attention model (transformers' Nemotron-H) from scratch on the
embedded text, so that hybrid pruning and recovery can be compared on a model that has
learned something (a random model's perplexity is the vocabulary size, whatever recovery does).

    python scripts/train_small_hybrid.py OUT_DIR [--steps 600] [--seed 0]

Writes a standard Hugging Face folder (config, safetensors, tokenizer) that ``overrep run
--model OUT_DIR`` and ``overrep compare`` load, plus ``training.json`` with the loss curve
and the held-out perplexity. The tokenizer is a 4,096-token byte-level BPE trained on the
training documents (the embedded model's 49,152-token vocabulary would spend most of a
small model's parameters and steps on the embedding). Layer pattern: 12 one-part blocks,
``M-M*-M-M*-M-`` (M Mamba-2, * attention, - MLP), hidden size 256: about 6.5M parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, NemotronHConfig

from overrep.data.documents import load_documents
from overrep.data.text import mixture_parts, token_splits
from overrep.data.tokenizer import train_bpe_tokenizer
from overrep.model.perplexity import perplexity

SOURCE = "embedded+c4+ptb-train"
PATTERN = "M-M*-M-M*-M-"


def config(vocab: int, eos: int) -> NemotronHConfig:
    return NemotronHConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=len(PATTERN),
        hybrid_override_pattern=PATTERN, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        mamba_num_heads=8, mamba_head_dim=64, n_groups=1, ssm_state_size=32, conv_kernel=4, chunk_size=64,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos,
        pad_token_id=eos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    docs = [d for part in mixture_parts(SOURCE) for d in load_documents(part, seed=a.seed)]
    tok = train_bpe_tokenizer(docs, a.vocab)
    train_ids, heldout_ids, _, info, _ = token_splits(SOURCE, tok, seq_len=a.seq_len, train_sequences=4200,
                                                   test_sequences=64, seed=a.seed, progress=False)
    model = AutoModelForCausalLM.from_config(config(len(tok), tok.eos_token_id), dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warm = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps))))
    g = torch.Generator().manual_seed(a.seed)
    log, t0 = [], time.perf_counter()
    model.train()
    for step in range(1, a.steps + 1):
        rows = torch.randint(0, train_ids.shape[0], (a.batch,), generator=g)
        x = train_ids[rows]
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == a.steps:
            rate = step / (time.perf_counter() - t0)
            rec = {"step": step, "loss": loss.item(), "seconds": time.perf_counter() - t0}
            if step % 250 == 0 or step == a.steps:
                rec["heldout_ppl"] = perplexity(model, heldout_ids, progress=False)
            log.append(rec)
            print(f"step {step}/{a.steps} loss {loss.item():.3f} {rate:.2f} steps/s "
                  f"eta {(a.steps - step) / rate:.0f} s" + (f" held-out ppl {rec['heldout_ppl']:.1f}"
                                                             if "heldout_ppl" in rec else ""), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    summary = {"source": SOURCE, "pattern": PATTERN, "parameters": n_params, "steps": a.steps, "batch": a.batch,
               "seq_len": a.seq_len, "lr": a.lr, "seed": a.seed, "heldout_ppl": log[-1]["heldout_ppl"],
               "seconds": time.perf_counter() - t0, "log": log}
    (a.out / "training.json").write_text(json.dumps(summary, indent=1))
    print(f"saved {a.out} ({n_params / 1e6:.1f}M parameters), held-out perplexity {summary['heldout_ppl']:.1f}")


if __name__ == "__main__":
    main()
