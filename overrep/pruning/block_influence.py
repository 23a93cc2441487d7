"""``block-influence``: ShortGPT's Block Influence.

Men et al., 2024, "ShortGPT: Layers in Large Language Models are More Redundant Than You
Expect": ``BI_i = 1 - E[cos(x_i, x_{i+1})]`` over all calibration tokens, with ``x_i`` the
hidden state entering block ``i`` and ``x_{i+1}`` the one leaving it. The ``n`` blocks of
lowest BI are removed, wherever they are (the mask may be non-contiguous); ties go to the
lower index.
"""

from __future__ import annotations


import torch
from torch import nn

from ..model.arch import decoder_layers
from .selection import Selection, _check_calibration, _check_n, _inference, _stream_hidden, _token_cosine


def block_influence_scores(model: nn.Module, calibration: torch.Tensor, batch_size: int = 8) -> list[float]:
    """``BI_i = 1 - mean over all calibration tokens of cos(input_i, output_i)`` per block."""
    num_layers = len(decoder_layers(model))
    sums = [0.0] * num_layers
    count = [0]

    def on_block(i, x_in, x_out):
        cos = _token_cosine(x_in, x_out)
        sums[i] += cos.double().sum().item()
        if i == 0:
            count[0] += cos.numel()

    with _inference(model):
        _stream_hidden(model, calibration, batch_size, on_block=on_block)
    return [1.0 - s / count[0] for s in sums]


def block_influence(model: nn.Module, n_blocks: int, calibration=None, *, batch_size: int = 8) -> Selection:
    """Remove the ``n_blocks`` blocks of lowest Block Influence (ShortGPT).

    Ties are broken towards the lower block index. The removed blocks need not be
    contiguous.
    """
    num_layers = len(decoder_layers(model))
    _check_n("block-influence", n_blocks, num_layers)
    calibration = _check_calibration("block-influence", calibration)
    bi = block_influence_scores(model, calibration, batch_size)
    order = sorted(range(num_layers), key=lambda i: (bi[i], i))
    return Selection(sorted(order[:n_blocks]), scores={"block_influence": bi})
