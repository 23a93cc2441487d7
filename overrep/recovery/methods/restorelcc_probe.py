"""RestoreLCC's probe: which attention heads pruning hurt, and the directions of what they lost.

Idea from Feng et al., "Restoring Pruned Large Language Models via Lost Component
Compensation" (NeurIPS 2025, arXiv 2510.21834; reference code zijian678/RestoreLCC,
``utils/components.py``); written here from its description, not copied.

For every attention head of every retained block, on the same probe rows (the first
``recovery.restorelcc_probe_rows`` training rows, every token position):

* **What pruning took from the head.** The head's output (its ``head_dim`` slice of the
  input of ``o_proj``) in the dense model, at the block's original index, minus the same in
  the pruned model: one row of X per token.
* **Lost-component directions.** X's right singular vectors, largest singular value first
  (the paper's SVD of the activation differences). They are computed from the Gram matrix
  XᵀX accumulated over the rows, so X is never held in memory.
* **Lost component.** X's mean projected on the top ``k`` directions
  (``recovery.restorelcc_components``, the reference's 10): the reference's
  ``sum_{i<k} mean(U[:, i]) S_i V_i`` is exactly this vector.
* **Score (activation editing).** How much adding the head's lost component to the pruned
  head lowers the pruned model's next-token loss on the probe rows: ``gradient`` predicts it
  to first order for every head from one backward pass (``-grad . c``); ``edit`` measures it
  with one forward pass per head (exact, for small models or a GPU).

The result is cached under the cache root, keyed by both models' weights, the blocks kept,
the probe rows and the options, so a time budget's second set-up does not probe again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...errors import OverRepError
from ...model.arch import block_parts, decoder_layers
from ...model.hooks import StopForward, run_hooked
from ...memo import digest, memoised, tensor_digest
from ...model.runtime import model_fingerprint

PROBE_BATCH = 4  # probe rows per forward pass
PROBE_MODES = ("gradient", "edit")
_VERSION = 1  # bump when what the cache holds changes meaning


@dataclass
class Probe:
    """Per compact block ``j`` and head ``h`` (tensors ``[blocks, heads, ...]``)."""

    scores: torch.Tensor  # loss decrease the lost-component edit gives (predicted or measured), float64
    directions: torch.Tensor  # [.., D, D] rows: unit right singular vectors, largest first
    lost: torch.Tensor  # [.., D] the lost component (mean difference on the top-k directions)
    singular: torch.Tensor  # [.., D] singular values of X, largest first
    base_loss: float  # the pruned model's loss on the probe rows
    seconds: float  # time the probe took when it was computed
    mode: str
    cached: bool = False


def o_projections(model: nn.Module) -> list[nn.Linear]:
    """Every decoder block's ``o_proj``; one error if a block has no attention."""
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        parts = block_parts(layer, i)
        if not all(k in parts.projections for k in ("q", "k", "v", "o")):
            raise OverRepError(f"restorelcc compensates attention heads, but decoder block {i} of "
                               f"{type(model).__name__} has no attention (q/k/v/o_proj)")
        parent, attr = parts.projections["o"]
        out.append(getattr(parent, attr))
    return out


def head_shape(model: nn.Module) -> tuple[int, int]:
    """(attention heads per block, head_dim) as the input of ``o_proj`` lays them out."""
    heads = model.config.num_attention_heads
    width = o_projections(model)[0].in_features
    if width % heads:
        raise OverRepError(f"o_proj input width {width} is not a multiple of {heads} attention heads")
    return heads, width // heads


def _hooks(modules: list[nn.Module], store: dict, edits: list[torch.Tensor] | None, stop_at: int | None):
    """Pre-hooks on ``modules``: record their input in ``store[j]``; add ``edits[j]`` to it."""
    handles = []
    for j, m in enumerate(modules):
        def fn(mod, args, j=j):
            x = args[0]
            store[j] = x.detach()
            if j == stop_at:
                raise StopForward
            if edits is not None:
                return (x + edits[j].to(x.dtype),) + tuple(args[1:])
            return None
        handles.append(m.register_forward_pre_hook(fn))
    return handles


def _pruned_loss(model, ids, edits, store=None) -> torch.Tensor:
    handles = _hooks(o_projections(model), {} if store is None else store, edits, None)
    return run_hooked(model, handles, input_ids=ids, labels=ids, use_cache=False).loss


def _dense_outputs(dense, ids, kept: list[int]) -> dict:
    store: dict = {}
    projs = o_projections(dense)
    run_hooked(dense, _hooks([projs[i] for i in kept], store, None, len(kept) - 1), input_ids=ids, use_cache=False)
    return store


def _directions(gram: torch.Tensor, mean: torch.Tensor, k: int):
    """Right singular vectors (rows, largest first, sign fixed), singular values and the lost
    component of each head, from its Gram matrix ``[H, D, D]`` and mean difference ``[H, D]``."""
    eigvals, eigvecs = torch.linalg.eigh(gram)
    vecs = eigvecs.flip(-1).transpose(-1, -2)  # [H, D(direction), D]
    sign = torch.sign(vecs.gather(-1, vecs.abs().argmax(-1, keepdim=True)))
    vecs = vecs * torch.where(sign == 0, torch.ones_like(sign), sign)
    singular = eigvals.flip(-1).clamp_min(0).sqrt()
    coeff = torch.einsum("hid,hd->hi", vecs[:, :k], mean)
    return vecs, singular, torch.einsum("hi,hid->hd", coeff, vecs[:, :k])


def run_probe(pruned: nn.Module, dense: nn.Module, kept: list[int], ids: torch.Tensor, *, components: int,
              mode: str) -> Probe:
    """Probe every head of ``pruned`` (compact block ``j`` = dense block ``kept[j]``) on ``ids``."""
    if mode not in PROBE_MODES:
        raise OverRepError(f"recovery.restorelcc_probe must be one of {', '.join(PROBE_MODES)}, got '{mode}'")
    t0 = time.perf_counter()
    heads, dim = head_shape(pruned)
    blocks = len(kept)
    device = next(pruned.parameters()).device
    modes = (pruned.training, dense.training)
    pruned.eval()
    dense.eval()
    gram = torch.zeros(blocks, heads, dim, dim, dtype=torch.float64)
    total = torch.zeros(blocks, heads, dim, dtype=torch.float64)
    grads = torch.zeros(blocks, heads * dim, dtype=torch.float64)
    base, n, rows = 0.0, 0, ids.shape[0]
    try:
        for start in range(0, rows, PROBE_BATCH):
            chunk = ids[start:start + PROBE_BATCH].to(device)
            weight = chunk.shape[0] / rows
            with torch.no_grad():
                dense_out = _dense_outputs(dense, chunk, kept)
            edits = [torch.zeros(heads * dim, device=device, requires_grad=mode == "gradient") for _ in kept]
            store: dict = {}
            with torch.set_grad_enabled(mode == "gradient"):
                loss = _pruned_loss(pruned, chunk, edits, store) * weight
            if mode == "gradient":
                for j, g in enumerate(torch.autograd.grad(loss, edits)):
                    grads[j] += g.double().cpu()
            base += loss.item()
            for j in range(blocks):
                x = (dense_out[j].double() - store[j].double()).reshape(-1, heads, dim).cpu()
                gram[j] += torch.einsum("nhd,nhe->hde", x, x)
                total[j] += x.sum(0)
                if j == 0:
                    n += x.shape[0]
        k = max(1, min(components, dim))
        found = [_directions(gram[j], total[j] / n, k) for j in range(blocks)]
        directions = torch.stack([f[0] for f in found])
        singular = torch.stack([f[1] for f in found])
        lost = torch.stack([f[2] for f in found])
        if mode == "gradient":
            scores = -(grads.view(blocks, heads, dim) * lost).sum(-1)
        else:
            scores = _edit_scores(pruned, ids, lost, base, device)
    finally:
        pruned.train(modes[0])
        dense.train(modes[1])
    return Probe(scores, directions.float(), lost.float(), singular.float(), base, time.perf_counter() - t0, mode)


@torch.no_grad()
def _edit_scores(pruned, ids, lost: torch.Tensor, base: float, device) -> torch.Tensor:
    """Activation editing, measured: the loss with one head's lost component added, per head."""
    blocks, heads, dim = lost.shape
    scores = torch.zeros(blocks, heads, dtype=torch.float64)
    rows = ids.shape[0]
    for j in range(blocks):
        for h in range(heads):
            edits = [torch.zeros(heads * dim, device=device) for _ in range(blocks)]
            edits[j][h * dim:(h + 1) * dim] = lost[j, h].to(device, torch.float32)
            loss = sum(_pruned_loss(pruned, ids[s:s + PROBE_BATCH].to(device), edits).item()
                       * min(PROBE_BATCH, rows - s) / rows for s in range(0, rows, PROBE_BATCH))
            scores[j, h] = base - loss
    return scores


def cached_probe(pruned: nn.Module, dense: nn.Module, kept: list[int], ids: torch.Tensor, *, components: int,
                 mode: str, root: Path | None) -> Probe:
    """:func:`run_probe`, reused from ``root/restorelcc`` when the same probe ran before."""
    if root is None:
        return run_probe(pruned, dense, kept, ids, components=components, mode=mode)
    key = digest({"version": _VERSION, "dense": model_fingerprint(dense, ""), "pruned": model_fingerprint(pruned, ""),
                  "kept": list(kept), "rows": tensor_digest(ids), "components": components, "mode": mode})

    def probe() -> dict:
        found = run_probe(pruned, dense, kept, ids, components=components, mode=mode)
        return {k: v for k, v in vars(found).items() if k != "cached"}

    saved, reused = memoised(Path(root) / "restorelcc" / f"probe-{key}.pt", probe, "restorelcc head probe")
    return Probe(**saved, cached=reused)


def select_heads(scores: torch.Tensor, spec: float) -> list[tuple[int, int]]:
    """The top heads by score (ties: lower block, then lower head first): ``spec`` <= 1 is a
    fraction of all heads (at least one), > 1 a count."""
    total = scores.numel()
    count = max(1, int(round(spec * total))) if spec <= 1 else int(spec)
    if count > total:
        raise OverRepError(f"recovery.restorelcc_heads asks for {count} heads; the pruned model has {total}")
    heads = scores.shape[1]
    flat = scores.reshape(-1).tolist()
    order = sorted(range(total), key=lambda i: (-flat[i], i))[:count]
    return sorted((i // heads, i % heads) for i in order)
