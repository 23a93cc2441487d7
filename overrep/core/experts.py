"""OverRep for mixture-of-experts feed-forward blocks whose experts are stored fused.

transformers 5 stores the experts of Qwen3-MoE (and similar models) as two 3-D tensors:
``gate_up_proj`` ``[E, 2I, H]`` (gate rows first, then up rows) and ``down_proj``
``[E, H, I]``. Every expert's gate, up and down projection gets its own W and D (paper,
appendix "Larger and MoE architectures"), with the same maths and sides as
:mod:`overrep.core.projection`; the router is never touched (its routing and sparsity are
preserved at deployment) and stays frozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .projection import Side, fold, overcomplete_forward
from .schedule import AnnealedActivation


def is_fused_experts(module: nn.Module) -> bool:
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.Tensor) and gu.dim() == 3 and isinstance(dn, torch.Tensor) and dn.dim() == 3


class OvercompleteExperts(nn.Module):
    """Fused experts with per-expert W and D on gate, up and down.

    ``spec`` maps ``"gate" | "up" | "down"`` to ``(use_w, use_d, side)``.
    Forward signature is the base module's: ``(hidden [N, H], top_k_index [N, k],
    top_k_weights [N, k]) -> [N, H]``.
    """

    def __init__(self, base_layer: nn.Module, spec: dict[str, tuple[bool, bool, Side]], *,
                 train_base: bool = False, activation: AnnealedActivation | None = None):
        super().__init__()
        self.base_layer = base_layer
        self.num_experts, two_i, self.hidden = base_layer.gate_up_proj.shape
        self.inter = two_i // 2
        base_layer.gate_up_proj.requires_grad_(train_base)
        base_layer.down_proj.requires_grad_(train_base)
        self.sides: dict[str, Side] = {}
        self.activation = activation
        like = base_layer.gate_up_proj
        E, I, H = self.num_experts, self.inter, self.hidden
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        for name, (use_w, use_d, side) in spec.items():
            d_out, d_in = shapes[name]
            self.sides[name] = side
            w = nn.Parameter(torch.zeros(E, d_out, d_in, dtype=like.dtype, device=like.device)) if use_w else None
            d = d_out if side == "output" else d_in
            eye = torch.eye(d, dtype=like.dtype, device=like.device).expand(E, d, d).clone()
            self.register_parameter(f"W_{name}", w)
            self.register_parameter(f"D_{name}", nn.Parameter(eye) if use_d else None)
        for name in shapes:
            self.sides.setdefault(name, "output" if name != "down" else "input")
            if not hasattr(self, f"W_{name}"):
                self.register_parameter(f"W_{name}", None)
                self.register_parameter(f"D_{name}", None)

    def _base_weights(self, e: int) -> dict[str, torch.Tensor]:
        gu = self.base_layer.gate_up_proj[e]
        return {"gate": gu[: self.inter], "up": gu[self.inter:], "down": self.base_layer.down_proj[e]}

    def _proj(self, name: str, e: int, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        W, D = getattr(self, f"W_{name}"), getattr(self, f"D_{name}")
        return overcomplete_forward(x, base, None, None if W is None else W[e], None if D is None else D[e],
                                    self.sides[name], self.activation)

    def _gate_up(self, e: int, x: torch.Tensor, base: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sides["gate"] == "input" and self.D_gate is not None or self.sides["up"] == "input" and self.D_up is not None:
            return self._proj("gate", e, x, base["gate"]), self._proj("up", e, x, base["up"])
        # One fused matmul, as the base module does, so that at W = 0, D = I the result is
        # bit-identical to the pretrained experts; D then acts on each half.
        w = self.base_layer.gate_up_proj[e]
        if self.W_gate is not None or self.W_up is not None:
            zg = torch.zeros_like(base["gate"])
            w = w + torch.cat([zg if self.W_gate is None else self.W_gate[e], zg if self.W_up is None else self.W_up[e]])
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        act = self.activation if self.activation is not None else (lambda z: z)
        if self.D_gate is not None:
            gate = F.linear(act(gate), self.D_gate[e])
        if self.D_up is not None:
            up = F.linear(act(up), self.D_up[e])
        if self.D_gate is not None or self.D_up is not None:
            # Hand back strided halves of one tensor, like the base module: elementwise
            # kernels take other code paths on contiguous inputs and differ in the last ulp.
            gate, up = torch.cat([gate, up], dim=-1).chunk(2, dim=-1)
        return gate, up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        act_fn = self.base_layer.act_fn
        with torch.no_grad():
            hit = torch.unique(top_k_index).tolist()
        for e in hit:
            # Same gather order as the base module (k-major), for bit-identical results.
            k_pos, token_idx = torch.where(top_k_index.T == e)
            x = hidden_states[token_idx]
            base = self._base_weights(e)
            gate, up = self._gate_up(e, x, base)
            h = act_fn(gate) * up
            y = self._proj("down", e, h, base["down"]) * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    @torch.no_grad()
    def merge(self) -> nn.Module:
        uses_d = any(getattr(self, f"D_{n}") is not None for n in ("gate", "up", "down"))
        if uses_d and self.activation is not None:
            self.activation.require_identity("the overcomplete experts")
        base = self.base_layer
        for e in range(self.num_experts):
            w = self._base_weights(e)
            merged = {}
            for name in ("gate", "up", "down"):
                W, D = getattr(self, f"W_{name}"), getattr(self, f"D_{name}")
                merged[name], _ = fold(w[name], None, None if W is None else W[e], None if D is None else D[e],
                                       self.sides[name])
            base.gate_up_proj[e].copy_(torch.cat([merged["gate"], merged["up"]], dim=0))
            base.down_proj[e].copy_(merged["down"])
        return base
