"""Recovery training: the configuration (:mod:`.config`), objectives and losses, the trainer,
the epoch sampler and the recovery methods (:data:`.methods.METHODS`).

The package also exports the recovery wrap/merge and the forward hooks, which live in
:mod:`overrep.model.wrap` and :mod:`overrep.model.hooks`.
"""

from ..model.hooks import capture_layer_context, module_context, teacher_features
from ..model.wrap import RecoveryModule, apply_preset, count_parameters, has_wrappers, merge_recovery

__all__ = ["RecoveryModule", "apply_preset", "merge_recovery", "has_wrappers", "count_parameters",
           "capture_layer_context", "teacher_features", "module_context"]
