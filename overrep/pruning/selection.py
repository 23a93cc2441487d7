"""What a criterion returns (:class:`Selection`) and the helpers the data-driven criteria share.

A criterion is called as ``criterion(model, n_blocks, calibration)`` and returns a
:class:`Selection`. ``calibration`` is a ``LongTensor [rows, tokens]`` of token ids
(``None`` for criteria that need no data). All hidden states come from hooks on the
decoder blocks (and the final norm), never from ``output_hidden_states``, so "the output of
the last block" is the un-normed one. The data-driven criteria run under ``torch.no_grad()``
in eval mode (training flags are restored afterwards), ``batch_size`` calibration rows per
forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import OverRepError
from ..model.arch import decoder_layers, final_norm
from ..model.placement import input_device


@dataclass
class Selection:
    """What a criterion chose.

    ``removed``: sorted dense indices of the blocks to remove.
    ``replaced``: dense index of a *retained* block -> the full new ``state_dict`` of that
    block (CPU tensors), to load into it before the removal (only ``laco`` uses this).
    ``scores``: JSON-serialisable diagnostics of the choice.
    """

    removed: list[int]
    replaced: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    scores: dict = field(default_factory=dict)


Criterion = Callable[..., Selection]


Criterion = Callable[..., Selection]


def _check_n(name: str, n_blocks: int, num_layers: int) -> None:
    if n_blocks < 1:
        raise OverRepError(f"criterion '{name}' needs at least 1 block to remove, got {n_blocks}")
    if n_blocks >= num_layers:
        raise OverRepError(f"criterion '{name}' cannot remove {n_blocks} of {num_layers} blocks: "
                           "at least one block must remain")


def _check_calibration(name: str, calibration) -> torch.Tensor:
    if calibration is None:
        raise OverRepError(f"criterion '{name}' needs calibration data (token ids [rows, tokens]) but got none")
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.is_floating_point():
        shape = tuple(calibration.shape) if isinstance(calibration, torch.Tensor) else type(calibration).__name__
        raise OverRepError(f"criterion '{name}' needs calibration token ids as an integer tensor [rows, tokens], "
                           f"got {shape}")
    if calibration.numel() == 0:
        raise OverRepError(f"criterion '{name}' got empty calibration data {tuple(calibration.shape)}")
    return calibration.long()


@contextmanager
def _inference(model: nn.Module):
    """``no_grad`` and eval mode, restoring every module's training flag afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _stream_hidden(model: nn.Module, calibration: torch.Tensor, batch_size: int, *,
                   on_block: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                   on_final: Callable[[slice, torch.Tensor], None] | None = None) -> None:
    """Run the calibration rows through the model, ``batch_size`` rows per forward.

    ``on_block(i, x_in, x_out)`` is called as block ``i`` finishes, with the hidden state
    entering it and the one leaving it (``[rows, tokens, hidden]``, un-normed);
    ``on_final(rows, h)`` with the final-normed hidden state of calibration ``rows``.
    Only the base model runs (no LM head). Call inside :func:`_inference`.
    """
    if batch_size < 1:
        raise OverRepError(f"calibration batch size must be >= 1, got {batch_size}")
    layers = decoder_layers(model)
    handles = []
    inputs: dict[int, torch.Tensor] = {}
    current: list[slice] = []
    if on_block is not None:
        for i, layer in enumerate(layers):
            def pre(module, args, kwargs, i=i):
                inputs[i] = args[0] if args else kwargs["hidden_states"]

            def post(module, args, output, i=i):
                on_block(i, inputs.pop(i), _hidden(output))

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(post))
    if on_final is not None:
        handles.append(final_norm(model).register_forward_hook(
            lambda module, args, output: on_final(current[0], _hidden(output))))
    device = input_device(model)
    try:
        for start in range(0, calibration.shape[0], batch_size):
            rows = slice(start, min(start + batch_size, calibration.shape[0]))
            current[:] = [rows]
            model.model(input_ids=calibration[rows].to(device), use_cache=False)
            inputs.clear()
    finally:
        for h in handles:
            h.remove()


def _token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each token's hidden vectors (float32), shape ``[rows, tokens]``."""
    return F.cosine_similarity(a.float(), b.float().to(a.device), dim=-1)
