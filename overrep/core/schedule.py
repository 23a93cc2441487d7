"""The annealed activation and its schedule (paper, equations ``eq:va`` and ``eq:alpha-schedule``).

During recovery every overcomplete projection applies

    A_s(z) = alpha_s * sigma(z) + (1 - alpha_s) * z

between its two factors. ``alpha_s`` rises linearly from 0 to 1 over the first
``warmup_ratio * S`` steps, decays by a half cosine to 0 at ``(1 - linear_ratio) * S``,
and stays exactly 0 for the final ``linear_ratio * S`` steps, so that at the end
``A_S`` is the identity and the factors can be multiplied together (the merge).

The last step is always in the linear phase, however short the run: when
``linear_ratio * S < 1`` the decay ends at step ``S - 1``. Without that, a short run
(``S = 2``) would train only with the non-linearity and the merge, which needs
``alpha = 0``, would fold a function that training never saw.

One :class:`AnnealedActivation` object is shared by all projections of a recovery
module; the training loop calls :meth:`AnnealedActivation.set_step` once per step.
Its state (the step and the schedule) goes into checkpoints through ``state_dict``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..errors import MergeRefused


@dataclass(frozen=True)
class AlphaSchedule:
    """alpha_s for ``total_steps`` steps (paper defaults: rho_w = 0.01, rho_l = 0.2)."""

    total_steps: int
    warmup_ratio: float = 0.01
    linear_ratio: float = 0.2

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not (0.0 <= self.warmup_ratio and 0.0 < self.linear_ratio
                and self.warmup_ratio + self.linear_ratio <= 1.0):
            raise ValueError("warmup_ratio must be >= 0, linear_ratio > 0, and they must sum to at most 1")

    @property
    def warmup_steps(self) -> float:
        return self.warmup_ratio * self.total_steps

    @property
    def decay_end(self) -> float:
        """First step of the linear phase (at most ``S - 1``: the last step is always linear)."""
        return min((1.0 - self.linear_ratio) * self.total_steps, self.total_steps - 1.0)

    def alpha(self, step: int) -> float:
        """alpha at training step ``step`` (0-based; the paper's s)."""
        s, s_w, s_d = float(step), self.warmup_steps, self.decay_end
        if s >= s_d:
            return 0.0
        if s < s_w:
            return s / s_w
        return 0.5 * (1.0 + math.cos(math.pi * (s - s_w) / (s_d - s_w)))


class AnnealedActivation(torch.nn.Module):
    """``A_s(z) = alpha * sigma(z) + (1 - alpha) * z`` with alpha driven by the step.

    Shapes: any ``[..., d]`` in, the same out. With ``alpha == 0`` it returns ``z``
    itself (not a copy), so the linear phase costs nothing and is bit-exact.
    """

    def __init__(self, sigma: Callable[[torch.Tensor], torch.Tensor], schedule: AlphaSchedule | None = None,
                 enabled: bool = True):
        super().__init__()
        self.sigma = sigma
        self.schedule = schedule
        self.enabled = enabled  # False: a linear preset (alpha stays 0 whatever the schedule)
        self.step = 0
        self.alpha = 0.0
        self.set_step(0)

    def set_schedule(self, schedule: AlphaSchedule) -> None:
        self.schedule = schedule
        self.set_step(self.step)

    def set_step(self, step: int) -> None:
        self.step = int(step)
        self.alpha = 0.0 if self.schedule is None or not self.enabled else self.schedule.alpha(self.step)

    def set_alpha(self, alpha: float) -> None:
        """Pin alpha directly (tests, ablations without a schedule)."""
        self.alpha = float(alpha)

    @property
    def is_identity(self) -> bool:
        return self.alpha == 0.0

    def require_identity(self, what: str) -> None:
        """The one merge guard: folding ``what`` is exact only while ``A_s`` is the identity."""
        if not self.is_identity:
            raise MergeRefused(f"cannot merge {what}: the annealed activation is at alpha={self.alpha:.4g}, not 0; "
                               "the schedule must reach its linear phase first")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.alpha == 0.0:
            return z
        return self.alpha * self.sigma(z) + (1.0 - self.alpha) * z

    # The state is plain Python numbers, so it lives in extra_state rather than buffers.
    def get_extra_state(self) -> dict:
        return {"step": self.step, "alpha": self.alpha, "enabled": self.enabled,
                "schedule": None if self.schedule is None else asdict(self.schedule)}

    def set_extra_state(self, state: dict) -> None:
        self.schedule = None if state["schedule"] is None else AlphaSchedule(**state["schedule"])
        self.enabled = bool(state.get("enabled", True))
        self.step = int(state["step"])
        self.alpha = float(state["alpha"])


def lr_factor(step: int, total: int, warmup_ratio: float, min_ratio: float, warmup_steps: int = 0) -> float:
    """The learning rate's factor at ``step``: a linear warm-up over ``max(warmup_ratio * total,
    warmup_steps)`` steps (at least one), then a cosine to ``min_ratio`` at ``total``."""
    warm = max(1, int(round(warmup_ratio * total)), warmup_steps)
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
