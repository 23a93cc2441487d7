"""Pruning criteria: which decoder blocks to remove.

A criterion maps a model (and, for data-driven criteria, calibration batches) and a
number of blocks to the sorted list of block indices to remove; removing them is a
separate step (:mod:`overrep.surgery`).
"""

from __future__ import annotations

from typing import Callable

import torch

from .arch import decoder_layers
from .errors import OverRepError

Criterion = Callable[[torch.nn.Module, int, "list[torch.Tensor] | None"], list[int]]


def last_but_final(model: torch.nn.Module, n_blocks: int, calibration=None) -> list[int]:
    """The paper's shared criterion: the last ``n_blocks`` blocks except the final one.

    Block 1 of the recovery module is then the block before the segment and block 2 the
    model's final block.
    """
    num_layers = len(decoder_layers(model))
    if n_blocks > num_layers - 2:
        raise OverRepError(f"criterion 'last' can remove at most {num_layers - 2} of {num_layers} blocks "
                           "(it keeps the first and the final block)")
    return list(range(num_layers - 1 - n_blocks, num_layers - 1))


CRITERIA: dict[str, Criterion] = {"last": last_but_final}


def get_criterion(name: str) -> Criterion:
    if name not in CRITERIA:
        raise OverRepError(f"unknown pruning criterion '{name}'; available: {', '.join(CRITERIA)}")
    return CRITERIA[name]
