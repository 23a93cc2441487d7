"""What every recovery method shares: its registry entry (:class:`Method`), the object it
becomes on one pruned model (:class:`MethodRun`), and the merge check."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import OverRepError
from ...model.placement import input_device
from ...model.width import WidthPlan
from ..objectives import Objective
from ..teacher import MethodInputs


@dataclass(frozen=True)
class Method:
    """One recovery method: everything the rest of the code asks about it.

    The pipeline builds ``run(inputs, method)`` and asks the flags below, never the name;
    the options ``run`` reads beyond :class:`~overrep.recovery.options.TrainingOptions`
    are the dataclasses of ``options`` (composed into
    :class:`~overrep.recovery.config.RecoveryConfig`)."""

    name: str
    description: str
    run: type  # the MethodRun subclass that sets the method up on one pruned model
    objective: str  # "layerwise" (recovery.loss on teacher features) | "lm" (next-token loss) | "kd" (KL to dense logits)
    default_lr: float
    family: str  # what trains, in the provenance: "layerwise" | "adapter" | "full" | "overcomplete" | "lost-components"
    options: tuple = ()  # the options dataclasses it reads (their fields are its recovery.* keys)
    preset: str | None = None  # forced preset (None: recovery.preset)
    blocks: int | None = None  # forced recovery blocks per run (None: recovery.blocks)
    needs_features: bool = False  # trains on the teacher's features: a time budget sizes their disk cache
    shardable: bool = False  # recovery.shard: fsdp can shard what trains (recovery modules)
    block_removal_only: str | None = None  # why it cannot recover a width-pruned model (None: it can)
    width_lr: float | None = None  # its default learning rate on a width-pruned model (None: default_lr)
    planned_account: bool = True  # `overrep inspect` counts what trains from the plan (False: builds the method)
    auto_warm_start: bool = False  # recovery.warm_start: auto starts it from ReplaceMe's fit where that applies
    auto_warm_max_steps: int | None = None  # ... and only where the run trains at most this many steps (None: any)
    trains: bool = True  # False: a closed form, fitted when it is set up; the pipeline runs no training steps
    exports: bool = True  # False: a reference that needs a module the stock architecture lacks (LinearPatch): scored, never exported
    block1_init: str | None = None  # forced layout of the block before each gap (None: recovery.block1_init)


@torch.no_grad()
def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    was = model.training
    model.eval()
    out = model(input_ids=ids.to(input_device(model)), use_cache=False).logits.float()
    model.train(was)
    return out


def check_fold(before: torch.Tensor, after: torch.Tensor, what: str, dtype: torch.dtype, rel: float = 1e-5) -> dict:
    """The merge guarantee: the folded model computes what training optimised.

    ``before`` is the trained function's output (at the alpha of the last training step),
    ``after`` the merged model's. Tolerance: 1e-5 relative to the output scale, or a few
    rounding steps of a low-precision ``dtype`` (``rel`` overrides the 1e-5).
    """
    diff = (after.double() - before.double()).abs().max().item()
    scale = before.abs().max().item()
    tol = max(rel, 16 * torch.finfo(dtype).eps) * max(scale, 1e-6)
    if not diff <= tol:
        raise OverRepError(f"{what} check failed: the merged model differs from the trained one by {diff:.3g} "
                           f"(output scale {scale:.3g}, tolerance {tol:.3g})")
    return {"merge_max_abs_diff": diff, "merge_max_rel_diff": diff / scale if scale else 0.0}


def at_last_trained_step(activations) -> None:
    """Put every annealed activation back at the alpha the last training step used: the
    function the merge must reproduce (the schedule ends every run with alpha = 0)."""
    for a in activations:
        if a.schedule is not None:
            a.set_step(a.schedule.total_steps - 1)



class MethodRun:
    """A method set up on one pruned model: an objective to train, then :meth:`finish`."""

    objective: Objective
    #: a method that searches before it trains (rankadaptor): the seconds its search took, and
    #: whether this build ran it (False: read from its cache, so a rebuild pays nothing again)
    search_seconds: float = 0.0
    searched_now: bool = False
    #: a loss's per-row extras (kl-topk, ce+kl: the dense model's top-K of each row), built
    #: after the features: the seconds they took a training row (a time budget adds them to
    #: a row's cost) and the seconds this build spent on them for training rows
    extras_row_seconds: float = 0.0
    extras_train_seconds: float = 0.0
    #: what ``recovery.compensate`` / ``recovery.warm_start`` did to the pruned model first
    prepared: dict = {}

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        # with_data=False: set up without the data-dependent preparation (a layer-wise
        # method's feature cache, a search or probe that is not cached): ``overrep plan``
        # and re-exporting from checkpoints build a method this way
        self.inputs, self.method, self.with_data = inputs, method, with_data
        self.model = inputs.pruned  # the compact model :meth:`finish` leaves behind

    def model_for(self, preset) -> nn.Module:
        """The model ``preset`` wraps (and :attr:`model` from now on): the pruned model, or,
        for width pruning with D's, a full-width copy of the dense model that the D's narrow
        (paper appendix "OverRep in Channel-wise Pruning")."""
        if isinstance(self.inputs.plan, WidthPlan) and preset.uses_d:
            self.model = copy.deepcopy(self.inputs.dense)
        return self.model

    @property
    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.objective.parameters())

    def finish(self) -> dict:
        """Fold whatever training added back into :attr:`model` (a compact HF model); the
        merge check's numbers."""
        return {}

    def describe(self) -> dict:
        return {"method": self.method.name, "objective": self.method.objective, "family": self.method.family,
                **self.prepared}
