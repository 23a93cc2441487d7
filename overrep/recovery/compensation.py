"""Magnitude compensation at the gap a removed run leaves: Prune&Comp and LinearPatch.

After a run ``[a, b]`` is removed, the block after it receives the residual stream of
block ``a`` (``X_before``) where it was trained on that of block ``b + 1`` (``X_after``),
which is larger: the stream grows with depth.

**Prune&Comp** (AAAI 2026, ``magcomp.py``) multiplies the whole stream before the gap by
one scalar ``s = mean|X_after| / mean|X_before|``. Every block normalises its input
(RMSNorm is scale-invariant), so scaling the embeddings and every projection that writes
into the residual before the gap (``o_proj``, ``down_proj``) by s scales the stream there
by exactly s and changes nothing else (:func:`fold_scale`). With tied embeddings the head
would scale too; dividing the final norm's gain by s undoes that exactly. Here s is
measured on the compact model as it is (after earlier gaps' compensation), over the
tokens ``tokens`` selects (see :func:`~overrep.recovery.closed_form.token_weights`).

**LinearPatch** (Chen et al., NeurIPS 2025, ``block_scaling.py``): ``h <- h P`` at the
gap with ``P = H diag(d) H^T``, H a normalised Hadamard matrix and
``d_k = mean|X_after H|_k / mean|X_before H|_k``. P is a d x d operation the stock
architecture has no place for: :func:`linear_patch` applies it as a hook, for evaluation
only; a model carrying it cannot be exported as a plain checkpoint. :func:`tune_patches` is
the reference's offline distillation of the patch (``efficient_distill.py``); the methods
``linearpatch`` and ``linearpatch-kd`` (:mod:`overrep.recovery.methods.patch`) run them in a run, which
scores the patched model and exports nothing.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.precision import autocast
from ..errors import OverRepError
from ..model.arch import block_parts, decoder_layers, final_norm
from ..model.placement import input_device
from ..model.surgery import PrunePlan, contiguous_runs
from .closed_form import _block_output, token_weights
from .losses import topk_kl
from .teacher_stats import teacher_topk
from ..core.schedule import lr_factor

log = logging.getLogger(__name__)


def _gap(pruned: nn.Module, dense: nn.Module, plan: PrunePlan, run: tuple[int, int], ids: torch.Tensor,
         batch: int):
    """Per batch: (compact stream entering the gap ``[B, T, d]``, dense ``X_after``)."""
    a, b = run
    for i in range(0, ids.shape[0], batch):
        rows = ids[i:i + batch]
        if a == 0:  # the embeddings enter the compact block 0
            before, _ = _block_output(pruned, 0, rows, before=True)
        else:
            before, _ = _block_output(pruned, plan.compact_index(a - 1), rows)
        after, _ = _block_output(dense, b, rows)
        yield before.float(), after.float().to(before.device)


def residual_writers(layer: nn.Module, index: int) -> list[nn.Linear]:
    """The projections whose outputs block ``index`` adds to the residual stream as they are."""
    parts = block_parts(layer, index)
    if parts.experts is not None or parts.frozen:
        raise OverRepError(f"prune&comp: block {index} ({type(layer).__name__}) writes the residual through "
                           "experts or a Mamba mixer; the exact scale fold covers attention + dense MLP blocks")
    names = [k for k in ("o", "down") if k in parts.projections]
    return [getattr(*parts.projections[k]) for k in names]


@torch.no_grad()
def _scale_gain(norm: nn.Module, factor: float) -> None:
    """Multiply what ``norm`` outputs by ``factor`` through its gain (``w`` or Gemma's ``1 + w``)."""
    x = torch.randn(2, norm.weight.shape[0], dtype=norm.weight.dtype, device=norm.weight.device)
    want = norm(x) * factor
    w = norm.weight.detach().clone()
    for candidate in (w * factor, (1 + w) * factor - 1):
        norm.weight.copy_(candidate)
        if torch.allclose(norm(x), want, rtol=1e-4, atol=1e-6):
            return
    norm.weight.copy_(w)
    raise OverRepError(f"prune&comp: cannot rescale the gain of {type(norm).__name__} (tied embeddings)")


@torch.no_grad()
def fold_scale(model: nn.Module, cut: int, s: float) -> None:
    """Scale the residual stream entering compact block ``cut`` (and all before) by ``s``:
    embeddings and every residual writer of blocks ``< cut``; a tied head is compensated at
    the final norm so the logits of an unchanged stream stay equal."""
    layers = decoder_layers(model)
    writers = [p for i in range(cut) for p in residual_writers(layers[i], i)]
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.weight.data_ptr()
    emb.weight.mul_(s)
    for p in writers:
        p.weight.mul_(s)
        if p.bias is not None:
            p.bias.mul_(s)
    if tied:
        _scale_gain(final_norm(model), 1.0 / s)


@torch.no_grad()
def prunecomp(pruned: nn.Module, dense: nn.Module, plan: PrunePlan, ids: torch.Tensor, *, tokens: str = "all",
              batch: int = 8) -> dict:
    """Prune&Comp on every gap, in order, in place; the scale of each."""
    was = pruned.training
    pruned.eval()
    scales = []
    for run in contiguous_runs(plan.removed):
        if run[1] == plan.num_layers - 1:  # the final norm follows: a scale would change nothing
            continue
        num = den = 0.0
        for before, after in _gap(pruned, dense, plan, run, ids, batch):
            keep = (token_weights(after, tokens) > 0).unsqueeze(-1)
            num += (after.abs() * keep).sum().item()
            den += (before.abs() * keep).sum().item()
        s = num / den
        fold_scale(pruned, 0 if run[0] == 0 else plan.compact_index(run[0] - 1) + 1, s)
        scales.append({"run": list(run), "scale": s})
    pruned.train(was)
    return {"scales": scales, "tokens_spec": tokens}


# ---- LinearPatch (a reference: an extra d x d operation, not exportable) -------------------------

def _is_prime(q: int) -> bool:
    return q > 1 and all(q % k for k in range(2, int(q ** 0.5) + 1))


def _paley(q: int) -> torch.Tensor:
    """Paley's construction I: a Hadamard matrix of order q + 1 for a prime q = 3 mod 4."""
    chi = torch.zeros(q)
    for x in range(1, q):
        chi[x * x % q] = 1
    chi[chi == 0] = -1
    chi[0] = 0
    i = torch.arange(q)
    s = torch.zeros(q + 1, q + 1)
    s[0, 1:], s[1:, 0] = 1, -1
    s[1:, 1:] = chi[(i[None, :] - i[:, None]) % q]
    return s + torch.eye(q + 1)


@functools.lru_cache(maxsize=None)
def _hadamard(n: int) -> torch.Tensor | None:
    if n == 1:
        return torch.ones(1, 1)
    if n % 2 == 0 and (h := _hadamard(n // 2)) is not None:
        return torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    for m in range(4, n + 1, 4):  # Paley orders q + 1 that divide n
        if n % m == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3 and (h := _hadamard(n // m)) is not None:
            return torch.kron(_paley(m - 1), h)
    return None


def hadamard(n: int) -> torch.Tensor:
    """An orthonormal ``[n, n]`` rotation: a normalised Hadamard matrix (Sylvester and Paley I
    products), or, for an order those do not reach, a seeded random orthogonal matrix."""
    h = _hadamard(n)
    if h is None:
        log.info("no Hadamard matrix of order %d from Sylvester/Paley products: a random rotation instead", n)
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
        return q.float()
    return h / n ** 0.5


@torch.no_grad()
def linear_patch(pruned: nn.Module, dense: nn.Module, plan: PrunePlan, ids: torch.Tensor, *, tokens: str = "all",
                 batch: int = 8, trainable: bool = False) -> list:
    """LinearPatch at every gap as forward pre-hooks on ``pruned``. Returns one
    :class:`PatchHook` per gap (``.matrix`` the ``[d, d]`` patch, an ``nn.Parameter`` when
    ``trainable``; ``.remove()`` undoes it). Not foldable: evaluation only."""
    was = pruned.training
    pruned.eval()
    hooks = []
    layers = decoder_layers(pruned)
    for run in contiguous_runs(plan.removed):
        num = den = None
        rot = None
        for before, after in _gap(pruned, dense, plan, run, ids, batch):
            rot = hadamard(before.shape[-1]).to(before.device) if rot is None else rot
            keep = (token_weights(after, tokens) > 0).flatten()
            a = (after.flatten(0, 1)[keep] @ rot).abs().sum(0)
            b = (before.flatten(0, 1)[keep] @ rot).abs().sum(0)
            num, den = (a, b) if num is None else (num + a, den + b)
        patch = rot @ torch.diag(num / den.clamp_min(1e-12)) @ rot.T
        target = final_norm(pruned) if run[1] == plan.num_layers - 1 else (
            layers[0] if run[0] == 0 else layers[plan.compact_index(run[0] - 1) + 1])
        hooks.append(PatchHook(target, nn.Parameter(patch) if trainable else patch))
    pruned.train(was)
    return hooks


class PatchHook:
    """``h <- h @ matrix`` on the input of ``target`` (a forward pre-hook)."""

    def __init__(self, target: nn.Module, matrix: torch.Tensor):
        self.matrix = matrix
        self.handle = target.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if args:
            return (args[0] @ self.matrix.to(args[0].dtype), *args[1:]), kwargs
        h = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": h @ self.matrix.to(h.dtype)}

    def remove(self) -> None:
        self.handle.remove()


def tune_patches(model: nn.Module, hooks: list[PatchHook], dense: nn.Module, ids: torch.Tensor, *, k: int = 50,
                 lr: float = 1e-4, min_lr_ratio: float = 0.1, batch: int = 8, precision: str = "fp32",
                 progress: bool = False) -> dict:
    """LinearPatch's offline distillation (the reference's ``output_kl``): only the patch
    matrices train, one pass over ``ids`` with AdamW (lr 1e-4, cosine to ``lr *
    min_lr_ratio``) on KL(teacher || student) renormalised on the dense model's top-``k``
    next tokens. The dense top-k is computed per batch (no cache). Returns the loss of the
    first and last batches and the seconds."""
    params = [h.matrix for h in hooks]
    if not all(isinstance(p, nn.Parameter) for p in params):
        raise OverRepError("tune_patches needs trainable patches: linear_patch(..., trainable=True)")
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = -(-ids.shape[0] // batch)
    device, losses, t0, was = input_device(model), [], time.perf_counter(), model.training
    model.eval()  # (no dropout: the patch learns the model as it will be scored)
    try:
        for step in tqdm(range(steps), desc="LinearPatch KD", disable=not progress):
            rows = ids[step * batch:(step + 1) * batch].to(device)
            with torch.no_grad(), autocast(precision, device):
                values, indices = teacher_topk(dense, rows, k, batch=batch)
            for g in opt.param_groups:
                g["lr"] = lr * lr_factor(step, steps, 0.0, min_lr_ratio)  # the trainer's schedule, no warm-up
            with autocast(precision, device):
                logits = model(input_ids=rows, use_cache=False).logits.float()
            loss = topk_kl(logits, values.to(device), indices.to(device))
            if not torch.isfinite(loss):
                raise OverRepError(f"LinearPatch distillation: non-finite loss at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        for p in frozen:
            p.requires_grad_(True)
        model.train(was)
    return {"steps": steps, "first_loss": losses[0], "last_loss": losses[-1], "lr": lr, "k": k,
            "seconds": time.perf_counter() - t0}
