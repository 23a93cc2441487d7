"""Saving an onloaded model (:mod:`overrep.model.onload`) without ever holding it whole.

``save_pretrained`` needs every tensor in memory; a pruned model whose untrained blocks are
lazy is written here instead, block by block, into safetensors shards of at most
``shard_bytes`` with the ``model.safetensors.index.json`` that ``from_pretrained`` reads:
a lazy block's tensors are read from the source checkpoint under its new (compact) index,
a real block's and the tensors outside the blocks are the model's own. Peak memory: one
block being written.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import nn

from .arch import decoder_layers
from .onload import SOURCE_ATTR, is_lazy, onload_state
from .placement import layer_prefix

SHARD_BYTES = 1 << 30


_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
          torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8"}


def _named_tensors(model: nn.Module, read: bool):
    """``(name, tensor)`` of the model's state in save order; a lazy block's matrices are its
    meta tensors (``read=False``: shapes only) or read from the source checkpoint, one block
    at a time."""
    state = onload_state(model)
    prefix = layer_prefix(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if name.startswith(prefix + ".") or (tied and name.startswith("lm_head.")):
            continue
        yield name, t
    for j, block in enumerate(decoder_layers(model)):
        own = block.state_dict()
        if read and is_lazy(block):
            got = state.block_tensors(getattr(block, SOURCE_ATTR), block)
            own = {k: got.get(k, v) for k, v in own.items()}
        for k, v in own.items():
            yield f"{prefix}.{j}.{k}", v


def _header(entries: list[tuple[str, torch.Tensor]]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in entries:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def save_onloaded(model: nn.Module, folder: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Weights (safetensors shards + index) and config of ``model`` into ``folder``.

    The shards are written by hand: the header from the tensors' shapes (a lazy block's meta
    tensors have them), then each tensor's bytes as it is read -- ``safetensors.torch.save_file``
    would first copy a whole shard into memory."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = total = 0
    for name, t in _named_tensors(model, read=False):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
        total += nbytes
    files = {name: f"model-{i:05d}-of-{len(shards):05d}.safetensors"
             for i, shard in enumerate(shards, 1) for name, _ in shard}
    handles = {}
    try:
        for i, shard in enumerate(shards, 1):
            handles[i] = open(folder / files[shard[0][0]], "wb")
            handles[i].write(_header(shard))
        shard_of = {name: i for i, shard in enumerate(shards, 1) for name, _ in shard}
        for name, t in _named_tensors(model, read=True):  # the same order as the headers
            if t.device.type == "meta":
                raise ValueError(f"tensor {name} has no weights to save")
            data = t.detach().to("cpu").contiguous().reshape(-1)
            handles[shard_of[name]].write(memoryview(data.view(torch.uint8).numpy()))
    finally:
        for f in handles.values():
            f.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(files.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
