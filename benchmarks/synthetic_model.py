"""A LLaMA-shaped model with random weights, written tensor by tensor: a model larger than
the memory a run is given, for proving that ``cache.teacher: stream`` never holds it whole.

The safetensors files are written by hand (8-byte header length, JSON header, raw bytes),
one tensor at a time and each in chunks of rows, so writing a 4 GB model needs tens of MB;
``safetensors.torch.save_file`` would need a whole shard in memory. The tokenizer is the
embedded model's (SmolLM2, vocabulary 49,152), so any data source works.

Run:   .venv/bin/python benchmarks/synthetic_model.py /tmp/synthetic-llama            (~3.6 GB, bf16)
       .venv/bin/python benchmarks/synthetic_model.py DIR --layers 8 --hidden 512     (a small one)
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import torch

CHUNK = 1 << 22  # elements generated at a time
DTYPES = {"bfloat16": (torch.bfloat16, "BF16", 2), "float32": (torch.float32, "F32", 4)}


def llama_config(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": hidden // heads, "num_hidden_layers": layers, "vocab_size": vocab,
            "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False,
            "mlp_bias": False, "max_position_embeddings": 4096, "rope_theta": 10000.0, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": "bfloat16"}


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a LLaMA checkpoint, in the order transformers saves them."""
    h, i, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for j in range(c["num_hidden_layers"]):
        p = f"model.layers.{j}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def _write_tensor(f, name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> None:
    n = 1
    for s in shape:
        n *= s
    norm = name.endswith("norm.weight")
    std = 0.02 if "embed" in name or "lm_head" in name else (1.0 / shape[-1]) ** 0.5  # unit-scale outputs
    for start in range(0, n, CHUNK):
        k = min(CHUNK, n - start)
        t = torch.ones(k) if norm else torch.randn(k, generator=gen) * std
        f.write(t.to(dtype).view(torch.uint8).numpy().tobytes())


def write_model(folder: Path, config: dict, shard_bytes: int = 1 << 30, dtype: str = "bfloat16", seed: int = 0) -> int:
    """Write ``config.json``, safetensors shards of at most ``shard_bytes`` and their index into
    ``folder``; returns the bytes of weights written."""
    torch_dtype, code, width = DTYPES[dtype]
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(config):
        nbytes = width * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in tensors:
            nbytes = width * int(torch.Size(shape).numel())
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        with open(folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, shape in tensors:
                _write_tensor(f, name, shape, torch_dtype, gen)
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=1) + "\n")
    return total


def copy_embedded_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    from overrep.model.onload import snapshot_folder

    src, _ = snapshot_folder("embedded")  # converts the embedded model once if needed
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    ap.add_argument("--shard-mb", type=int, default=1024)
    a = ap.parse_args()
    config = llama_config(a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, vocab=49152)
    total = write_model(a.folder, config, a.shard_mb << 20, a.dtype)
    copy_embedded_tokenizer(a.folder)
    print(json.dumps({"folder": str(a.folder), "weight_bytes": total,
                      "params": total // DTYPES[a.dtype][2], "layers": a.layers}))


if __name__ == "__main__":
    main()
