"""Overcomplete projections and re-parameterised norms: the trainable parts of OverRep.

The maths (paper, ``eq:overcomplete-projection-with-va`` and ``eq:reparam``). A pretrained
projection ``P`` (``[d_out, d_in]``, optional bias ``b``) trains as

    output side (q, k, v, gate, up):  y = D · A_s((P + W) x + b)        D: [d_out, d_out]
    input side  (o, down):            y = (P + W) · A_s(D x) + b        D: [d_in,  d_in]

with ``W = 0`` and ``D = I`` at initialisation, so training starts exactly at the
pretrained function. Putting D on the input side of the "contracting" projections
follows the reference code and the paper's channel-wise appendix. When
``A_s`` is the identity (the final linear phase) both forms fold exactly into one matrix:

    output side:  P_hat = D (P + W),   b_hat = D b
    input side:   P_hat = (P + W) D,   b_hat = b

W and D are each optional. The annealed activation sits *between* the two factors, so a
projection with W but no D stays linear (as in the reference implementation).

Two exact rewrites make training steps cheaper (same function, same gradients):

* Linear phase (``A_s`` the identity): the forward applies the folded ``P_hat`` above,
  formed once per call, instead of the two factors. For ``n`` tokens the output side costs
  ``d_out^2 d_in + n d_in d_out`` multiply-adds instead of ``n d_out^2 + n d_in d_out``, so it
  is used when ``n > d_in`` (input side: ``n > d_out``). Autograd through the product gives
  ``dL/dD = G (P + W)^T`` and ``dL/d(P + W) = D^T G`` with ``G = dL/dP_hat`` (output side;
  input side ``(P + W)^T G`` and ``G D^T``), the same gradients as the two-factor form.
* Under bf16 autocast D is applied as ``D a = a + (D - I) a`` with the sum in fp32: ``D``
  stays near ``I``, and bf16 rounding (2^-8 relative) of D, or of the sum, would swallow
  its small updates; ``D - I`` is formed in fp32 and rounds to bf16 with relative, not
  absolute, error. Likewise ``P_hat = (P + W) + (D - I)(P + W)`` with the sum in fp32.

The norm re-parameterisation trains ``weight = base * (1 + scale) + bias`` (scale, bias
zero-initialised) and folds it into the norm's own weight at merge time.

Wrappers own their base module (``base_layer``, as in PEFT) and ``merge()`` returns a
plain module; :func:`overrep.model.wrap.merge_recovery` swaps them back into the model.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..errors import MergeRefused  # noqa: F401  (re-exported: part of the public API)
from .schedule import AnnealedActivation

Side = Literal["output", "input"]


def _merge_dtype(t: torch.Tensor) -> torch.dtype:
    # float64 on the CPU is cheap enough and makes the fold exact to ~1e-16 relative;
    # on accelerators float64 matmuls can be very slow, float32 is ample there.
    return torch.float64 if t.device.type == "cpu" else torch.float32


def init_d(d: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(d, dtype=like.dtype, device=like.device)


def fold_pays(x: torch.Tensor, weight: torch.Tensor, side: Side) -> bool:
    """Whether forming ``P_hat`` costs fewer multiply-adds than applying D per token."""
    tokens = x.numel() // x.shape[-1]
    return tokens > (weight.shape[1] if side == "output" else weight.shape[0])


def _low_precision(x: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type)


def _fp32(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on fp32 copies of ``tensors`` with autocast off. A rectangular D (width
    pruning) is applied this way under bf16 autocast: its low-precision form measured
    ~50x slower on a CPU's backward pass than fp32, and fp32 needs no rounding guard."""
    with torch.autocast(tensors[0].device.type, enabled=False):
        return fn(*(t.float() for t in tensors))


def _apply_d(z: torch.Tensor, D: torch.Tensor, low: bool, rectangular: bool = False) -> torch.Tensor:
    """``z D^T`` (D on the last axis of ``z``); under autocast ``z + z (D - I)^T`` with the
    sum in fp32, or for a ``rectangular`` D the product in fp32."""
    if not low:
        return F.linear(z, D)
    if rectangular:
        return _fp32(F.linear, z, D)
    eye = torch.eye(D.shape[0], dtype=D.dtype, device=D.device)
    return z.float() + F.linear(z, D - eye).float()  # the sum in fp32: bf16 would round it back to z


def selection_matrix(keep: torch.Tensor, side: Side, shape, like: torch.Tensor) -> torch.Tensor:
    """The partial identity ``D0`` of shape ``shape``: ``[len(keep), d_ref]`` with
    ``D0[j, keep[j]] = 1`` on the output side, its transpose ``[d_ref, len(keep)]`` on the input side."""
    d0 = torch.zeros(shape, dtype=like.dtype, device=like.device)
    cols = torch.arange(len(keep), device=like.device)
    if side == "output":
        d0[cols, keep.to(like.device)] = 1
    else:
        d0[keep.to(like.device), cols] = 1
    return d0


def folded_weight(w: torch.Tensor, D: torch.Tensor, side: Side, low: bool, rectangular: bool = False) -> torch.Tensor:
    """``P_hat`` = ``D w`` (output side) or ``w D`` (input side), differentiable."""
    if not low:
        return D @ w if side == "output" else w @ D
    if rectangular:
        return _fp32(torch.matmul, D, w) if side == "output" else _fp32(torch.matmul, w, D)
    eye = torch.eye(D.shape[0], dtype=D.dtype, device=D.device)
    corr = (D - eye) @ w if side == "output" else w @ (D - eye)
    return w + corr.float()  # the small correction in bf16, the sum in fp32


def overcomplete_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         W: torch.Tensor | None, D: torch.Tensor | None, side: Side,
                         act: AnnealedActivation | None, fast: bool = True,
                         rectangular: bool = False) -> torch.Tensor:
    """One overcomplete projection: ``x`` ``[..., d_in]`` -> ``[..., d_out]`` (``d_out`` or
    ``d_in`` narrowed when D is ``rectangular``, width pruning).

    ``fast=False`` always applies the two factors (the reference form, for tests)."""
    w = weight if W is None else weight + W
    if D is None:
        return F.linear(x, w, bias)
    low = _low_precision(x)
    linear = act is None or act.is_identity
    if fast and linear and fold_pays(x, w, side):
        p_hat = folded_weight(w, D, side, low, rectangular)
        b_hat = bias if bias is None or side == "input" else _apply_d(bias, D, low, rectangular)
        return F.linear(x, p_hat, b_hat)
    a = (lambda z: z) if act is None else act
    if side == "output":
        return _apply_d(a(F.linear(x, w, bias)), D, low, rectangular)
    return F.linear(a(_apply_d(x, D, low, rectangular)), w, bias)


@torch.no_grad()
def fold(weight: torch.Tensor, bias: torch.Tensor | None, W: torch.Tensor | None,
         D: torch.Tensor | None, side: Side) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(P_hat, b_hat)`` of eq:reparam, computed in float64 (CPU) / float32, cast back."""
    dt = _merge_dtype(weight)
    w = weight.to(dt) if W is None else weight.to(dt) + W.to(dt)
    b = None if bias is None else bias.to(dt)
    if D is not None:
        d = D.to(dt)
        if side == "output":
            w = d @ w
            b = None if b is None else d @ b
        else:
            w = w @ d
    return w.to(weight.dtype), None if b is None else b.to(bias.dtype)


class OvercompleteLinear(nn.Module):
    """``nn.Linear`` re-parameterised as ``D · A_s((P + W) x)`` (or its input-side mirror).

    ``keep`` (width pruning, paper appendix "OverRep in Channel-wise Pruning"): the channels
    of D's side that survive. D is then rectangular, ``[len(keep), d_out]`` on the output
    side or ``[d_in, len(keep)]`` on the input side, initialised as the partial identity
    that selects them, so training starts exactly at the width-pruned projection, and the
    fold yields the narrow ``nn.Linear``. P and W keep the pretrained shape.
    """

    def __init__(self, base_layer: nn.Linear, *, use_w: bool, use_d: bool, side: Side = "output",
                 train_base: bool = False, activation: AnnealedActivation | None = None,
                 keep: torch.Tensor | None = None):
        super().__init__()
        self.fast = True  # exact rewrites on (see the module docstring); False: reference form
        if side not in ("output", "input"):
            raise ValueError(f"side must be 'output' or 'input', got {side!r}")
        if keep is not None and not use_d:
            raise ValueError("a width-pruned projection (keep) needs its D")
        self.base_layer = base_layer
        self.side: Side = side
        self.activation = activation if use_d else None
        p = base_layer.weight
        for param in base_layer.parameters():
            param.requires_grad_(train_base)
        self.W = nn.Parameter(torch.zeros_like(p)) if use_w else None
        d = p.shape[0] if side == "output" else p.shape[1]
        if keep is None:
            self.keep = None
            self.D = nn.Parameter(init_d(d, p)) if use_d else None
        else:
            keep = torch.as_tensor(keep, dtype=torch.long, device=p.device)
            self.register_buffer("keep", keep, persistent=False)  # a function of the plan, not state
            shape = (len(keep), d) if side == "output" else (d, len(keep))
            self.D = nn.Parameter(selection_matrix(keep, side, shape, p))

    @property
    def in_features(self) -> int:
        return self.D.shape[1] if self.keep is not None and self.side == "input" else self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.D.shape[0] if self.keep is not None and self.side == "output" else self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        # Some model code reads ``proj.weight.dtype``; the base weight answers that.
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return overcomplete_forward(x, self.base_layer.weight, self.base_layer.bias,
                                    self.W, self.D, self.side, self.activation, self.fast, self.keep is not None)

    def merge(self) -> nn.Linear:
        """The folded plain ``nn.Linear`` (same dtype and device as the base layer)."""
        if self.activation is not None:
            self.activation.require_identity("an overcomplete projection")
        base = self.base_layer
        w, b = fold(base.weight, base.bias, self.W, self.D, self.side)
        out = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            out.weight.copy_(w)
            if b is not None:
                out.bias.copy_(b)
        return out

    def extra_repr(self) -> str:
        return f"side={self.side}, W={self.W is not None}, D={self.D is not None}"


class ReparamNorm(nn.Module):
    """A norm whose weight trains as ``base * (1 + scale) + bias`` (any norm with a ``weight``)."""

    def __init__(self, base_layer: nn.Module, *, train_base: bool = False):
        super().__init__()
        self.base_layer = base_layer
        base_layer.weight.requires_grad_(train_base)
        self.scale = nn.Parameter(torch.zeros_like(base_layer.weight))
        self.bias = nn.Parameter(torch.zeros_like(base_layer.weight))

    @property
    def weight(self) -> torch.Tensor:
        # Some blocks read ``norm.weight.dtype`` before calling their norm (Nemotron-H casts
        # its input to it); the base weight answers. The forward uses the effective weight.
        return self.base_layer.weight

    def effective_weight(self) -> torch.Tensor:
        return self.base_layer.weight * (1 + self.scale) + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.base_layer, {"weight": self.effective_weight()}, (x,))

    @torch.no_grad()
    def merge(self) -> nn.Module:
        base = self.base_layer
        dt = _merge_dtype(base.weight)
        w = base.weight.to(dt) * (1 + self.scale.to(dt)) + self.bias.to(dt)
        base.weight.copy_(w.to(base.weight.dtype))
        return base
