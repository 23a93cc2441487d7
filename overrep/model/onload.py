"""Models that never need to fit: sequential onloading from safetensors (``cache.teacher: stream``).

As llm-compressor's and NVIDIA ModelOpt's layer-wise calibration do, an *onloaded* model
is a real ``transformers`` model whose decoder blocks hold no weights until they run:

* built with empty weights (``accelerate.init_empty_weights``); the tensors outside the
  blocks (embeddings, final norm, head) and every block's small 1-D tensors (norm gains,
  biases: what the losses read off the dense model) are read from the checkpoint;
* every other block is *lazy*: a forward pre-hook reads its matrices from the memory-mapped
  safetensors shards (``safe_open``) onto the model's device, and a forward hook swaps them
  back for meta tensors. At most one lazy block holds weights at a time; a backward that
  needs them keeps them alive through autograd only as long as it needs them;
* :func:`onloaded_copy` builds the pruned model the same way, with real weights only in the
  blocks recovery trains (:func:`trained_blocks`), so neither side is ever whole in memory.

Whatever reads the dense model through its forward (criteria, perplexity, the live
teacher, top-K logits) reads an onloaded one unchanged, one block at a time, re-reading
each block per forward; the feature cache uses :func:`overrep.model.streaming.stream_features`,
which reads each block once for all rows. Export is :mod:`overrep.model.onload_export`.

Peak memory: embeddings and head, one block, the trained blocks and their optimiser state,
and the activations in flight, whatever the number of blocks (``benchmarks/bench_memory.py``).
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import re

import torch
from torch import nn

from ..errors import OverRepError, first_line
from .arch import decoder_layers
from .streaming import LAYERS_PREFIX, _Checkpoint, _give_freed_memory_back, named_like

log = logging.getLogger(__name__)

SOURCE_ATTR = "_overrep_onload_prefix"  # on a lazy block: its tensors' name prefix in the checkpoint
STATE_ATTR = "_overrep_onload"  # on an onloaded model: its _Onload
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


class _Onload:
    """What an onloaded model reads from: the checkpoint, the folder, dtype and device."""

    def __init__(self, folder: pathlib.Path, ckpt: _Checkpoint, dtype: torch.dtype, device: torch.device):
        self.folder, self.ckpt, self.dtype, self.device = folder, ckpt, dtype, torch.device(device)
        self.resident: nn.Module | None = None  # the lazy block whose weights are loaded now

    def block_tensors(self, prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors of the block stored under ``prefix``, named as ``module``'s
        parameters (per-expert tensors fused as transformers fuses them)."""
        names = [n for n in self.ckpt.where if n.startswith(prefix)]
        tensors = {n[len(prefix):]: t for n, t in self.ckpt.read(names, self.dtype).items()}
        return named_like(module, tensors, f"cannot onload {prefix.rstrip('.')}")


def is_onloaded(model: nn.Module) -> bool:
    return getattr(model, STATE_ATTR, None) is not None


def onload_state(model: nn.Module) -> _Onload:
    return getattr(model, STATE_ATTR)


def is_lazy(block: nn.Module) -> bool:
    return getattr(block, SOURCE_ATTR, None) is not None


def _set(module: nn.Module, name: str, value: torch.Tensor, trainable: bool = True) -> None:
    """A new parameter object (``trainable`` as ``from_pretrained`` leaves real weights; a
    lazy block's read weights never are)."""
    owner, _, attr = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target._parameters[attr] = nn.Parameter(value, requires_grad=trainable)


def _unload(block: nn.Module) -> None:
    """Meta tensors again for a lazy block's matrices (new objects: autograd keeps the old ones
    as long as a backward needs them)."""
    for name, p in list(block.named_parameters()):
        if p.dim() > 1 and p.device.type != "meta":
            _set(block, name, torch.empty_like(p, device="meta"), trainable=False)


def _make_lazy(block: nn.Module, prefix: str, state: _Onload) -> None:
    def load(module, args, kwargs):
        if state.resident is not None and state.resident is not module:
            _unload(state.resident)  # a forward stopped early (StopForward) left it loaded
        for name, t in state.block_tensors(prefix, module).items():
            if t.dim() > 1:
                _set(module, name, t.to(state.device), trainable=False)
        state.resident = module

    def unload(module, args, output):
        _unload(module)
        state.resident = None

    setattr(block, SOURCE_ATTR, prefix)
    block.register_forward_pre_hook(load, with_kwargs=True)
    block.register_forward_hook(unload)


def _skeleton(state: _Onload, config, real: set[int], attn_implementation: str,
              outside_from: nn.Module | None = None) -> nn.Module:
    """The model with real tensors outside the blocks and in the blocks ``real``; the other
    blocks lazy (their 1-D tensors real). ``outside_from``: a model whose tensors outside the
    blocks are shared rather than read again."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) computed for real
        model = AutoModelForCausalLM.from_config(config, dtype=state.dtype, attn_implementation=attn_implementation)
    ckpt = state.ckpt
    tied = bool(getattr(config, "tie_word_embeddings", False))
    outside = [n for n, _ in model.named_parameters() if not n.startswith(LAYERS_PREFIX)
               and not (tied and n.startswith("lm_head."))]
    absent = sorted(n for n in outside if n not in ckpt.where)
    if absent:
        raise OverRepError(f"cannot onload the model in {state.folder}: no tensors for {absent[:3]}")
    if outside_from is not None:
        for name in outside:
            _set(model, name, outside_from.get_parameter(name).data)
    else:
        for name, t in ckpt.read(outside, state.dtype, own=False).items():  # long-lived: one mapping a file
            _set(model, name, t.to(state.device))
    if tied:
        model.tie_weights()
    for j, block in enumerate(decoder_layers(model)):
        prefix = f"{LAYERS_PREFIX}{j}."
        if j in real:
            tensors = state.block_tensors(prefix, block)
        else:  # the small tensors only: the matrices are read as the block runs
            small = [prefix + n for n, p in block.named_parameters() if p.dim() <= 1]
            tensors = {n[len(prefix):]: t for n, t in ckpt.read([n for n in small if n in ckpt.where],
                                                                  state.dtype).items()}
            _make_lazy(block, prefix, state)
        for name, t in tensors.items():
            _set(block, name, t.to(state.device))
    for module in model.modules():  # buffers computed at construction on the CPU
        for k, b in module._buffers.items():
            if b is not None and b.device != state.device:
                module._buffers[k] = b.to(state.device)
    setattr(model, STATE_ATTR, state)
    return model.eval()


def snapshot_folder(spec: str | None) -> tuple[pathlib.Path, str]:
    """``(a folder of safetensors shards, kind)`` for a model spec: the embedded model's
    converted folder, a local folder, or a hub id's snapshot in the Hugging Face cache
    (downloaded when the hub is reachable; only the config, tokenizer and safetensors)."""
    from .loading import (EMBEDDED, _cached_conversion_valid, _looks_like_path, embedded_cache_path,
                          embedded_gguf_path, hub_reachable, load_model)

    if spec is None or spec == EMBEDDED:
        folder = embedded_cache_path()
        if not _cached_conversion_valid(folder, embedded_gguf_path()):
            load_model(EMBEDDED)  # converts the GGUF once into the cache (135M parameters)
        return folder, "embedded"
    if _looks_like_path(spec):
        path = pathlib.Path(spec).expanduser()
        if not path.is_dir():
            raise OverRepError(f"cache.teacher: stream reads a folder of safetensors files; '{spec}' is not a folder "
                               "(convert a .gguf with `overrep export` or use cache.teacher: model)")
        return path.resolve(), "local"
    from huggingface_hub import snapshot_download

    online = hub_reachable()
    try:
        return pathlib.Path(snapshot_download(spec, allow_patterns=_HUB_FILES, local_files_only=not online)), "hub"
    except Exception as error:  # hub errors come as many classes (offline, gated, missing)
        if not online:
            raise OverRepError(f"cannot reach the Hugging Face hub for '{spec}' and it is not in the local cache; "
                               "download it once online or pass a local folder") from None
        raise OverRepError(f"cannot download '{spec}' from the Hugging Face hub: {first_line(error)}") from None


def load_onloaded(spec: str | None, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  attn_implementation: str = "sdpa", real: set[int] = frozenset()):
    """``(model, tokenizer, info)`` like :func:`overrep.model.loading.load_model`, with every
    block not in ``real`` lazy; ``info["folder"]`` is the safetensors folder read."""
    import time

    from transformers import AutoConfig, AutoTokenizer

    started = time.perf_counter()
    _give_freed_memory_back()
    folder, kind = snapshot_folder(spec)
    if not (folder / "config.json").is_file():
        raise OverRepError(f"'{folder}' is not a Hugging Face model folder (it has no config.json)")
    config = AutoConfig.from_pretrained(folder)
    ckpt = _Checkpoint(folder)
    ckpt.rename(config.model_type)
    model = _skeleton(_Onload(folder, ckpt, dtype, torch.device(device)), config, set(real), attn_implementation)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise OverRepError(f"the model folder '{folder}' has no usable tokenizer ({error})") from None
    info = {"source": str(spec if kind == "hub" else folder), "kind": kind, "folder": str(folder),
            "num_parameters": int(model.num_parameters()), "architecture": type(model).__name__,
            "num_layers": int(getattr(config, "num_hidden_layers", 0) or 0),
            "hidden_size": int(getattr(config, "hidden_size", 0) or 0),
            "dtype": str(dtype).removeprefix("torch."), "load_seconds": round(time.perf_counter() - started, 2),
            "onloaded": True}
    log.info("onloaded %s (%.1fM parameters, blocks read as they run) from %s", spec, info["num_parameters"] / 1e6,
             folder)
    return model, tokenizer, info


def onloaded_copy(dense: nn.Module, real: set[int], share_outside: bool = False) -> nn.Module:
    """A fresh onloaded model of ``dense``'s checkpoint whose blocks ``real`` hold their weights
    (the blocks a pruned model trains; the others are read as they run). ``share_outside``:
    the embeddings, final norm and head are ``dense``'s own tensors (for a recovery that never
    trains them: one copy of the largest matrices instead of two)."""
    import copy

    state = onload_state(dense)
    fresh = _Onload(state.folder, state.ckpt, state.dtype, state.device)
    attn = getattr(dense.config, "_attn_implementation", None) or "sdpa"
    model = _skeleton(fresh, copy.deepcopy(dense.config), set(real), attn, dense if share_outside else None)
    model.generation_config = copy.deepcopy(dense.generation_config)
    return model


def pruned_copy(dense: nn.Module, plan, family: str, replaced=()) -> nn.Module:
    """The model a pruned model is cut from: real weights in :func:`trained_blocks` only, the
    embeddings and head shared with ``dense`` where the recovery never trains them."""
    real = trained_blocks(plan, family, len(decoder_layers(dense)), replaced)
    return onloaded_copy(dense, real, share_outside=family == "layerwise")


def reload(folder: pathlib.Path, like: nn.Module, device: torch.device) -> nn.Module:
    """An exported folder loaded as ``like`` is held: onloaded, or whole by ``from_pretrained``."""
    if is_onloaded(like):
        return load_onloaded(str(folder), dtype=like.dtype, device=device)[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=like.dtype).to(device).eval()


def trained_blocks(plan, family: str, num_layers: int, replaced=()) -> set[int]:
    """The dense blocks a pruned model needs real weights in: a layer-wise method's recovery
    blocks and the blocks stitched from (and blocks a criterion rewrote); every kept block
    for the methods that train or adapt all of them."""
    kept = set(range(num_layers)) - set(plan.removed)
    if family != "layerwise":
        return kept | {s for g in plan.groups for s in g.stitch.values()}
    out = {i for g in plan.groups for i in g.module_layers} | set(replaced)
    return out | {s for g in plan.groups for s in g.stitch.values()} | {t for g in plan.groups for t in g.stitch}


def checkpoint_fingerprint(model: nn.Module, source: str) -> str:
    """Like :func:`overrep.model.runtime.model_fingerprint` for an onloaded model: source,
    config, and of every stored tensor its name, shape and first row, read as a slice."""
    from safetensors import safe_open

    state = onload_state(model)
    h = hashlib.sha256(source.encode())
    h.update(model.config.to_json_string(use_diff=False).encode())
    by_file: dict = {}
    for name, stored in sorted(state.ckpt.stored.items()):
        by_file.setdefault(state.ckpt.where[name], []).append((name, stored))
    for file in sorted(by_file):
        with safe_open(str(file), framework="pt") as f:
            for name, stored in by_file[file]:
                sl = f.get_slice(stored)
                shape = sl.get_shape()
                h.update(f"{name}{shape}".encode())
                first = sl[0:1] if len(shape) > 1 else sl[:4096]
                h.update(first.reshape(-1)[:4096].float().numpy().tobytes())
    return h.hexdigest()[:16]


def dense_block_index(block: nn.Module) -> int | None:
    """The checkpoint index of a lazy block (None: a block with real weights)."""
    prefix = getattr(block, SOURCE_ATTR, None)
    m = re.fullmatch(rf"{re.escape(LAYERS_PREFIX)}(\d+)\.", prefix or "")
    return int(m.group(1)) if m else None
