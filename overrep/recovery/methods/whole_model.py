"""Methods trained end to end through the whole pruned model: full fine-tuning and logit
distillation of every retained block, and OverRep's parameterisation on the logit-KD
objective (``overrep-kd``) or on the language-model loss (``overrep-lm``).

``overrep-lm`` separates the two things a comparison of OverRep with iso-parameter LoRA
mixes: the parameterisation (overcomplete recovery blocks, folded back exactly) and the
objective (a layer-wise loss on the dense model's features against the next-token loss of
the whole model). It is OverRep's modules on LoRA's objective: no teacher, no features."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import OverRepError
from ...model.arch import decoder_layers
from ...model.presets import get_preset
from ...model.wrap import apply_preset, merge_recovery
from ..objectives import LanguageModeling, LogitDistillation, pretrained_matrix_ids, unique_trainable
from ..teacher import MethodInputs
from .base import Method, MethodRun, at_last_trained_step, check_fold, logits_of


@dataclass
class KDOptions:
    """``recovery`` options of the logit-distillation methods."""

    kd_tau: float = 1.0  # logit-kd / overrep-kd: distillation temperature

    def check_kd(self) -> None:
        if self.kd_tau <= 0:
            raise OverRepError(f"recovery.kd_tau must be > 0, got {self.kd_tau}")


class OvercompleteRun(MethodRun):
    """OverRep's recovery blocks trained end to end: on the logit-KD objective (``kd``) or
    the language-model loss (``lm``), as the method's ``objective`` says."""

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        self.preset = get_preset(method.preset or inputs.config.preset)
        model = self.model_for(self.preset)
        self.modules = apply_preset(model, inputs.plan, self.preset)
        trained = dict(params=unique_trainable(self.modules), activations=[m.activation for m in self.modules],
                       decayed=set().union(*(pretrained_matrix_ids(m) for m in self.modules)),
                       precision=inputs.config.precision)
        if method.objective == "lm":
            self.objective = LanguageModeling(model, inputs.train_ids, inputs.val_ids, **trained)
        else:
            self.objective = LogitDistillation(model, inputs.dense, inputs.train_ids, inputs.val_ids,
                                               tau=inputs.config.kd_tau, **trained)

    def finish(self) -> dict:
        at_last_trained_step(self.objective.activations)
        probe = self.inputs.heldout_ids[:2]
        before = logits_of(self.model, probe)
        merged = merge_recovery(self.model)
        return {"merged_wrappers": merged, **check_fold(before, logits_of(self.model, probe), "merge", self.model.dtype)}

    def describe(self) -> dict:
        return {**super().describe(), "preset": self.preset.to_dict()}


class FullRun(MethodRun):
    """Every retained block trainable (embeddings, head and final norm frozen)."""

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        model = inputs.pruned
        model.requires_grad_(False)
        for layer in decoder_layers(model):
            layer.requires_grad_(True)
        if method.objective == "lm":
            self.objective = LanguageModeling(model, inputs.train_ids, inputs.val_ids,
                                              precision=inputs.config.precision)
        else:
            self.objective = LogitDistillation(model, inputs.dense, inputs.train_ids, inputs.val_ids,
                                               tau=inputs.config.kd_tau, precision=inputs.config.precision)
