"""Tiny randomly initialised models of every supported architecture, built in code."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, BambaConfig, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          NemotronHConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

from overrep.data.tokenizer import train_bpe_tokenizer

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=True)


def tiny_config(arch: str):
    if arch == "llama":
        return LlamaConfig(**COMMON)
    if arch == "mistral":
        return MistralConfig(**{**COMMON, "sliding_window": 8})
    if arch == "qwen2":
        return Qwen2Config(**{**COMMON, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3})
    if arch == "qwen3":
        return Qwen3Config(**{**COMMON, "head_dim": 8})
    if arch == "gemma3":
        return Gemma3TextConfig(**{**COMMON, "head_dim": 8, "sliding_window": 8,
                                   "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2})
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**{**COMMON, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 16, "decoder_sparse_step": 2, "mlp_only_layers": [0]})
    if arch == "nemotron_h":  # hybrid: one part per block, M = Mamba-2, * = attention, - = MLP
        return NemotronHConfig(**{**COMMON, "head_dim": 8, "hybrid_override_pattern": HYBRID_PATTERN,
                                  "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8,
                                  "conv_kernel": 4, "chunk_size": 8, "bos_token_id": None, "eos_token_id": 1,
                                  "pad_token_id": 0})
    if arch == "bamba":  # hybrid: Mamba-2 or attention, plus a gated MLP, in every block
        return BambaConfig(**{**COMMON, "attn_layer_indices": [1, 4], "mamba_n_heads": 4, "mamba_d_head": 8,
                              "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 8,
                              "mamba_expand": 1})
    raise ValueError(arch)


HYBRID_PATTERN = "M*-M-*"
#: hybrids are tested in test_hybrid.py (their blocks lack parts the ARCHS tests look at)
HYBRIDS = ["nemotron_h", "bamba"]
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe"]


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg._attn_implementation = "eager"
    if arch == "qwen3_moe":  # the reference loop, so that results are bit-comparable
        cfg._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def tiny_ids(batch: int = 2, seq: int = 16, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def tiny_tokenizer(texts: list[str], vocab_size: int = 300):
    """A small byte-level BPE tokenizer trained in code on ``texts``."""
    return train_bpe_tokenizer(texts, vocab_size)


def make_tiny_model_dir(path, texts: list[str], arch: str = "llama", seed: int = 0):
    """Save a tiny random ``arch`` model plus a trained tokenizer as a HF folder."""
    tok = tiny_tokenizer(texts)
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg.vocab_size = len(tok)
    cfg.eos_token_id = cfg.pad_token_id = tok.eos_token_id
    cfg.bos_token_id = None
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


WORDS = ("alpha beta gamma delta river mountain city music science history language animal planet "
         "ocean forest energy system theory").split()


def corpus(n_docs: int = 300) -> list[str]:
    g = torch.Generator().manual_seed(0)
    docs = []
    for d in range(n_docs):
        idx = torch.randint(0, len(WORDS), (40,), generator=g).tolist()
        docs.append(f"Document {d}. " + " ".join(WORDS[i] for i in idx) + ".")
    return docs


def make_assets(root):
    """A corpus file and a tiny llama folder (with a trained tokenizer) under ``root``."""
    docs = corpus()
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    make_tiny_model_dir(root / "tiny-llama", docs)
    return root


def tiny_cfg(assets: Path, out: Path, **over):
    """A run configuration for the tiny assets; ``section__field=value`` overrides."""
    from overrep.app.config import RunConfig

    base = {
        "model": {"source": str(assets / "tiny-llama")},
        "prune": {"remove": "3-4"},
        # final_block: the paper's module on this mask (blocks 2 and 5, ending at the final norm),
        # the layout with the most moving parts; the run default stops before block 5
        "recovery": {"steps": 8, "batch_size": 4, "checkpoint_every": 2, "eval_every": 4, "lr": 1e-3,
                     "final_block": True},
        "data": {"source": str(assets / "corpus.jsonl"), "seq_len": 32, "train_sequences": 24,
                 "heldout_sequences": 4, "validation_sequences": 4},
        "cache": {"dir": str(out.parent / "cache")},
        "eval": {"latency_tokens": 4, "domain_sequences": 4, "lambada_passages": 8, "generation_prompts": 2,
                 "generation_tokens": 4},
        "output": str(out),
    }
    for key, value in over.items():
        section, field = key.split("__")
        base[section][field] = value
    return RunConfig.load(overrides=base)


def run_killed_at(monkeypatch, cfg, step: int) -> None:
    """Run ``cfg`` and kill it (no graceful checkpoint, like ``kill -9``) as it starts ``step``."""
    import pytest

    from overrep.app.pipeline import Pipeline
    from overrep.recovery.trainer import Trainer

    original = Trainer.batch_indices

    def dies(self, at):
        if at == step:
            raise RuntimeError("simulated kill -9")
        return original(self, at)

    monkeypatch.setattr(Trainer, "batch_indices", dies)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            Pipeline(cfg, progress=False).run()
    finally:
        monkeypatch.setattr(Trainer, "batch_indices", original)


class LinearModule(torch.nn.Module):
    """The least a layer-wise objective can train: a 4 -> 4 linear map with no annealed
    activation and no final norm (objective and trainer tests that need no model)."""

    activation = None
    norm = None

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h, ctx):
        return self.lin(h)
