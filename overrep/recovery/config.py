"""The run configuration's ``recovery`` section: the shared training options plus every
method's own, composed by dataclass inheritance, and their checks.

A method's options live beside its code (:class:`~overrep.recovery.losses.LossOptions`,
:class:`~overrep.recovery.methods.adapters.LoraOptions`, ...); a method with options of its
own adds its dataclass to :class:`RecoveryConfig`'s bases, and its keys are then
``recovery.<field>`` in YAML and in ``--set``. Every option is checked whichever method
runs, so a typo in a setting the run does not use still fails before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import OverRepError
from ..model.presets import get_preset
from .losses import LossOptions
from .methods import METHODS, Method
from .methods.adapters import LoraOptions
from .methods.closed_form import ClosedFormOptions
from .methods.patch import PatchOptions
from .methods.rankadaptor import RankAdaptorOptions
from .methods.restorelcc import RestoreLCCOptions
from .methods.whole_model import KDOptions
from .options import TrainingOptions

#: the learning-rate warm-up of a warm start, in steps: 20 kept the closed form's head start
#: (validation 131 against 160 without it after 80 steps, docs/closed-forms.md)
WARM_START_WARMUP_STEPS = 20


# (bases listed last-first: a dataclass's fields follow its reversed MRO, so the shared
# training options come first in config.yaml, then each method's)
@dataclass
class RecoveryConfig(PatchOptions, ClosedFormOptions, RestoreLCCOptions, KDOptions, LossOptions, RankAdaptorOptions, LoraOptions, TrainingOptions):
    """``recovery``: how the pruned model is recovered (one field per YAML key)."""

    @property
    def method_entry(self) -> Method:
        """The registered :class:`~overrep.recovery.methods.Method` named by ``method``."""
        if self.method not in METHODS:
            raise OverRepError(f"unknown recovery.method '{self.method}'; available: {', '.join(METHODS)}")
        return METHODS[self.method]

    @property
    def resolved_warmup_steps(self) -> int:
        """``warmup_steps``, its default made concrete: a warm start warms up for
        :data:`WARM_START_WARMUP_STEPS` steps, a cold start does not need to."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return WARM_START_WARMUP_STEPS if self.warm_start != "none" else 0

    @property
    def preset_name(self) -> str:
        """The preset the method builds (a method may fix its own)."""
        return self.method_entry.preset or self.preset

    @property
    def blocks_per_run(self) -> int | str:
        """The recovery blocks per removed run the method builds (a method may fix its own)."""
        return self.method_entry.blocks or self.blocks

    @property
    def block1_layout(self) -> str:
        """How the block before each gap starts (a method may fix its own: LinearPatch keeps it as it is)."""
        return self.method_entry.block1_init or self.block1_init

    def resolve_width(self) -> None:
        """A width-pruned model: refuse a method defined for block removal only, and the
        defaults where block pruning's do not apply (measured best at short budgets): the
        preset ``width-linear`` for ``hybrid`` and the method's ``width_lr``; fp32 training
        (bf16 autocast is far slower per block on a CPU for the full-width P + W and the
        rectangular D)."""
        from ..model.width import PRUNED_SIDE

        method = self.method_entry
        if method.block_removal_only:
            supported = ", ".join(m.name for m in METHODS.values() if not m.block_removal_only)
            raise OverRepError(f"recovery.method '{self.method}' is defined for block removal only "
                               f"({method.block_removal_only}) and needs prune.granularity: blocks; width pruning "
                               f"supports {supported}")
        if self.preset == "hybrid":
            self.preset = "width-linear"
        if self.lr is None and method.width_lr is not None:
            self.lr = method.width_lr
        preset = get_preset(self.preset_name)
        for b in preset.blocks if preset.uses_d else ():
            bad = [k for k in PRUNED_SIDE if k not in b.d or preset.d_side[k] != PRUNED_SIDE[k]]
            if bad:
                raise OverRepError(f"preset '{preset.name}' cannot recover a width-pruned model: '{bad[0]}' needs D "
                                   f"on its {PRUNED_SIDE[bad[0]]} side (use the preset 'width')")
        if self.precision in ("bf16", "auto"):
            self.precision = "fp32"

    def check_options(self, train_sequences: int) -> None:
        """The preset and every method's options (``train_sequences``: the rows a search splits)."""
        get_preset(self.preset_name)  # a bad name or preset file fails here, not mid-run
        self.check_loss()
        self.check_lora()
        self.check_kd()
        self.check_rankadaptor(train_sequences, searches=RankAdaptorOptions in self.method_entry.options)
        self.check_restorelcc()
        self.check_closed_form(self.method_entry)
        self.check_patch()
