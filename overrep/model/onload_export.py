"""Saving an onloaded model (:mod:`overrep.model.onload`) without ever holding it whole.

``save_pretrained`` needs every tensor in memory; a pruned model whose untrained blocks are
lazy is written here instead, block by block, into safetensors shards of at most
``shard_bytes`` with the ``model.safetensors.index.json`` that ``from_pretrained`` reads:
a lazy block's tensors are read from the source checkpoint under its new (compact) index,
a real block's and the tensors outside the blocks are the model's own. Peak memory: one
shard being written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .arch import decoder_layers
from .onload import SOURCE_ATTR, is_lazy, onload_state
from .placement import layer_prefix

SHARD_BYTES = 1 << 30


def _named_tensors(model: nn.Module):
    """``(name, tensor)`` of the model's state, lazy blocks read one at a time."""
    state = onload_state(model)
    prefix = layer_prefix(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if name.startswith(prefix + ".") or (tied and name.startswith("lm_head.")):
            continue
        yield name, t
    for j, block in enumerate(decoder_layers(model)):
        own = block.state_dict()
        if is_lazy(block):
            read = state.block_tensors(getattr(block, SOURCE_ATTR), block)
            own = {k: read.get(k, v) for k, v in own.items()}
        for k, v in own.items():
            yield f"{prefix}.{j}.{k}", v


def save_onloaded(model: nn.Module, folder: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Weights (sharded safetensors + index) and config of ``model`` into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    files: list[str] = []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    for name, t in _named_tensors(model):
        if t.device.type == "meta":
            raise ValueError(f"tensor {name} has no weights to save")
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            flush()
        shard[name] = t.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    flush()
    renamed = {}  # final names: model-00001-of-0000N.safetensors, as save_pretrained writes them
    for i, name in enumerate(files, 1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        (folder / name).rename(folder / final)
        renamed[name] = final
    index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
