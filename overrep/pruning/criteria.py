"""Pruning criteria: which decoder blocks to remove (re-exports; the registry is :mod:`.registry`).

A criterion is called as ``criterion(model, n_blocks, calibration)`` and returns a
:class:`Selection`: the sorted dense indices of the blocks to remove, optionally new
weights for some retained blocks, and JSON-serialisable diagnostics. Removing the blocks is
a separate step (:mod:`overrep.model.surgery`); a criterion never changes the model it is
given (the dense teacher). One module per criterion: :mod:`.last`, :mod:`.block_influence`,
:mod:`.cosine`, :mod:`.laco`.
"""

from __future__ import annotations

from .block_influence import block_influence, block_influence_scores
from .cosine import segment_cosine, segment_cosine_scores
from .laco import laco, laco_reference, laco_similarity, rdsc_merge
from .last import last_but_final
from .registry import CRITERIA, NEEDS_CALIBRATION, Criterion, get_criterion
from .selection import Selection

__all__ = ["CRITERIA", "NEEDS_CALIBRATION", "Criterion", "Selection", "block_influence", "block_influence_scores",
           "get_criterion", "laco", "laco_reference", "laco_similarity", "last_but_final", "rdsc_merge",
           "segment_cosine", "segment_cosine_scores"]
