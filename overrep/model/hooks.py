"""Forward hooks on a Hugging Face model: what a recovery block sees and what it must reproduce.

:func:`capture_layer_context` records the keyword arguments (masks, rotary embeddings) each
decoder block receives, :func:`teacher_features` runs the *dense* model and keeps the hidden
states entering and leaving each recovery group, and :func:`module_context` picks a
:class:`~overrep.model.wrap.RecoveryModule`'s share of the captured context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .arch import decoder_layers, final_norm
from .placement import input_device
from .surgery import RecoveryGroup

if TYPE_CHECKING:
    from .wrap import RecoveryModule


class StopForward(Exception):
    """Raised by a hook once it has what it needs: the rest of the forward pass is skipped."""


def run_hooked(model: nn.Module, handles: list, **inputs):
    """``model(**inputs)`` with the hooks of ``handles`` in place, removed afterwards; a hook
    that raises :class:`StopForward` ends the pass early (the result is then None)."""
    try:
        return model(**inputs)
    except StopForward:
        return None
    finally:
        for h in handles:
            h.remove()


#: keyword arguments of a decoder block that are not part of its context (cache bookkeeping)
NOT_CONTEXT = frozenset({"past_key_values", "past_key_value", "use_cache", "cache_position", "output_attentions"})


@torch.no_grad()
def capture_layer_context(model: nn.Module, seq_len: int) -> list[dict]:
    """Keyword arguments each decoder block receives for a batch of one ``seq_len`` row.

    Masks and rotary embeddings depend only on positions, so they are captured once
    from the model's own forward and broadcast over any batch size.
    """
    layers = decoder_layers(model)
    context: list[dict] = [{} for _ in layers]

    def hook(i):
        def fn(module, args, kwargs):
            context[i] = {k: v for k, v in kwargs.items() if k not in NOT_CONTEXT and k != "hidden_states"}
            if i == len(layers) - 1:
                raise StopForward
        return fn

    device = input_device(model)
    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    run_hooked(model, handles, input_ids=torch.zeros(1, seq_len, dtype=torch.long, device=device), use_cache=False)
    return context


@torch.no_grad()
def teacher_features(model: nn.Module, input_ids: torch.Tensor, groups: list[RecoveryGroup],
                     inputs_only: bool = False) -> list[dict]:
    """Run the *dense* model and return, per group, ``{"inputs", "targets"}`` ``[B, T, H]``.

    ``inputs`` is the hidden state entering the group's first block, ``targets`` the output
    of its target block (after the final norm when the group owns it). The forward pass
    stops as soon as the last needed tensor is captured: with ``inputs_only``, at the last
    group's first block (``{"inputs"}`` alone, for a loss that reads no targets).
    """
    layers = decoder_layers(model)
    norm = final_norm(model)
    out: list[dict] = [{} for _ in groups]
    last_needed = max(g.target_layer for g in groups)
    last_input = max(g.input_layer for g in groups)
    need_norm = any(g.final_norm for g in groups)
    handles = []

    def pre(i):
        def fn(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            for gi, g in enumerate(groups):
                if g.input_layer == i:
                    out[gi]["inputs"] = h.detach().clone()
            if inputs_only and i == last_input:
                raise StopForward
        return fn

    def post(i):
        def fn(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            for gi, g in enumerate(groups):
                if g.target_layer == i and not g.final_norm:
                    out[gi]["targets"] = h.detach().clone()
            if i == last_needed and not need_norm:
                raise StopForward
        return fn

    def norm_hook(module, args, output):
        for gi, g in enumerate(groups):
            if g.final_norm:
                out[gi]["targets"] = output.detach().clone()
        raise StopForward

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i)))
    if need_norm:
        handles.append(norm.register_forward_hook(norm_hook))
    run_hooked(model, handles, input_ids=input_ids.to(input_device(model)), use_cache=False)
    return out


def module_context(full_context: list[dict], module: RecoveryModule) -> list[dict]:
    return [full_context[c] for c in module.compact_indices]


def run_to_hidden(h: torch.Tensor, blocks: list[tuple[nn.Module, dict]], norm: nn.Module | None) -> torch.Tensor:
    """Hidden states ``h`` run through ``blocks`` (each with the context
    :func:`capture_layer_context` captured for it) and ``norm`` (None: already applied)."""
    for block, kwargs in blocks:
        out = block(h, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
    return norm(h) if norm is not None else h


def run_to_logits(h: torch.Tensor, blocks: list[tuple[nn.Module, dict]], norm: nn.Module | None, head: nn.Module,
                  softcap: float | None = None) -> torch.Tensor:
    """The logits of :func:`run_to_hidden` through ``head``, with the model's final
    soft-capping where it has one (Gemma)."""
    logits = head(run_to_hidden(h, blocks, norm)).float()
    return torch.tanh(logits / softcap) * softcap if softcap else logits
