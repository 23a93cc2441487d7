"""LinearPatch (Chen et al., NeurIPS 2025) as a reference method: ``linearpatch`` and
``linearpatch-kd``. Scored like every other method's model, never exported.

At each gap the residual stream is multiplied by a d x d patch ``P = H diag(s) H^T`` (a
Hadamard rotation and per-channel scales from mean magnitudes on calibration rows,
:func:`~overrep.recovery.compensation.linear_patch`); ``linearpatch-kd`` then tunes the patch
alone by the reference's offline distillation (one pass over the training rows, KL on the dense
model's top-k next tokens, :func:`~overrep.recovery.compensation.tune_patches`). The stock
architecture has no place for ``P``, so the patch is a forward pre-hook on the pruned model: the
run scores the patched model (held-out perplexity, generation check, benchmarks) and writes no
``model/`` folder (its :class:`~overrep.recovery.methods.base.Method` entry says
``exports=False``; ``metrics.json`` says ``"exportable": false`` and counts the patch's
parameters as ``extra_params``). The reference keeps the block before each gap as it is, so the
method does too (``block1_init: retained``; the stitched block measured worse for it on
validation, 602 against 505: docs/closed-forms.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...errors import OverRepError
from ..compensation import linear_patch, tune_patches
from ..teacher import MethodInputs
from .base import Method, MethodRun


@dataclass
class PatchOptions:
    """The ``recovery`` keys of ``linearpatch-kd`` (the patch itself is fitted on ``closed_rows`` rows)."""

    patch_kd_lr: float = 1e-4  # linearpatch-kd: AdamW learning rate of the patch (a cosine to a tenth over one pass)
    patch_kd_topk: int = 50  # linearpatch-kd: the dense model's top-k next tokens the KL is renormalised on

    def check_patch(self) -> None:
        if not self.patch_kd_lr > 0:
            raise OverRepError(f"recovery.patch_kd_lr must be > 0, got {self.patch_kd_lr}")
        if self.patch_kd_topk < 1:
            raise OverRepError(f"recovery.patch_kd_topk must be >= 1, got {self.patch_kd_topk}")


class PatchRun(MethodRun):
    """The patches fitted (and, for ``linearpatch-kd``, distilled) when the method is set up;
    nothing trains in the pipeline's trainer, and :attr:`model` keeps the hooks."""

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        self.objective = None
        self.fit: dict = {}
        self.hooks: list = []
        if not with_data:
            return
        r, kd = inputs.config, method.objective == "patch-kd"
        t0 = time.perf_counter()
        self.hooks = linear_patch(self.model, inputs.dense, inputs.plan, inputs.train_ids[:r.closed_rows],
                                  trainable=kd)
        self.fit = {"patches": len(self.hooks), "rows": min(r.closed_rows, inputs.train_ids.shape[0]),
                    "fit_seconds": time.perf_counter() - t0}
        if kd:
            self.fit["kd"] = tune_patches(self.model, self.hooks, inputs.dense, inputs.train_ids, k=r.patch_kd_topk,
                                          lr=r.patch_kd_lr, precision=r.precision, progress=inputs.progress)
            for h in self.hooks:
                h.matrix.requires_grad_(False)
        self.fit["seconds"] = time.perf_counter() - t0  # the fit and the distillation: the method's whole cost

    @property
    def trainable_params(self) -> int:
        return 0  # nothing the compact model holds; the patch is counted apart (extra_params)

    @property
    def extra_params(self) -> int:
        return sum(h.matrix.numel() for h in self.hooks)

    def finish(self) -> dict:
        return {"closed_form": self.fit, "exportable": False, "extra_params": self.extra_params} if self.fit else {}

    def describe(self) -> dict:
        r = self.inputs.config
        kd = {"kd": {"lr": r.patch_kd_lr, "topk": r.patch_kd_topk}} if self.method.objective == "patch-kd" else {}
        return {**super().describe(), "closed_form": {"rows": r.closed_rows, "tokens": "all", **kd},
                "extra_module": "a d x d patch at each gap (forward pre-hook; not exportable)"}
