"""Next-token cross-entropy through a frozen LM head, its gradient computed with the loss: one copy of the logits.

A plain ``cross_entropy(head(h).float(), labels)`` on a batch of 8 rows of 256 tokens and a
49k vocabulary (SmolLM2) materialises the logits several times over: the head's output, its
fp32 copy, the shifted copy, the log-softmax and, in the backward pass, the gradient of each:
about 2 GB of short-lived tensors per step, allocated and paged in afresh every time.
:func:`linear_cross_entropy` computes the loss and the gradient with respect to the hidden
states together, ``chunk`` tokens at a time (the idea of the fused linear cross-entropy of
Liger-Kernel and of Apple's "Cut Your Losses in Large-Vocabulary Language Models", here in
plain PyTorch): the same matrix products as the forward and backward passes of the plain
version, with one fp32 copy of a chunk's logits turned into its gradient in place. The chunks
bound the memory (:data:`CHUNK_LOGITS`); on a CPU they are best large: the default run's tail
(8 × 255 tokens, 49k vocabulary) was 1.23× faster than plain in one chunk and slower than plain
in chunks of 85 tokens, whose products are too thin (``benchmarks/bench_next_token_loss.py``,
the family 26 EPYC, bf16; docs/speed.md). The head's weights must be
frozen (they get no gradient), which is what a recovery through the frozen tail, and LoRA
(the head is not adapted), train with.

The chunk's logits are computed as the plain version computes them (under the caller's
autocast: bf16 products, the softmax in fp32), so the loss is the same to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: logits held at once (tokens x vocabulary): 128M floats, 512 MB in fp32
CHUNK_LOGITS = 1 << 27


def _chunk_tokens(vocab: int) -> int:
    return max(16, CHUNK_LOGITS // max(vocab, 1))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, labels, softcap, ignore_index):
        n = h.shape[0]
        count = (labels != ignore_index).sum()
        denom = count.clamp(min=1).float()
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        step = _chunk_tokens(weight.shape[0])
        for s in range(0, n, step):
            y = labels[s:s + step]
            z = F.linear(h[s:s + step], weight, bias).float()
            if softcap:
                t = torch.tanh(z / softcap)
                z = t * softcap
            keep = y != ignore_index
            safe = torch.where(keep, y, torch.zeros_like(y))
            lse = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, safe[:, None]).squeeze(1)
            total += ((lse - picked) * keep).sum()
            if grad is not None:
                # d loss / d z = (softmax(z) - onehot(y)) / count, rows of ignored tokens 0
                dz = z.sub_(lse[:, None]).exp_()
                dz.scatter_add_(1, safe[:, None], -torch.ones_like(dz[:, :1]))
                dz.mul_((keep.float() / denom)[:, None])
                if softcap:
                    dz.mul_(1 - t * t)
                grad[s:s + step] = _grad_input(dz, weight, h.dtype)
        if grad is not None:
            ctx.save_for_backward(grad)
        return total / denom

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g.to(grad.dtype), None, None, None, None, None


def _grad_input(dz: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dz @ weight`` as the plain version's backward computes it: in the autocast dtype
    where one is active (the logits' gradient cast down, as the cast in the forward pass casts
    it back), else in the weight's."""
    device = dz.device.type
    if torch.is_autocast_enabled(device):
        lower = torch.get_autocast_dtype(device)
        return (dz.to(lower) @ weight.to(lower)).to(dtype)
    return (dz.to(weight.dtype) @ weight).to(dtype)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None, softcap: float | None = None,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``softcap(h @ weightᵀ + bias)`` against ``labels``.

    ``h``: ``[N, d]`` hidden states (the only input that gets a gradient); ``weight``: the
    head's ``[V, d]``; ``labels``: ``[N]``, ``ignore_index`` where a token is not scored;
    ``softcap``: Gemma's final logit soft-capping (``tanh(z / c) · c``), None for none."""
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("linear_cross_entropy trains no head: its weight must be frozen")
    return _LinearCrossEntropy.apply(h, weight, bias, labels, softcap, ignore_index)


def fusable(head: nn.Module) -> bool:
    """Whether :func:`head_cross_entropy` can fuse ``head``: a plain linear layer whose
    weights are frozen and in memory (not a quantised layer, not on the meta device where an
    offloading hook would bring them in)."""
    w = getattr(head, "weight", None)
    b = getattr(head, "bias", None)
    return (type(head) is nn.Linear and w is not None and w.device.type != "meta" and not w.requires_grad
            and (b is None or not b.requires_grad))


def head_cross_entropy(h: torch.Tensor, head: nn.Module, labels: torch.Tensor,
                       softcap: float | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``head``'s (soft-capped) logits of ``h`` ``[N, d]`` against
    ``labels`` ``[N]``: :func:`linear_cross_entropy` where the head is :func:`fusable`, else the
    plain computation."""
    if fusable(head):
        return linear_cross_entropy(h, head.weight, labels, bias=head.bias, softcap=softcap)
    logits = head(h).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels)


__all__ = ["linear_cross_entropy", "head_cross_entropy", "fusable", "CHUNK_LOGITS"]
