"""Scoring models that share their first blocks: the hidden states entering the first block
where they differ are kept from the first model scored whole, and every later model that
shares those blocks runs only its own blocks from there.

A run scores the dense, the unrecovered and the recovered model on the same rows. The three
have the same embeddings and the same blocks up to the first one the mask removes or a
recovery module trains (blocks 0-7 of 30 on the default mask): about 30% of the pruned
models' cost per token, LM head included. :class:`SharedPrefix` keeps the hidden states
entering block ``start`` for each set of rows, on the CPU, captured while the first model
that shares the prefix is scored whole. A later model whose embeddings and blocks before
``start`` equal the reference model's, weight for weight, runs its remaining blocks (with the
masks and rotary embeddings its own forward passes them: :func:`capture_layer_context`), its
final norm and its head on them.

The first batch of every such scoring is also run whole, and the two must agree (per-token
loss within 1e-3): where they do not (an architecture whose forward does more than its
blocks, final norm and head, or whose blocks read more than the captured context), the model
is scored whole and the log says so. A scored figure never depends on which path computed it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..memo import tensor_digest
from .arch import decoder_layers, final_norm
from .hooks import capture_layer_context, run_to_logits
from .onload import is_onloaded
from .placement import input_device, is_placed
from .surgery import PrunePlan

log = logging.getLogger(__name__)

#: the most memory the kept states of one set of rows may take (on the CPU); a larger set is
#: scored whole (the default run's test rows take 113 MB on the embedded model; a 7B model's
#: hidden size makes them 0.8 GB)
MAX_STATE_BYTES = 2 << 30
#: largest difference of any token's loss between the whole forward and the shared-prefix one
#: on the checked batch (both run the same operations, so they agree to rounding)
AGREE = 1e-3


def _same_module(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return type(a) is type(b) and pa.keys() == pb.keys() and all(
        pa[k].shape == pb[k].shape and pa[k].device == pb[k].device and torch.equal(pa[k], pb[k]) for k in pa)


def same_prefix(model: nn.Module, reference: nn.Module, blocks: int) -> bool:
    """Whether ``model``'s embeddings and first ``blocks`` blocks (at least one) equal
    ``reference``'s, weight for weight, both on one device and loaded whole (a model placed
    over devices or loaded block by block: False), with a block after them."""
    if blocks < 1 or any(is_placed(m) or is_onloaded(m) for m in (model, reference)):
        return False
    mine, ref = decoder_layers(model), decoder_layers(reference)
    if len(mine) <= blocks or len(ref) <= blocks:
        return False
    return _same_module(model.get_input_embeddings(), reference.get_input_embeddings()) and all(
        _same_module(mine[i], ref[i]) for i in range(blocks))


class SharedPrefix:
    """The hidden states entering block ``start`` of ``reference`` (the dense model) for each
    set of rows scored, and the test of whether another model shares blocks ``0..start-1``."""

    def __init__(self, reference: nn.Module, start: int):
        self.reference, self.start = reference, start
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (rows, [N, T, d] on the CPU)
        self.refused: set[str] = set()  # model classes whose shared-prefix forward disagreed with the whole one

    def shares(self, model: nn.Module) -> bool:
        """Whether ``model`` has the reference's embeddings and blocks before ``start``."""
        return type(model).__name__ not in self.refused and same_prefix(model, self.reference, self.start)

    def holds(self, ids: torch.Tensor) -> bool:
        """Whether the states of the rows ``ids`` are kept (in any precision): a later model
        that shares the prefix then scores them from block ``start``. They are not where no
        model was scored whole on them yet (the dense figures read back from a cache)."""
        return self._kept(ids) is not None

    def _kept(self, ids: torch.Tensor, mode: str | None = None) -> torch.Tensor | None:
        """The kept states of the rows ``ids`` (those of their first rows: a sample), under the
        autocast ``mode`` (None: any), or None."""
        for key, (rows, states) in self.states.items():
            if (mode is None or key.endswith(mode)) and rows.shape[1] == ids.shape[1] \
                    and rows.shape[0] >= ids.shape[0] and torch.equal(rows[:ids.shape[0]], ids.cpu()):
                return states[:ids.shape[0]]
        return None

    def scorer(self, model: nn.Module, ids: torch.Tensor) -> "WholeScorer":
        """What computes ``model``'s logits batch by batch on the rows ``ids`` (see the module
        docstring): rows kept before, or their first rows (a validation timed on a sample),
        under the same autocast as now."""
        if not self.shares(model):
            return WholeScorer(model)
        mode = _autocast_mode(input_device(model))
        if (states := self._kept(ids, mode)) is not None:
            return _TailScorer(model, self, states)
        if ids.numel() * model.get_input_embeddings().embedding_dim * 4 > MAX_STATE_BYTES:
            return WholeScorer(model)
        return _CapturingScorer(model, self, f"{tensor_digest(ids)}-{mode}", ids, self.start)


class WholeScorer:
    """The whole forward, batch by batch: ``logits(first_row, x)`` of the rows ``x``, then ``done()``."""

    def __init__(self, model: nn.Module):
        self.model = model

    def logits(self, start: int, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, use_cache=False).logits

    def done(self) -> None:
        pass


class _CapturingScorer(WholeScorer):
    """The whole forward, keeping the hidden states entering block ``start`` of every batch."""

    def __init__(self, model: nn.Module, prefix: SharedPrefix, key: str, ids: torch.Tensor, start: int):
        super().__init__(model)
        self.prefix, self.key, self.ids, self.parts = prefix, key, ids.cpu(), []
        self.block = decoder_layers(model)[start]

    def logits(self, start: int, x: torch.Tensor) -> torch.Tensor:
        def keep(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            self.parts.append(h.detach().cpu())

        handle = self.block.register_forward_pre_hook(keep, with_kwargs=True)
        try:
            return super().logits(start, x)
        finally:
            handle.remove()

    def done(self) -> None:
        self.prefix.states[self.key] = (self.ids, torch.cat(self.parts))


class _TailScorer(WholeScorer):
    """The blocks from ``start`` on, the final norm and the head, on the kept hidden states;
    the first batch is checked against the whole forward."""

    def __init__(self, model: nn.Module, prefix: SharedPrefix, states: torch.Tensor):
        super().__init__(model)
        self.prefix, self.states, self.whole, self.checked = prefix, states, False, False
        layers = decoder_layers(model)
        context = capture_layer_context(model, states.shape[1])
        self.blocks = [(layers[i], context[i]) for i in range(prefix.start, len(layers))]
        self.norm, self.head = final_norm(model), model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def logits(self, start: int, x: torch.Tensor) -> torch.Tensor:
        if self.whole:
            return super().logits(start, x)
        got = run_to_logits(self.states[start:start + x.shape[0]].to(self.head.weight.device), self.blocks,
                            self.norm, self.head, self.softcap)
        if not self.checked:  # the first batch, run whole too
            self.checked = True
            want = super().logits(start, x)
            gap = (token_nll(got, x) - token_nll(want, x)).abs().max().item()
            if not gap <= AGREE:
                name = type(self.model).__name__
                log.warning("%s: scoring from the shared first %d blocks disagrees with the whole forward (a token's "
                            "loss off by %.3g); it is scored whole", name, self.prefix.start, gap)
                self.prefix.refused.add(name)
                self.whole = True
                return want
        return got


def _autocast_mode(device: torch.device) -> str:
    """What the forward computes in now: the states kept under one autocast serve only it."""
    kind = device.type
    return str(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else "fp32"


def token_nll(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each next-token loss of the rows ``x`` ``[B, T]`` from their ``logits``: ``[B, T - 1]`` (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp[:, :-1].gather(-1, x[:, 1:, None])[..., 0]


def first_changed_block(plan: PrunePlan) -> int:
    """The first block a block-pruning ``plan`` removes or a recovery module of it trains
    (dense numbering): the blocks before it are the dense model's in every model of the run,
    unless a method changes them all (which :meth:`SharedPrefix.shares` finds); 0 where it
    removes none."""
    trained = [g.module_layers[0] for g in plan.groups if g.module_layers]
    return min(list(plan.removed) + trained) if plan.removed else 0
