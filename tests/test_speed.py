"""Faster overcomplete steps: the exact rewrites give the reference form's outputs and
gradients, bf16 training steps run and merge, and the precision setting is validated."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overrep.model.arch import decoder_layers
from overrep.app.config import RunConfig
from overrep.errors import OverRepError
from overrep.model.presets import get_preset
from overrep.core.projection import OvercompleteLinear, fold_pays
from overrep.recovery import apply_preset, capture_layer_context, merge_recovery, module_context
from overrep.core.schedule import AlphaSchedule
from overrep.model.surgery import plan_pruning, prune

from tiny import tiny_ids, tiny_model


def _linear(d_in, d_out, side, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(d_in, d_out, bias=True, dtype=dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(d_out, d_in, generator=g, dtype=dtype) / d_in ** 0.5)
        base.bias.copy_(torch.randn(d_out, generator=g, dtype=dtype))
    m = OvercompleteLinear(base, use_w=True, use_d=True, side=side, train_base=True)
    with torch.no_grad():  # away from W = 0, D = I so every gradient term matters
        m.W.add_(torch.randn(m.W.shape, generator=g, dtype=dtype) * 0.1)
        m.D.add_(torch.randn(m.D.shape, generator=g, dtype=dtype) * 0.1)
    return m


def _grads(m, x, fast):
    m.fast = fast
    for p in m.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    y = m(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("side", ["output", "input"])
def test_folded_linear_phase_equals_the_two_factor_form(side):
    m = _linear(12, 20, side)
    x = torch.randn(3, 16, 12, dtype=torch.float64)  # 48 tokens: folding pays on both sides
    assert fold_pays(x, m.base_layer.weight, side)
    y_slow, gx_slow, g_slow = _grads(m, x, fast=False)
    y_fast, gx_fast, g_fast = _grads(m, x, fast=True)
    assert torch.allclose(y_fast, y_slow, atol=1e-12, rtol=0)
    assert torch.allclose(gx_fast, gx_slow, atol=1e-12, rtol=0)
    assert set(g_fast) == {"W", "D", "base_layer.weight", "base_layer.bias"}
    for name in g_slow:
        assert torch.allclose(g_fast[name], g_slow[name], atol=1e-11, rtol=0), name


def test_fold_only_when_it_saves_multiply_adds():
    w = torch.zeros(20, 12)
    assert not fold_pays(torch.zeros(2, 6, 12), w, "output")  # 12 tokens, d_in 12
    assert fold_pays(torch.zeros(2, 7, 12), w, "output")
    assert not fold_pays(torch.zeros(2, 10, 12), w, "input")  # 20 tokens, d_out 20
    assert fold_pays(torch.zeros(3, 7, 12), w, "input")


def _module(dtype=torch.float32, seed=0):
    model = tiny_model("llama").to(dtype)
    plan = plan_pruning(len(decoder_layers(model)), [2, 3])
    prune(model, plan)
    (module,) = apply_preset(model, plan, get_preset("hybrid"), AlphaSchedule(100))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith((".W", ".D")):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    ids = tiny_ids(batch=2, seq=40)  # 80 tokens > every projection dimension (32, 48)
    h = model(ids, output_hidden_states=True).hidden_states[module.compact_indices[0]].detach()
    ctx = module_context(capture_layer_context(model, ids.shape[1]), module)
    return model, module, h, ctx


def _module_grads(module, h, ctx, fast):
    for m in module.modules():
        if isinstance(m, OvercompleteLinear):
            m.fast = fast
    module.zero_grad(set_to_none=True)
    out = module(h, ctx)
    (out.double() ** 2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_recovery_module_fast_path_matches_reference_in_the_linear_phase(dtype, tol):
    _, module, h, ctx = _module(dtype)
    module.activation.set_step(100)  # linear phase: alpha = 0
    out_slow, g_slow = _module_grads(module, h, ctx, fast=False)
    out_fast, g_fast = _module_grads(module, h, ctx, fast=True)
    assert torch.allclose(out_fast, out_slow, atol=tol * out_slow.abs().max().item(), rtol=0)
    assert any(n.endswith(".D") for n in g_slow) and set(g_fast) == set(g_slow)
    for name in g_slow:
        scale = g_slow[name].abs().max().item()
        assert torch.allclose(g_fast[name], g_slow[name], atol=tol * scale, rtol=0), name


def test_fast_path_is_unused_while_alpha_is_positive():
    _, module, h, ctx = _module(torch.float64)
    module.activation.set_step(50)
    assert module.activation.alpha > 0
    out_slow, g_slow = _module_grads(module, h, ctx, fast=False)
    out_fast, g_fast = _module_grads(module, h, ctx, fast=True)
    assert torch.equal(out_fast, out_slow)
    assert all(torch.equal(g_fast[n], g_slow[n]) for n in g_slow)


@pytest.mark.parametrize("step", [50, 100])  # annealing phase, linear phase
def test_bf16_step_runs_and_merges_within_tolerance(step):
    model, module, h, ctx = _module(torch.float32)
    module.activation.set_step(step)
    params = [p for p in module.parameters() if p.requires_grad]
    masters = {id(p): p.detach().clone() for p in params}
    opt = torch.optim.AdamW(params, lr=1e-3)
    module.precision = "bf16"
    out = module(h, ctx)
    assert out.dtype == torch.float32
    torch.nn.functional.mse_loss(out, h * 1.01).backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params)
    opt.step()
    assert all(s.dtype == torch.float32 for st in opt.state.values() for s in st.values() if s.dim())
    assert any(not torch.equal(p, masters[id(p)]) for p in params)

    module.activation.set_step(100)
    with torch.no_grad():
        low = module(h, ctx)
        module.precision = "fp32"
        before = module(h, ctx)
        merge_recovery(model)
        after = module(h, ctx)
    scale = before.abs().max().item()
    assert (after - before).abs().max().item() < 1e-5 * scale  # the fold is exact
    rel = (low - before).abs().max().item() / scale
    assert 0 < rel < 3e-2  # bf16 forward: close to the fp32 function, but not identical


def test_bf16_keeps_small_updates_of_d():
    """Under bf16 autocast D is applied as I + (D - I): a 1e-3 change of D's diagonal
    (below bf16's spacing at 1.0) still changes the output."""
    base = nn.Linear(64, 64, bias=False)
    m = OvercompleteLinear(base, use_w=False, use_d=True, side="output")
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        y0 = m(x).float()
        m.D.mul_(1 + 1e-3)
        y1 = m(x).float()
    assert (y1 - y0).abs().max().item() > 0


@pytest.mark.parametrize("bad", ["fp16", "float32", "BF16", ""])
def test_precision_is_validated(bad):
    with pytest.raises(OverRepError, match="recovery.precision must be one of auto, fp32, bf16"):
        RunConfig.load(overrides={"recovery": {"precision": bad}})


def test_precision_default_and_values():
    assert RunConfig().recovery.precision == "auto"
    assert RunConfig.load(overrides=["recovery.precision=fp32"]).recovery.precision == "fp32"


@pytest.mark.parametrize("avx512_bf16,amx,want", [(True, False, "bf16"), (False, True, "bf16"), (False, False, "fp32")])
def test_auto_precision_is_bf16_only_where_the_cpu_has_bf16_instructions(monkeypatch, avx512_bf16, amx, want):
    """recovery.precision: auto resolves to bf16 on a CPU with AVX512-BF16 or AMX, else fp32 (an
    AVX2 CPU emulates bf16: an OverRep step measured 84 s against about 3 s in fp32)."""
    from overrep.core.precision import autocast, resolve_precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_precision("auto", "cpu") == want
    assert resolve_precision("fp32", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"
    with autocast("auto", "cpu"):
        y = torch.ones(2, 2) @ torch.ones(2, 2)
    assert y.dtype == (torch.bfloat16 if want == "bf16" else torch.float32)
    with pytest.raises(OverRepError, match="must be one of"):
        resolve_precision("fp16", "cpu")
