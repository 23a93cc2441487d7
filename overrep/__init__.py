"""overrep: structured layer pruning for LLMs with OverRep recovery.

Train overcomplete, deploy compact: the recovery blocks of a pruned model are trained
with extra factors (W, D) and an annealed activation, then folded back exactly into
the original architecture.
"""

__version__ = "0.1.0"

from .errors import OverRepError  # noqa: E402
from .model.presets import BUILTIN_PRESETS, BlockSpec, Preset, get_preset  # noqa: E402
from .core.projection import MergeRefused, OvercompleteLinear, ReparamNorm  # noqa: E402
from .model.wrap import RecoveryModule, apply_preset, merge_recovery  # noqa: E402
from .core.schedule import AlphaSchedule, AnnealedActivation  # noqa: E402
from .model.surgery import PrunePlan, plan_pruning, prune, remove_layers  # noqa: E402

__all__ = ["OverRepError", "BUILTIN_PRESETS", "BlockSpec", "Preset", "get_preset", "MergeRefused",
           "OvercompleteLinear", "ReparamNorm", "RecoveryModule", "apply_preset", "merge_recovery",
           "AlphaSchedule", "AnnealedActivation", "PrunePlan", "plan_pruning", "prune", "remove_layers"]
