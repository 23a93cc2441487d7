"""The next-token loss through a frozen head without the logits (overrep.core.linear_ce), and the
whole-model loss built on it (overrep.model.lm_loss): each against the plain computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, GraniteConfig

from overrep.core import linear_ce
from overrep.core.linear_ce import head_cross_entropy, linear_cross_entropy
from overrep.model.lm_loss import CausalLMLoss

from tiny import ARCHS, COMMON, tiny_config, tiny_ids, tiny_model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradient_are_the_plain_ones(monkeypatch, precision, softcap, bias):
    monkeypatch.setattr(linear_ce, "CHUNK_LOGITS", 64 * 1000)  # 64 tokens a chunk: several chunks, a ragged last
    g = torch.Generator().manual_seed(0)
    n, d, v = 300, 32, 1000
    w, b = torch.randn(v, d, generator=g) * 0.3, torch.randn(v, generator=g) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = -100  # not scored
    x = torch.randn(n, d, generator=g)
    on = precision == "bf16"

    h = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
        z = F.linear(h, w, b).float()
        z = torch.tanh(z / softcap) * softcap if softcap else z
        plain = F.cross_entropy(z, y)
    (3 * plain).backward()
    h2 = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
        fused = linear_cross_entropy(h2, w, y, bias=b, softcap=softcap)
    (3 * fused).backward()
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5)
    if on:  # the logits' gradient is rounded to bf16 for the product, in each its own order of operations
        assert ((h2.grad - h.grad).norm() / h.grad.norm()).item() < 1e-2
    else:
        assert torch.allclose(h2.grad, h.grad, rtol=1e-4, atol=1e-7)
    assert h2.grad.abs().max() > 0 and not h2.grad[::7].any()  # an unscored token has no gradient


def test_no_gradient_asked_none_computed_and_a_trained_head_refused():
    w, y = torch.randn(50, 8), torch.randint(0, 50, (20,))
    with torch.no_grad():
        assert linear_cross_entropy(torch.randn(20, 8), w, y).item() > 0
    with pytest.raises(ValueError, match="frozen"):
        linear_cross_entropy(torch.randn(20, 8), w.requires_grad_(), y)


def test_a_head_that_is_not_a_plain_frozen_linear_is_computed_plainly():
    head = nn.Linear(8, 50, bias=False)  # trainable: its gradient is wanted
    h, y = torch.randn(20, 8), torch.randint(0, 50, (20,))
    loss = head_cross_entropy(h, head, y)
    loss.backward()
    assert head.weight.grad is not None
    assert loss.item() == pytest.approx(F.cross_entropy(head(h), y).item(), rel=1e-6)


def _train_setup(model):
    model.requires_grad_(False)
    block = model.model.layers[1]
    block.requires_grad_(True)
    return [p for p in block.parameters()]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_whole_models_loss_is_its_own_fused(arch):
    """Fused on every architecture, Gemma's soft-capping included; loss and gradients the model's own."""
    if arch == "gemma3":
        cfg = tiny_config(arch)
        cfg.final_logit_softcapping = 3.0  # small, so that the capping matters
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        model = tiny_model(arch)
    params = _train_setup(model)
    ids = tiny_ids(batch=3, seq=24)
    own = model(input_ids=ids, labels=ids, use_cache=False).loss
    want = torch.autograd.grad(own, params)
    loss = CausalLMLoss(model)
    got = loss(ids)
    assert loss.parts is not None  # the check on the first row agreed: fused
    assert got.item() == pytest.approx(own.item(), rel=1e-5)
    for a, b in zip(torch.autograd.grad(got, params), want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_model_that_scales_its_logits_computes_its_own_loss():
    """Granite divides its logits by ``logits_scaling`` after the head: the fused loss would not be
    the model's, so the first batch's check hands the loss back to the model."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GraniteConfig(**COMMON, logits_scaling=4.0), dtype=torch.float32)
    _train_setup(model)
    ids = tiny_ids(batch=2, seq=16)
    loss = CausalLMLoss(model)
    got = loss(ids)
    assert loss.parts is None
    assert got.item() == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-6)


def test_a_trained_head_is_left_to_the_model():
    model = tiny_model("llama")
    model.requires_grad_(True)  # the head (tied to the embeddings) trains: nothing to fuse
    assert CausalLMLoss(model).parts is None
    model.requires_grad_(False)
    assert CausalLMLoss(model).parts is not None


def test_a_peft_lora_model_is_fused_through_its_adapters():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.1)  # adapters that change the output
    model.eval()
    ids = tiny_ids(batch=2, seq=16)
    params = [p for p in model.parameters() if p.requires_grad]
    own = model(input_ids=ids, labels=ids, use_cache=False).loss
    want = torch.autograd.grad(own, params)
    loss = CausalLMLoss(model)
    got = loss(ids)
    assert loss.parts is not None
    assert got.item() == pytest.approx(own.item(), rel=1e-5)
    for a, b in zip(torch.autograd.grad(got, params), want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_adalora_keeps_the_loss_peft_computes_with_its_penalty():
    """AdaLoRA's objective asks for the model's own loss: PEFT adds its orthogonality penalty to
    it, which a head's cross-entropy alone would drop."""
    from peft import AdaLoraConfig, get_peft_model

    from overrep.recovery.methods.adapters import AdaLoraLanguageModeling

    model = get_peft_model(tiny_model("llama"), AdaLoraConfig(init_r=4, target_r=2, total_step=10, lora_dropout=0.0,
                                                               target_modules=["q_proj", "v_proj"],
                                                               task_type="CAUSAL_LM"))
    model.train()
    ids = tiny_ids(batch=2, seq=16)
    got = AdaLoraLanguageModeling(model, ids, None).rows_loss(ids)
    own = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert got.item() == pytest.approx(own.item(), rel=1e-6)
    # without the flag the first batch's check sees the penalty and hands the loss back to the model too
    unflagged = CausalLMLoss(model)
    assert unflagged(ids).item() == pytest.approx(own.item(), rel=1e-6) and unflagged.parts is None
