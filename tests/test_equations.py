"""The paper's equations on small explicit matrices, computed by hand (plain Python floats).

``eq:overcomplete-projection-with-va``: y = D · A_s((P + W) x + b) on the output side and
y = (P + W) · A_s(D x) + b on the input side, with A_s(z) = α σ(z) + (1 − α) z.
``eq:reparam``: P_hat = D (P + W), b_hat = D b (output side); P_hat = (P + W) D, b_hat = b
(input side). The references below never call the code under test, so a D on the wrong
side, a transposed factor or a bias folded the wrong way fails here even where forward
and fold agree with each other.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overrep.core.projection import MergeRefused, OvercompleteLinear
from overrep.core.schedule import AnnealedActivation

P = [[1.0, -2.0, 0.5],
     [0.0, 3.0, -1.0]]                      # [d_out=2, d_in=3]
W = [[0.5, 0.0, -1.0],
     [1.0, -0.5, 2.0]]
B = [0.25, -4.0]
D_OUT = [[2.0, -1.0],
         [0.5, 1.5]]                        # [d_out, d_out]
D_IN = [[1.0, 0.0, 2.0],
        [-1.0, 0.5, 0.0],
        [0.0, 1.0, -1.5]]                   # [d_in, d_in]
X = [[1.0, 2.0, -1.0],
     [-2.0, 0.5, 3.0],
     [0.0, -1.0, 1.0],
     [4.0, 1.0, 0.5]]                       # four tokens (more tokens than d_in: the fast fold path runs too)


def matvec(m, v):
    return [sum(a * b for a, b in zip(row, v)) for row in m]


def matmul(a, b):
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]


def add(a, b):
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)] if isinstance(a[0], list) else \
        [x + y for x, y in zip(a, b)]


def annealed(z, alpha):
    return [alpha * max(v, 0.0) + (1 - alpha) * v for v in z]  # σ = ReLU


def by_hand(side: str, x, alpha: float):
    pw = add(P, W)
    if side == "output":
        return matvec(D_OUT, annealed(add(matvec(pw, x), B), alpha))
    return add(matvec(pw, annealed(matvec(D_IN, x), alpha)), B)


def wrapper(side: str, alpha: float, fast: bool) -> OvercompleteLinear:
    base = nn.Linear(3, 2, dtype=torch.float64)
    with torch.no_grad():
        base.weight.copy_(torch.tensor(P, dtype=torch.float64))
        base.bias.copy_(torch.tensor(B, dtype=torch.float64))
    act = AnnealedActivation(torch.relu)
    act.set_alpha(alpha)
    m = OvercompleteLinear(base, use_w=True, use_d=True, side=side, activation=act)
    with torch.no_grad():
        m.W.copy_(torch.tensor(W, dtype=torch.float64))
        m.D.copy_(torch.tensor(D_OUT if side == "output" else D_IN, dtype=torch.float64))
    m.fast = fast
    return m


def test_the_hand_computation_is_not_trivial():
    """The activation bites (some pre-activations are negative) and D is not the identity on any side."""
    pre_out = [v for x in X for v in add(matvec(add(P, W), x), B)]
    pre_in = [v for x in X for v in matvec(D_IN, x)]
    assert min(pre_out) < 0 < max(pre_out) and min(pre_in) < 0 < max(pre_in)
    assert by_hand("output", X[0], 0.5) != by_hand("output", X[0], 0.0)
    assert by_hand("input", X[0], 0.5) != by_hand("input", X[0], 0.0)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("alpha", [1.0, 0.25, 0.0])
@pytest.mark.parametrize("side", ["output", "input"])
def test_forward_is_eq_overcomplete_projection_with_va(side, alpha, fast):
    m = wrapper(side, alpha, fast)
    y = m(torch.tensor(X, dtype=torch.float64))
    expected = torch.tensor([by_hand(side, x, alpha) for x in X], dtype=torch.float64)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("side", ["output", "input"])
def test_merge_is_eq_reparam(side):
    pw = add(P, W)
    if side == "output":
        p_hat, b_hat = matmul(D_OUT, pw), matvec(D_OUT, B)
    else:
        p_hat, b_hat = matmul(pw, D_IN), B
    merged = wrapper(side, 0.0, True).merge()
    assert type(merged) is nn.Linear
    torch.testing.assert_close(merged.weight.detach(), torch.tensor(p_hat, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(merged.bias.detach(), torch.tensor(b_hat, dtype=torch.float64), rtol=0, atol=1e-12)
    # and the folded layer computes the linear-phase function by hand
    expected = torch.tensor([by_hand(side, x, 0.0) for x in X], dtype=torch.float64)
    torch.testing.assert_close(merged(torch.tensor(X, dtype=torch.float64)).detach(), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("side", ["output", "input"])
def test_merge_refuses_while_the_activation_is_annealed(side):
    with pytest.raises(MergeRefused):
        wrapper(side, 0.25, True).merge()
