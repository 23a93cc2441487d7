"""What the dense model says about the training rows, computed once per run and cached next to
the features: the diagonal Fisher at a module's output point (the ``fisher`` loss) and the
top-K next-token log-probabilities of every position (``kl-topk`` and ``ce+kl``)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..memo import digest, memoised
from ..model.arch import decoder_layers, final_norm
from ..model.placement import input_device


def _cache_file(root: Path, kind: str, key: dict) -> Path:
    return root / "features" / f"{kind}-{digest(key)}.pt"


def fisher_diagonal(dense: nn.Module, ids: torch.Tensor, groups, batch: int = 8) -> list[torch.Tensor]:
    """Per group, ``E[(∂CE/∂h)²]`` per channel at the group's output point (the output of
    ``target_layer``, or of the final norm), normalised to mean 1, from the dense model's
    own next-token loss on ``ids``."""
    layers = decoder_layers(dense)
    sums = [torch.zeros(dense.config.hidden_size, dtype=torch.float64) for _ in groups]
    count = 0
    device = input_device(dense)
    was = dense.training
    dense.eval()
    for gi, g in enumerate(groups):  # one pass per group: cutting the graph at one point hides the others
        where = final_norm(dense) if g.final_norm else layers[g.target_layer]
        for i in range(0, ids.shape[0], batch):
            x = ids[i:i + batch].to(device)
            grabbed: list[torch.Tensor] = []

            def leaf(module, args, output):
                h = output[0] if isinstance(output, tuple) else output
                h = h.detach().requires_grad_(True)
                grabbed.append(h)
                return (h, *output[1:]) if isinstance(output, tuple) else h

            handle = where.register_forward_hook(leaf)
            try:
                with torch.enable_grad():
                    logits = dense(input_ids=x, use_cache=False).logits[:, :-1].float()
                    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                         reduction="sum")
                    (grad,) = torch.autograd.grad(ce, grabbed[0])
            finally:
                handle.remove()
            sums[gi] += grad[:, :-1].double().pow(2).sum((0, 1)).cpu()
            if gi == 0:
                count += x.shape[0] * (x.shape[1] - 1)
    dense.train(was)
    out = []
    for s in sums:
        f = s / count
        out.append((f / f.mean().clamp_min(1e-30)).float())
    return out


def cached_fisher(teacher, rows: int) -> list[torch.Tensor]:
    """``fisher_diagonal`` on the first ``rows`` training rows of a
    :class:`~overrep.recovery.teacher.Teacher`, stored next to its feature cache and keyed
    like it (model, plan, data, sequence length)."""
    n = min(rows, teacher.train_ids.shape[0])
    path = _cache_file(teacher.cache_root, "fisher",
                       {**{k: str(v) for k, v in teacher.fingerprint.items()}, "rows": n})
    weights, _ = memoised(path, lambda: fisher_diagonal(teacher.dense, teacher.train_ids[:n], teacher.plan.groups),
                          "the Fisher cache", valid=lambda got: len(got) == len(teacher.plan.groups),
                          world=teacher.world)  # several ranks: rank 0 computes it, the others read it back
    return list(weights)


@torch.no_grad()
def teacher_topk(dense: nn.Module, ids: torch.Tensor, k: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense model's top-``k`` next-token log-probabilities of every position: values
    (fp32; their softmax is the renormalised top-k distribution, ``1 − Σ exp`` the mass
    outside it) and vocabulary indices (int32), each ``[N, T, k]``."""
    device = input_device(dense)
    vals, idx = [], []
    for i in range(0, ids.shape[0], batch):
        logits = dense(input_ids=ids[i:i + batch].to(device), use_cache=False).logits.float()
        v, j = F.log_softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
        vals.append(v.cpu())
        idx.append(j.to(torch.int32).cpu())
    return torch.cat(vals), torch.cat(idx)


def cached_topk(teacher, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``teacher_topk`` of every training row of a :class:`~overrep.recovery.teacher.Teacher`,
    stored next to its feature cache."""
    fp = teacher.fingerprint
    path = _cache_file(teacher.cache_root, "topk", {"model": fp["model"], "data": str(fp["data"]),
                                                    "seq_len": fp["seq_len"], "dtype": fp["model_dtype"], "k": k,
                                                    "rows": teacher.train_ids.shape[0], "values": "log-probabilities"})

    def topk() -> dict:
        values, indices = teacher_topk(teacher.dense, teacher.train_ids, k)
        return {"values": values, "indices": indices}

    got, _ = memoised(path, topk, f"the top-{k} cache", world=teacher.world)
    return got["values"], got["indices"]
