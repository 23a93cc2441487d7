"""A teacher that does not have to fit: the dense model's features, one block at a time.

:func:`stream_features` gives what :func:`~overrep.model.hooks.teacher_features` gives
(per recovery group, the hidden state entering it and the one it must reproduce) for a
model that is never whole in memory. It reads the checkpoint's safetensors files lazily:

1. The model is built with empty weights (``accelerate.init_empty_weights``: parameters on
   the meta device, buffers such as rotary frequencies computed for real); only the
   parameters outside the decoder blocks (embeddings, final norm) are read from disk.
2. One forward pass per batch with every block replaced by a recorder gives the hidden
   state entering block 0 and the keyword arguments (masks, rotary embeddings) every block
   receives: the model's own code computes them, for every architecture alike.
3. Block by block, up to the last one a group needs: its weights are read from disk, all
   rows' hidden states go through it, the ones the groups need are kept, and its weights
   go back to the meta device before the next block is read.

Peak memory: the embeddings, one block, and the rows' hidden states (plus what is kept),
whatever the number of blocks. ``benchmarks/bench_streaming.py`` measures it on the
embedded model against holding the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import OverRepError
from .arch import decoder_layers, final_norm
from .hooks import NOT_CONTEXT, StopForward, run_hooked
from .surgery import RecoveryGroup

LAYERS_PREFIX = "model.layers."


class _Recorder(nn.Module):
    """Stands in for block ``i`` during the recording pass: keeps what it receives.

    It carries the real block's plain attributes (``layer_idx``, a hybrid's ``block_type``):
    some models' forward reads them off each block to pick its mask or cache."""

    def __init__(self, i: int, record: list, last: int, like: nn.Module | None = None):
        super().__init__()
        for k, v in (vars(like) if like is not None else {}).items():
            if not k.startswith("_") and k != "training" and isinstance(v, (str, int, float, bool)):
                setattr(self, k, v)
        self.i, self.record, self.last = i, record, last

    def forward(self, hidden_states, *args, **kwargs):
        self.record.append((hidden_states if self.i == 0 else None,
                            args, {k: v for k, v in kwargs.items() if k not in NOT_CONTEXT}))
        if self.i == self.last:
            raise StopForward
        return hidden_states


class _Checkpoint:
    """Tensor name -> safetensors file of a local Hugging Face folder, opened lazily.

    Names are the model's: a family that stores its tensors under other names (Nemotron-H
    saves ``backbone.*`` for ``model.*``) is read through transformers' own renaming rules
    for its ``model_type``, so ``where`` and :meth:`read` speak the model's names."""

    def __init__(self, folder: Path, model_type: str | None = None):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: folder / f for k, f in weight_map.items()}
        elif (folder / "model.safetensors").exists():
            from safetensors import safe_open

            file = folder / "model.safetensors"
            with safe_open(str(file), framework="pt") as f:
                self.where = {k: file for k in f.keys()}
        else:
            raise OverRepError(f"the streaming teacher reads safetensors files; {folder} has none")
        self.stored = {k: k for k in self.where}

    def rename(self, model_type: str | None) -> None:
        rules = _renamings(model_type)
        self.stored = {_model_key(k, rules): k for k in self.where}
        self.where = {k: self.where[stored] for k, stored in self.stored.items()}

    def read(self, names: list[str], dtype: torch.dtype, own: bool = True) -> dict[str, torch.Tensor]:
        """``names``' tensors in ``dtype``. ``own=False``: a tensor already in ``dtype`` may stay on
        the file's memory map (file pages the kernel can drop, but the file stays mapped while it
        lives: for long-lived tensors read in one call, one mapping per file)."""
        from safetensors import safe_open

        out, by_file = {}, {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for k in keys:
                    t = f.get_tensor(self.stored[k])
                    # a copy the process owns: a tensor left on the file's memory map keeps the whole
                    # file mapped (virtual memory, what RLIMIT_AS counts) for as long as it lives
                    out[k] = t.to(dtype) if t.dtype != dtype else t.clone() if own else t
        return out


def _renamings(model_type: str | None) -> list:
    """transformers' rules renaming ``model_type``'s stored tensor names to the model's."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return []
    rules = (get_checkpoint_conversion_mapping(model_type) if model_type else None) or []
    return [r for r in rules if isinstance(r, WeightRenaming)]


def _model_key(stored: str, rules: list) -> str:
    for rule in rules:
        stored = rule.rename_source_key(stored)[0]
    return stored


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (``experts.E.gate_proj.weight`` ...) as the fused
    parameters transformers builds from them at load time: ``experts.gate_up_proj``
    ``[E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]``."""
    import re

    found: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m:
            found.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, experts in found.items():
        order = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                     for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out


def named_like(module: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """``tensors`` (a checkpoint's, names relative to ``module``) named as ``module``'s
    parameters (per-expert tensors fused as transformers fuses them), or a one-line error
    naming what does not match (``what``: e.g. "the streaming teacher cannot load model.layers.3")."""
    expected = {n for n, _ in module.named_parameters()}
    if set(tensors) != expected:
        tensors = _fuse_experts(tensors)
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise OverRepError(f"{what}: the checkpoint's names do not match the model's (missing {missing[:3]}, "
                           f"unexpected {extra[:3]}); use the in-memory teacher (cache.teacher: model)")
    return tensors


def _load_into(module: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Assign ``tensors`` (names relative to ``module``) as its parameters, exactly."""
    tensors = named_like(module, tensors, f"the streaming teacher cannot load {what}")
    module.load_state_dict(tensors, strict=False, assign=True)


def _give_freed_memory_back() -> None:
    """Pin glibc's mmap threshold at 128 KiB. Otherwise it grows after the first large frees,
    and each dropped block's weights stay in the process's heap instead of going back to the
    system: measured on the embedded model, a peak of 1,113 MB instead of 532. Linux/glibc
    only; elsewhere nothing."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


@torch.no_grad()
def stream_features(folder: str | Path, input_ids: torch.Tensor, groups: list[RecoveryGroup], *,
                    dtype: torch.dtype = torch.float32, batch: int = 8, outside_from: nn.Module | None = None,
                    device: torch.device | str = "cpu") -> list[dict]:
    """Per group ``{"inputs", "targets"}`` ``[N, T, H]`` for ``input_ids`` ``[N, T]``, read from
    the Hugging Face folder ``folder`` one decoder block at a time, each block run on ``device``
    (the features come back on the CPU). ``outside_from``: a model of the same checkpoint (an
    onloaded one) whose embeddings and norms are used rather than read again."""
    from torch.utils._pytree import tree_map

    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    _give_freed_memory_back()
    folder = Path(folder)
    ckpt = _Checkpoint(folder)
    config = AutoConfig.from_pretrained(folder)
    ckpt.rename(config.model_type)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    model.eval()
    blocks = decoder_layers(model)
    # outside the blocks: embeddings and norms, read now; the LM head is never run here
    outside = [n for n, _ in model.named_parameters() if not n.startswith(LAYERS_PREFIX)
               and not n.startswith("lm_head.")]
    absent = sorted(n for n in outside if n not in ckpt.where)
    if absent:
        raise OverRepError(f"the streaming teacher found no tensors for {absent[:3]} in {folder}")
    if outside_from is not None and outside_from.dtype == dtype:
        tensors = {n: outside_from.get_parameter(n).detach().cpu() for n in outside}
    else:
        tensors = ckpt.read(outside, dtype, own=False)
    model.load_state_dict(tensors, strict=False, assign=True)

    last = max(g.target_layer for g in groups)
    real = list(blocks)
    records: list[list] = []
    for i in range(0, input_ids.shape[0], batch):
        record: list = []
        model.model.layers = nn.ModuleList(_Recorder(j, record, last, real[j]) for j in range(len(real)))
        run_hooked(model, [], input_ids=input_ids[i:i + batch], use_cache=False)  # the last _Recorder stops it
        records.append(record)
    model.model.layers = nn.ModuleList(real)

    out: list[dict] = [{} for _ in groups]
    keep = {gi: [] for gi in range(len(groups))}
    device = torch.device(device)
    on = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    hidden = [r[0][0].to(device) for r in records]  # the hidden state entering block 0, per batch
    records = [[(None, tree_map(on, args), tree_map(on, kwargs)) for _, args, kwargs in r] for r in records]
    for j in range(last + 1):
        for gi, g in enumerate(groups):
            if g.input_layer == j:
                out[gi]["inputs"] = torch.cat(hidden).cpu()
        prefix = f"{LAYERS_PREFIX}{j}."
        block = real[j]
        names = [n for n in ckpt.where if n.startswith(prefix)]
        _load_into(block, {n[len(prefix):]: t.to(device) for n, t in ckpt.read(names, dtype).items()}, f"block {j}")
        block.eval()
        for b, record in enumerate(records):
            _, args, kwargs = record[j]
            h = block(hidden[b], *args, **kwargs)
            hidden[b] = h[0] if isinstance(h, tuple) else h
        block.to("meta")  # its weights go; the next block's come
        for gi, g in enumerate(groups):
            if g.target_layer == j:
                keep[gi] = torch.cat(hidden)
    norm = final_norm(model).to(device)
    for gi, g in enumerate(groups):
        out[gi]["targets"] = (norm(keep[gi]) if g.final_norm else keep[gi]).cpu()
    return out
