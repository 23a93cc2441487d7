"""``last``: the last ``n`` blocks except the final one (no data needed)."""

from __future__ import annotations


from torch import nn

from ..errors import OverRepError
from ..model.arch import decoder_layers
from .selection import Selection


def last_but_final(model: nn.Module, n_blocks: int, calibration=None) -> Selection:
    """The paper's shared criterion: the last ``n_blocks`` blocks except the final one.

    Block 1 of the recovery module is then the block before the segment and block 2 the
    model's final block.
    """
    num_layers = len(decoder_layers(model))
    if n_blocks < 1:
        raise OverRepError(f"criterion 'last' needs at least 1 block to remove, got {n_blocks}")
    if n_blocks > num_layers - 2:
        raise OverRepError(f"criterion 'last' can remove at most {num_layers - 2} of {num_layers} blocks "
                           "(it keeps the first and the final block)")
    return Selection(list(range(num_layers - 1 - n_blocks, num_layers - 1)))
