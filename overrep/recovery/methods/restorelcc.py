"""RestoreLCC: lost-component compensation of the attention heads pruning hurt most.

Feng et al., "Restoring Pruned Large Language Models via Lost Component Compensation"
(NeurIPS 2025, arXiv 2510.21834; reference code zijian678/RestoreLCC). Written here from the
paper and from reading the reference code (``utils/components.py``,
``models/modeling_llama.py``, ``RestoreLCC_train.py``); none of it is copied.

1. **Probe** (:mod:`.restorelcc_probe`): per head, the dense-minus-pruned head outputs on the
   same text, their SVD directions, the lost component (their mean on the top ``k``
   directions) and a score: how much adding the lost component to the pruned head lowers
   the loss (activation editing).
2. **Select** the top ``recovery.restorelcc_heads`` heads by score (the reference trains
   128, 256 or 512 of LLaMA-7B's 1024 heads; 256, a quarter, is its default). After block
   removal the blocks before the removed run compute what the dense ones did: their heads
   score 0 and have no lost component, so where the quota reaches them (ties: lower block
   first) they get only the free vector ``b_h``. Restricting the choice to changed heads was
   measured and is worse (SmolLM2, `last` mask 25%, 32 steps: 5.2M against 341K).
3. **Compensate**: each selected head's output (the input of ``o_proj``) becomes
   ``z_h + U_hᵀ m_h + b_h``, with ``U_h`` the head's lost-component directions (``head_dim``
   unit rows, fixed), ``m_h`` their learnable magnitudes and ``b_h`` a learnable free
   component, both ``head_dim`` vectors drawn from N(0, ``restorelcc_init_std``) (the
   reference's 1e-3). Nothing else trains: ``2 * head_dim`` parameters per head.
4. **Train** on the language-model loss, no weight decay (the reference: completion-only
   SFT on Alpaca, AdamW at 1e-3, 3 epochs; here the shared trainer and schedule).
5. **Merge**: the added vector does not depend on the input, so ``o_proj(z + δ) = o_proj(z)
   + W_o δ``: an ``o_proj`` bias. A Hugging Face config can only state that bias through
   ``attention_bias``, which in LLaMA, Qwen3, Gemma 3 and Qwen3-MoE puts a bias on q, k, v
   and o of *every* block: the merge switches it on, gives q, k and v zero biases and o the
   bias ``W_o δ`` (zero in blocks without a selected head). Those bias parameters are the
   compact model's only growth (``restorelcc_bias_params``; none if the model already had
   ``attention_bias``). An architecture whose config cannot state an ``o_proj`` bias
   (Mistral, Qwen2) or that has blocks without attention (hybrid Mamba) is refused at set-up.

Differences from the reference, and why:

* *Head score.* The reference scores a head by the validation accuracy of a linear probe
  telling a correct answer from a similar wrong one (labelled task data; answers paired by
  sentence similarity), on the dense answer activation next to the edited pruned activation.
  Our training data is unlabelled text, so the contrast is the true next token against the
  rest, and the score is the loss the edit recovers (first-order from one backward pass by
  default; ``restorelcc_probe: edit`` measures it with a forward pass per head).
* *Probe samples.* The reference compares last-token activations of 1000 prompts; here every
  token of ``restorelcc_probe_rows`` rows (8 x 256 = 2048 samples by default).
* *Pairing.* Whole blocks are removed here, so retained block ``j`` of the pruned model is
  compared with the same block (its original index) in the dense model.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import OverRepError
from ...model.arch import block_parts, decoder_layers
from ...model.surgery import PrunePlan
from ..objectives import LanguageModeling
from ..teacher import MethodInputs
from .base import Method, MethodRun, check_fold, logits_of
from .restorelcc_probe import PROBE_MODES, cached_probe, head_shape, o_projections, select_heads


def bias_projections(model: nn.Module) -> list[str]:
    """The attention projections ``attention_bias: true`` gives a bias in ``model``'s
    architecture (found by building its attention on the meta device); one error if ``o`` is
    not among them or a block has no attention."""
    o_projections(model)  # every block has attention
    name = type(model).__name__
    found: set[str] | None = None
    for i, layer in enumerate(decoder_layers(model)):
        parts = block_parts(layer, i)
        attn = parts.attention
        config = copy.deepcopy(model.config)
        config.attention_bias = True
        try:
            with torch.device("meta"):
                built = type(attn)(config, layer_idx=getattr(attn, "layer_idx", i))
            got = {k for k in ("q", "k", "v", "o")
                   if getattr(getattr(built, parts.projections[k][1], None), "bias", None) is not None}
        except Exception:
            got = set()
        if found is not None and got != found:
            got = set()
        if "o" not in got:
            raise OverRepError(f"restorelcc merges its head vectors as an o_proj bias, which the {name} config cannot "
                               f"state (no attention_bias switch for o_proj); it supports Llama, Qwen3, Gemma 3 "
                               f"and Qwen3-MoE")
        found = got
    return sorted(found or ())


class HeadCompensation(nn.Module):
    """The learnable vectors of the selected heads, added to ``o_proj``'s input by pre-hooks.

    Per block with selected heads: ``directions`` [n, D, D] (fixed), ``magnitudes`` and
    ``components`` [n, D] (trained); the head's added vector is ``directionsᵀ magnitudes +
    components``. The model's own modules and state dict are left as they are.
    """

    def __init__(self, model: nn.Module, heads: list[tuple[int, int]], directions: torch.Tensor, *,
                 init_std: float, seed: int):
        super().__init__()
        self.num_heads, self.head_dim = head_shape(model)
        self.o_projs = o_projections(model)
        self.blocks = sorted({j for j, _ in heads})
        self.heads = [[h for b, h in heads if b == j] for j in self.blocks]
        device = self.o_projs[0].weight.device
        g = torch.Generator().manual_seed(seed)
        self.magnitudes, self.components = nn.ParameterList(), nn.ParameterList()
        for i, (j, hs) in enumerate(zip(self.blocks, self.heads)):
            self.register_buffer(f"directions_{i}", directions[j, hs].float().clone().to(device))
            for plist in (self.magnitudes, self.components):
                plist.append(nn.Parameter((torch.randn(len(hs), self.head_dim, generator=g) * init_std).to(device)))
        self.handles = [self.o_projs[j].register_forward_pre_hook(self._hook(i)) for i, j in enumerate(self.blocks)]

    def directions(self, i: int) -> torch.Tensor:
        return getattr(self, f"directions_{i}")

    def delta(self, i: int) -> torch.Tensor:
        """The vector added to the input of ``o_proj`` of the ``i``-th compensated block [H * D]."""
        add = torch.einsum("nij,ni->nj", self.directions(i), self.magnitudes[i]) + self.components[i]
        index = torch.tensor(self.heads[i], device=add.device)
        out = torch.zeros(self.num_heads, self.head_dim, device=add.device, dtype=add.dtype).index_add(0, index, add)
        return out.reshape(-1)

    def _hook(self, i: int):
        def fn(module, args):
            x = args[0]
            return (x + self.delta(i).to(x.dtype),) + tuple(args[1:])
        return fn

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @torch.no_grad()
    def merge(self, model: nn.Module, projections: list[str]) -> int:
        """Remove the hooks and fold every added vector into an ``o_proj`` bias, switching the
        config's ``attention_bias`` on where it is off; the parameters that adds."""
        self.remove_hooks()
        added = 0
        if not getattr(model.config, "attention_bias", False):
            model.config.attention_bias = True
            for i, layer in enumerate(decoder_layers(model)):
                for key in projections:
                    parent, attr = block_parts(layer, i).projections[key]
                    lin = getattr(parent, attr)
                    if lin.bias is None:
                        w = lin.weight
                        lin.bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device),
                                                requires_grad=False)
                        added += w.shape[0]
        for i, j in enumerate(self.blocks):
            o = self.o_projs[j]
            bias = o.weight.double() @ self.delta(i).double().to(o.weight.device)
            o.bias.copy_((o.bias.double() + bias).to(o.bias.dtype))
        return added


class CompensationLanguageModeling(LanguageModeling):
    """Language modelling through the compensated heads; the heads and their fixed
    directions travel with a checkpoint, so a resumed run compensates the same heads."""

    def __init__(self, model, train_ids, val_ids, comp: HeadCompensation, precision: str = "fp32"):
        super().__init__(model, train_ids, val_ids, params=list(comp.parameters()), decayed=set(),
                         precision=precision)
        self.comp = comp

    def extra_state(self) -> dict:
        c = self.comp
        return {"heads": [[j, h] for j, hs in zip(c.blocks, c.heads) for h in hs],
                "directions": [c.directions(i).cpu() for i in range(len(c.blocks))]}

    def load_extra_state(self, state: dict) -> None:
        if not state:
            return
        mine = self.extra_state()["heads"]
        if [list(x) for x in state["heads"]] != mine:
            raise OverRepError("the checkpoint compensates other attention heads than this run's probe selected "
                               "(remove the checkpoints or match the configuration)")
        for i, d in enumerate(state["directions"]):
            self.comp.directions(i).copy_(d)


class RestoreLCCRun(MethodRun):
    """RestoreLCC on one block-pruned model: probe, select, compensate, train, merge."""

    def __init__(self, inputs: MethodInputs, method: Method, *, with_data: bool = True):
        super().__init__(inputs, method, with_data=with_data)
        r, model = inputs.config, inputs.pruned
        if not isinstance(inputs.plan, PrunePlan):
            raise OverRepError("restorelcc pairs each retained block with the same dense block; it needs block "
                               "removal (prune.granularity: blocks)")
        self.projections = bias_projections(model)  # refuses an unmergeable architecture before any work
        model.requires_grad_(False)
        root = inputs.teacher.cache_root if inputs.teacher is not None else None
        rows = inputs.train_ids[:r.restorelcc_probe_rows]
        t0 = time.perf_counter()
        self.probe = cached_probe(model, inputs.dense, inputs.plan.kept, rows, components=r.restorelcc_components,
                                  mode=r.restorelcc_probe, root=root)
        self.probe_seconds = time.perf_counter() - t0  # this set-up's share of the wall-clock (a cache hit: a read)
        # the pipeline's accounting of a method's search before training (MethodRun): the probe's cost
        # counts in the run's timings; a time budget's rebuild reads it back instead of probing again
        self.search_seconds, self.searched_now = self.probe.seconds, not self.probe.cached
        self.heads = select_heads(self.probe.scores, r.restorelcc_heads)
        self.comp = HeadCompensation(model, self.heads, self.probe.directions, init_std=r.restorelcc_init_std,
                                     seed=r.seed)
        self.objective = CompensationLanguageModeling(model, inputs.train_ids, inputs.val_ids, self.comp,
                                                      precision=r.precision)

    def selected(self) -> list[dict]:
        kept = self.inputs.plan.kept
        return [{"block": kept[j], "compact_block": j, "head": h, "score": float(self.probe.scores[j, h]) + 0.0}
                for j, h in self.heads]

    def summary(self) -> dict:
        p = self.probe
        return {"heads": self.selected(), "heads_total": int(p.scores.numel()), "probe": p.mode,
                "probe_seconds": self.probe_seconds, "probe_computed_seconds": p.seconds, "probe_cached": p.cached,
                "probe_rows": int(min(self.inputs.config.restorelcc_probe_rows, self.inputs.train_ids.shape[0])),
                "probe_base_loss": p.base_loss, "components": int(min(self.inputs.config.restorelcc_components,
                                                                       self.comp.head_dim)),
                "head_dim": self.comp.head_dim, "trainable_params": self.trainable_params}

    def finish(self) -> dict:
        probe = self.inputs.heldout_ids[:2]
        before = logits_of(self.model, probe)
        added = self.comp.merge(self.model, self.projections)
        out = check_fold(before, logits_of(self.model, probe), "restorelcc merge", self.model.dtype)
        return {**out, "restorelcc_bias_params": added, "restorelcc": self.summary()}

    def describe(self) -> dict:
        return {**super().describe(), "restorelcc": self.summary()}


@dataclass
class RestoreLCCOptions:
    """``recovery`` options of RestoreLCC: learnable vectors on the attention heads a probe
    found pruning hurt most."""

    restorelcc_heads: float = 0.25  # heads compensated: a fraction (<= 1) of all heads of the pruned model, or a whole count (> 1); the reference's default is a quarter
    restorelcc_components: int = 10  # top SVD directions of a head's dense-minus-pruned outputs whose mean part is its lost component (the probe's edit)
    restorelcc_probe_rows: int = 8  # training rows (every token) the dense and pruned heads are compared and probed on
    restorelcc_probe: str = "gradient"  # head score: "gradient" (loss change of the edit to first order, one backward) | "edit" (measured, one forward per head)
    restorelcc_init_std: float = 1e-3  # std of the normal init of the magnitudes and the free component (the reference's; 0: start exactly at the pruned model)

    def check_restorelcc(self) -> None:
        h = self.restorelcc_heads
        if not h > 0 or (h > 1 and h != int(h)):
            raise OverRepError(f"recovery.restorelcc_heads must be a fraction in (0, 1] or a whole count > 1, got {h}")
        if self.restorelcc_components < 1 or self.restorelcc_probe_rows < 1:
            raise OverRepError("recovery.restorelcc_components and restorelcc_probe_rows must be >= 1")
        if self.restorelcc_probe not in PROBE_MODES:
            raise OverRepError(f"recovery.restorelcc_probe must be one of {', '.join(PROBE_MODES)}, "
                               f"got '{self.restorelcc_probe}'")
        if self.restorelcc_init_std < 0:
            raise OverRepError(f"recovery.restorelcc_init_std must be >= 0, got {self.restorelcc_init_std}")
