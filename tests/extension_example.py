"""A recovery method and a layer-wise loss added from outside the package, each as its
module's code plus one registration line (what the README's "How to add" describes).

``final-norm`` trains only the gain of the pruned model's final norm on the language-model
loss; nothing needs merging, the trained model is the compact model. ``l1`` compares a
recovery module's output with the dense hidden state by mean absolute error.
"""

from __future__ import annotations

import torch

from overrep.model.arch import final_norm
from overrep.recovery.losses import LOSSES, Loss
from overrep.recovery.methods import METHODS, Method, MethodRun
from overrep.recovery.objectives import LanguageModeling


class FinalNormRun(MethodRun):
    def __init__(self, inputs, method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        self.model.requires_grad_(False)
        final_norm(self.model).requires_grad_(True)
        self.objective = LanguageModeling(self.model, inputs.train_ids, inputs.val_ids, decayed=set(),
                                          precision=inputs.config.precision)


def l1(pred, feats, aux, options) -> torch.Tensor:
    return (pred.float() - feats["targets"].to(pred.device).float()).abs().mean()


METHODS.register(Method("final-norm", "the final norm's gain, language-model loss", FinalNormRun, "lm", 1e-2,
                        "final-norm", planned_account=False))
LOSSES.register(Loss("l1", "mean absolute error on the hidden state", l1))
