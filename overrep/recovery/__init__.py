"""Recovery training: objectives (losses), the trainer, the epoch sampler and the recovery methods (METHODS).

The package also re-exports the recovery wrap/merge and forward hooks it used to hold as one
module, so ``from overrep.recovery import teacher_features`` (the README's library example)
still works; they live in :mod:`overrep.model.wrap` and :mod:`overrep.model.hooks`.
"""

from ..model.hooks import capture_layer_context, module_context, teacher_features
from ..model.wrap import RecoveryModule, apply_preset, count_parameters, has_wrappers, merge_recovery

__all__ = ["RecoveryModule", "apply_preset", "merge_recovery", "has_wrappers", "count_parameters",
           "capture_layer_context", "teacher_features", "module_context"]
