"""OverRep, Plain and Streamline: recovery modules trained on the dense model's features.

The three differ only in the preset (``overrep``: ``recovery.preset``; ``plain``: the same
blocks without W, D or annealing; ``streamline``: one whole block replacing the run) and
share everything else: the layer-wise loss (``recovery.loss``), the features, the
validation probe and the merge check.
"""

from __future__ import annotations

import time

import torch

from ...model.hooks import capture_layer_context, module_context
from ...model.presets import get_preset
from ...model.wrap import apply_preset, merge_recovery
from ..losses import LOSSES, LossSetup, parse_loss
from ..objectives import Layerwise
from ..teacher import MethodInputs
from .base import Method, MethodRun, at_last_trained_step, check_fold


class LayerwiseRun(MethodRun):
    """Recovery modules on teacher features (``with_data=False``: no feature cache, for
    re-exporting from checkpoints)."""

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        r, teacher, plan = inputs.config, inputs.teacher, inputs.plan
        self.preset = get_preset(method.preset or r.preset)
        model = self.model_for(self.preset)
        self.modules = apply_preset(model, plan, self.preset)
        for m in self.modules:
            m.precision = r.precision
        full_ctx = capture_layer_context(model, inputs.train_ids.shape[1])
        self.contexts = [module_context(full_ctx, m) for m in self.modules]
        self.val_probe = teacher.batch(inputs.heldout_ids[:16])
        self.loss = r.loss
        losses = [LOSSES[name] for name in parse_loss(r.loss)]
        setup = LossSetup(inputs.dense, model, self.modules, plan.groups, teacher, full_ctx, inputs.heldout_ids[:16], r)
        aux = None
        if with_data:  # each loss's constants, prepared once (the phases of A>B: both)
            aux = [{} for _ in self.modules]
            for loss in losses:
                for mine, more in zip(aux, loss.prepare(setup)):
                    mine.update(more)
        source = teacher.features() if with_data else None
        for loss in losses if with_data else ():
            if loss.rows is not None:  # per-row extras the batches carry (kl-topk: the teacher's top-k)
                t0 = time.perf_counter()
                train_rows, val_rows = loss.rows(setup)
                self._time_extras(time.perf_counter() - t0, train_rows, val_rows)
                source = _with_rows(source, train_rows)
                self.val_probe = [{**f, **val_rows} for f in self.val_probe]
        self.objective = Layerwise(self.modules, self.contexts, source, self.val_probe, options=r, aux=aux,
                                   total_steps=inputs.total_steps,
                                   ppl_model=model if inputs.val_ids is not None else None,
                                   ppl_ids=inputs.val_ids, prefix=inputs.prefix)
        if with_data and teacher.mode == "disk" and len(losses) > 1 and losses[-1].fresh and losses[-1].live:
            # the next-token phase reads on past the rows the budget's first plan cached
            self.objective.live_rows = teacher.all_ids.shape[0] - teacher.train_ids.shape[0]

    def _time_extras(self, seconds: float, train_rows: dict, val_rows: dict) -> None:
        """Share ``seconds`` between the training and validation rows the extras were built for
        (a row's cost is the same for both)."""
        count = [len(next(iter(rows.values()))) if rows else 0 for rows in (train_rows, val_rows)]
        per_row = seconds / max(1, sum(count))
        self.extras_row_seconds += per_row
        self.extras_train_seconds += per_row * count[0]

    @torch.no_grad()
    def finish(self) -> dict:
        at_last_trained_step(self.objective.activations)
        probe = [{k: v[:4] for k, v in f.items()} for f in self.val_probe]

        def outputs(precision: str) -> torch.Tensor:
            for m in self.modules:
                m.precision = precision
            return torch.cat([m(_like_params(f["inputs"], m), c).flatten()
                              for m, f, c in zip(self.modules, probe, self.contexts)])

        trained = self.inputs.config.precision
        low = outputs(trained) if trained != "fp32" else None
        before = outputs("fp32")  # the trained function, evaluated as the merged model will be
        merged = merge_recovery(self.model)
        out = check_fold(before, outputs("fp32"), "merge", self.model.dtype)
        if low is not None:  # how far the bf16 training forward sits from that function
            out["train_precision_max_rel_diff"] = (low - before).abs().max().item() / before.abs().max().item()
        return {"merged_wrappers": merged, **out}

    def describe(self) -> dict:
        return {**super().describe(), "preset": self.preset.to_dict(), "loss": self.loss}


def _like_params(x: torch.Tensor, module) -> torch.Tensor:
    """``x`` on the device and in the dtype of ``module``'s weights (a streamed teacher's
    features sit on the CPU while the module trains on a GPU)."""
    p = next(module.parameters())
    return x.to(p.device, p.dtype)


def _with_rows(source, rows: dict):
    """``source`` whose batches also carry ``rows``' entries of the batch's rows."""
    def wrapped(idx):
        batch = source(idx)
        first = next(iter(rows.values()))
        at = [i % first.shape[0] for i in idx]  # (a probe cycles over its few rows)
        extra = {k: v[at] for k, v in rows.items()}
        return [{**f, **extra} for f in batch]
    return wrapped
