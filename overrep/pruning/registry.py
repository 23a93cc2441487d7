"""The pruning criteria, one :class:`Criterion` entry each: the one place a criterion is registered.

A criterion is a function ``(model, n_blocks, calibration) -> Selection`` (see
:mod:`overrep.pruning.selection`) in a module of its own. ``overrep methods``, the
``prune.criterion`` check of the run config and ``overrep compare`` read this registry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..registry import Registry

if TYPE_CHECKING:
    from .selection import Selection


@dataclass(frozen=True)
class Criterion:
    """One pruning criterion: its config name, a one-line description and its entry point."""

    name: str
    """The value of ``prune.criterion``."""
    description: str
    entry: str
    """Entry point ``module:function``, imported when the criterion runs (help text and config
    checks read the registry without importing torch): ``function(model, n_blocks,
    calibration, **options) -> Selection``."""
    needs_calibration: bool = True
    """Whether it reads calibration token ids (the others accept ``None``)."""

    @property
    def function(self) -> Callable[..., Selection]:
        module, _, name = self.entry.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, model, n_blocks: int, calibration=None, **options) -> Selection:
        return self.function(model, n_blocks, calibration, **options)


CRITERIA: Registry[Criterion] = Registry("pruning criterion")

CRITERIA.register(Criterion(
    "last", "The paper's shared criterion: the last ``n_blocks`` blocks except the final one.",
    "overrep.pruning.last:last_but_final", needs_calibration=False))
CRITERIA.register(Criterion(
    "block-influence", "Remove the ``n_blocks`` blocks of lowest Block Influence (ShortGPT).",
    "overrep.pruning.block_influence:block_influence"))
CRITERIA.register(Criterion(
    "cosine", "Remove the run of consecutive blocks whose input and output agree most (LLM-Streamline).",
    "overrep.pruning.cosine:segment_cosine"))
CRITERIA.register(Criterion(
    "laco", "Layer Collapse (LaCo, Yang et al. 2024): merge blocks into earlier ones with RDSC.",
    "overrep.pruning.laco:laco"))

NEEDS_CALIBRATION: set[str] = {c.name for c in CRITERIA.values() if c.needs_calibration}
"""Criteria that read calibration data."""


def get_criterion(name: str) -> Criterion:
    """The registered criterion ``name`` (callable as its function); an unknown name lists the choices."""
    return CRITERIA[name]
