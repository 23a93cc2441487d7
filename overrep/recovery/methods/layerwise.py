"""OverRep, Plain and Streamline: recovery modules trained on the dense model's features.

The three differ only in the preset (``overrep``: ``recovery.preset``; ``plain``: the same
blocks without W, D or annealing; ``streamline``: one whole block replacing the run) and
share everything else: the layer-wise loss (``recovery.loss``), the features, the
validation probe and the merge check.
"""

from __future__ import annotations

import torch

from ...errors import OverRepError
from ...model.hooks import capture_layer_context, module_context
from ...model.presets import get_preset
from ...model.wrap import apply_preset, merge_recovery
from ..losses import Tail, cached_fisher, cached_topk, centred_gram, downstream_gain, parse_loss, teacher_topk
from ..objectives import Layerwise
from ..teacher import PROBE_ROWS, MethodInputs
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
        per_module = [parse_loss(r.loss) for _ in plan.groups]
        phases = sorted({p for ph in per_module for p in ph})
        aux = self.loss_constants(per_module, full_ctx) if with_data else None
        source = teacher.features() if with_data else None
        if with_data and "kl-topk" in phases:
            if teacher.mode == "probe":  # timing only: the probe rows' top-k, cycled like their features
                values, indices = teacher_topk(inputs.dense, teacher.train_ids[:PROBE_ROWS], r.loss_topk)
            else:
                values, indices = cached_topk(teacher, r.loss_topk)
            source = _with_topk(source, values, indices)
            v, i = teacher_topk(inputs.dense, inputs.heldout_ids[:16], r.loss_topk)
            self.val_probe = [{**f, "topk_values": v, "topk_indices": i} for f in self.val_probe]
        self.objective = Layerwise(self.modules, self.contexts, source, self.val_probe, loss=r.loss, aux=aux,
                                   lam=r.loss_lambda, switch=r.loss_switch, total_steps=inputs.total_steps,
                                   ppl_model=model if inputs.val_ids is not None else None,
                                   ppl_ids=inputs.val_ids,
                                   topk_rest=r.loss_topk_rest)

    def loss_constants(self, per_module: list[list[str]], full_ctx: list[dict]) -> list[dict]:
        """Per module, what its loss needs besides the features (see :mod:`overrep.recovery.losses`)."""
        inputs = self.inputs
        aux: list[dict] = [{} for _ in self.modules]
        every = {p for ph in per_module for p in ph}
        fisher = cached_fisher(inputs.teacher, inputs.config.fisher_sequences) if "fisher" in every else None
        gram = centred_gram(inputs.dense) if "logit" in every else None
        for i, (m, g, phases) in enumerate(zip(self.modules, inputs.plan.groups, per_module)):
            device = next(m.parameters()).device
            if "normed" in phases and not g.final_norm:
                aux[i]["gain"] = downstream_gain(inputs.dense, g).to(device)
            if "fisher" in phases:
                aux[i]["fisher"] = fisher[i].to(device)
            if "logit" in phases:
                if not g.final_norm:
                    raise OverRepError(f"recovery.loss 'logit' needs a module that ends at the final norm; the "
                                       f"module ending at block {g.target_layer} does not (use normed, fisher or "
                                       "kl-topk, or recovery.final_block: true where the run ends before the "
                                       "final block)")
                aux[i]["gram"] = gram.to(device)
            if "kl-topk" in phases:
                aux[i]["tail"] = Tail(self.model, m, full_ctx)
        return aux

    @torch.no_grad()
    def finish(self) -> dict:
        at_last_trained_step(self.objective.activations)
        probe = [{k: v[:4] for k, v in f.items()} for f in self.val_probe]

        def outputs(precision: str) -> torch.Tensor:
            for m in self.modules:
                m.precision = precision
            return torch.cat([m(f["inputs"], c).flatten() for m, f, c in zip(self.modules, probe, self.contexts)])

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


def _with_topk(source, values: torch.Tensor, indices: torch.Tensor):
    def wrapped(idx):
        batch = source(idx)
        rows = [i % values.shape[0] for i in idx]  # (a probe cycles over its few rows)
        v, i = values[rows], indices[rows]
        return [{**f, "topk_values": v, "topk_indices": i} for f in batch]
    return wrapped
