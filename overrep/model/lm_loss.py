"""The next-token loss of a whole causal LM in training (LoRA, full fine-tuning, ``overrep-lm``).

``model(input_ids=ids, labels=ids).loss`` builds the whole batch's logits in fp32 and their
log-softmax, and frees them every step; :class:`CausalLMLoss` runs the model's decoder and
takes the loss through the frozen head chunk by chunk (:func:`~overrep.core.linear_ce.head_cross_entropy`),
the same fusion as the layer-wise methods' next-token phase, so that a comparison at matched
wall-clock gives every method the same loss implementation.

A model may do more between its decoder and its loss than a head and Gemma's soft-capping
(a logit multiplier, PEFT's AdaLoRA adding its orthogonality penalty when labels are passed),
so the fused loss is used only where it reproduces the model's own on the first batch (in
eval mode, without dropout); elsewhere, and wherever the head trains, the model computes it.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..core.linear_ce import fusable, head_cross_entropy

log = logging.getLogger(__name__)

#: relative difference between the fused and the model's own loss still taken as the same
AGREE = 1e-3


def _parts(model: nn.Module):
    """(decoder, head, soft-capping) of a causal LM, or of the model a PEFT wrapper adapts; None where it has none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_decoder = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None or decoder is base or head is None or not fusable(head):
        return None
    return decoder, head, getattr(base.config, "final_logit_softcapping", None)


class CausalLMLoss:
    """``loss(ids)``: mean next-token cross-entropy of ``model`` on token rows ``ids`` [B, T]."""

    def __init__(self, model: nn.Module, fused: bool = True):
        self.model = model
        self.parts = _parts(model) if fused else None
        self.checked = self.parts is None

    def _own(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def _fused(self, ids: torch.Tensor) -> torch.Tensor:
        decoder, head, softcap = self.parts
        h = decoder(input_ids=ids, use_cache=False)[0]
        return head_cross_entropy(h[:, :-1].flatten(0, 1), head, ids[:, 1:].flatten().to(h.device), softcap)

    @torch.no_grad()
    def _check(self, ids: torch.Tensor) -> None:
        was = self.model.training
        self.model.train(False)
        try:
            own, fused = self._own(ids).item(), self._fused(ids).item()
        finally:
            self.model.train(was)
        if not (math.isfinite(own) and abs(fused - own) <= AGREE * max(abs(own), 1e-6)):
            log.info("the model's own loss (%.5g) is not a head's cross-entropy (%.5g): computed by the model", own, fused)
            self.parts = None
        self.checked = True

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.checked:
            self._check(ids[:1])
        return self._fused(ids) if self.parts is not None else self._own(ids)


__all__ = ["CausalLMLoss", "AGREE"]
