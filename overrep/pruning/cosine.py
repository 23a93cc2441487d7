"""``cosine``: LLM-Streamline's segment similarity.

Chen et al., 2024, "Compressing Large Language Models by Streamlining the Unimportant
Layer": for every run of ``n`` consecutive blocks ``[i, i+n-1]``, the mean over tokens of
the cosine between the input of block ``i`` and the output of block ``i+n-1``; the most
similar run is removed (ties: the lower start).
"""

from __future__ import annotations


import torch
from torch import nn

from ..model.arch import decoder_layers
from .selection import Selection, _check_calibration, _check_n, _inference, _stream_hidden, _token_cosine


def segment_cosine_scores(model: nn.Module, n_blocks: int, calibration: torch.Tensor,
                          batch_size: int = 8) -> list[float]:
    """For each start ``i`` in ``0..L-n``: mean over tokens of cos(input of block ``i``,
    output of block ``i+n-1``).

    The inputs of at most ``n`` blocks are held at a time (one batch each).
    """
    num_layers = len(decoder_layers(model))
    starts = num_layers - n_blocks + 1
    sums = [0.0] * starts
    count = [0]
    held: dict[int, torch.Tensor] = {}

    def on_block(j, x_in, x_out):
        if j < starts:
            held[j] = x_in
        i = j - n_blocks + 1
        if i >= 0:
            cos = _token_cosine(held.pop(i), x_out)
            sums[i] += cos.double().sum().item()
            if i == 0:
                count[0] += cos.numel()

    with _inference(model):
        _stream_hidden(model, calibration, batch_size, on_block=on_block)
    return [s / count[0] for s in sums]


def segment_cosine(model: nn.Module, n_blocks: int, calibration=None, *, batch_size: int = 8) -> Selection:
    """Remove the run of consecutive blocks whose input and output agree most (LLM-Streamline).

    Every run ``[i, i+n-1]``, ``i = 0..L-n``, is a candidate; the score is the mean over
    calibration tokens of cos(input of block ``i``, output of block ``i+n-1``); ties go to
    the lower start.
    """
    num_layers = len(decoder_layers(model))
    _check_n("cosine", n_blocks, num_layers)
    calibration = _check_calibration("cosine", calibration)
    sims = segment_cosine_scores(model, n_blocks, calibration, batch_size)
    best = max(range(len(sims)), key=lambda i: (sims[i], -i))
    return Selection(list(range(best, best + n_blocks)),
                     scores={"segment_cosine": {str(i): s for i, s in enumerate(sims)}})
