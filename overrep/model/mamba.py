"""Mamba-2 mixers in hybrid decoders (Nemotron-H and the like): what OverRep may touch.

A Mamba-2 mixer computes, per token ``x`` (``[hidden]``)::

    z, xBC, dt = split(in_proj(x))                     # one nn.Linear, then a split
    xBC        = act(causal_conv1d(xBC))               # depthwise conv over time + SiLU
    y          = SSM(xBC, dt; A, D) * ...              # selective scan (nonlinear in dt, B, C)
    out        = out_proj(gated_rmsnorm(y, silu(z)))   # gating nonlinearity, one nn.Linear

Decision (the paper's Nemotron-H recipe keeps the mixer frozen, and so does every
built-in preset): the mixer's own pretrained weights (``in_proj``, ``conv1d``, ``A_log``,
``D``, ``dt_bias``, the gated norm, ``out_proj``) never train. A preset may opt in to W
and/or D on ``in_proj`` under the projection key ``in``; ``out_proj`` gets neither.

Why the fold of ``in`` is exact. The wrapper replaces the ``nn.Linear`` ``in_proj`` by a
module that, in the linear phase, computes one affine map of the block's normed hidden
state: ``D (P + W) x`` (D on the output side, ``[d_proj, d_proj]``) or ``(P + W) D x``
(D on the input side, ``[hidden, hidden]``, the default: it is the small one). Both D's
sit strictly *outside* the convolution and the gating: the output-side D acts on the
concatenated ``[z | xBC | dt]`` *before* the split, so it may mix the three streams, but
only linearly and only before ``causal_conv1d``, the SiLU of the gate and the softplus of
``dt`` see them. Merging returns an ``nn.Linear`` with weight ``D (P + W)`` (or
``(P + W) D``) that computes the same map, so everything downstream receives the same
tensor (up to the rounding of one matrix product) whatever the conv, the scan or the
cache then do with it. A D placed *between* the split and the conv (or on ``xBC`` after
it) would not fold: the conv's SiLU and the gate's SiLU are nonlinear, and the scan is
nonlinear in ``dt``, ``B`` and ``C``.

Why not ``out_proj``. Its fold would be just as exact on paper (``out_proj`` is the last
linear map), but the fused Mamba-2 training kernel (``mamba_ssm``'s
``mamba_split_conv1d_scan_combined``, used by transformers in training mode whenever the
package is installed) reads ``out_proj.weight`` directly instead of calling the module,
so a wrapper there would be silently bypassed on GPUs: W and D would get no gradient and
the merged model would differ from the trained one. ``in_proj`` is called as a module on
every path (kernel or PyTorch), so its wrapper always takes part.
"""

from __future__ import annotations

from torch import nn

#: projection keys of a Mamba-2 mixer that a preset may name (see the module docstring)
MAMBA_PROJ = ("in",)


def find_mamba2(child: nn.Module) -> dict[str, tuple[nn.Module, str]] | None:
    """``{"in": (mixer, "in_proj")}`` if ``child`` is a Mamba-2 mixer, else None.

    Recognised by structure: a linear ``in_proj`` and ``out_proj`` around a depthwise
    ``conv1d`` (the selective-scan parameters ``A_log``, ``dt_bias``, ``D`` live beside them).
    """
    linear = all(isinstance(getattr(child, n, None), nn.Linear) for n in ("in_proj", "out_proj"))
    if not linear or not isinstance(getattr(child, "conv1d", None), nn.Conv1d):
        return None
    return {"in": (child, "in_proj")}
