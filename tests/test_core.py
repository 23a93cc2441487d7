"""The core library on tiny random models of every supported architecture."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from overrep.model.accounting import blocks_for_ratio, meta_model, recovery_account
from overrep.model.arch import decoder_layers
from overrep.errors import OverRepError
from overrep.core.experts import OvercompleteExperts
from overrep.app.config import RunConfig
from overrep.app.export import PROVENANCE_FILE, export_model
from overrep.model.presets import BUILTIN_PRESETS, Preset, get_preset
from overrep.core.projection import MergeRefused, OvercompleteLinear, ReparamNorm
from overrep.model.hooks import capture_layer_context, module_context, teacher_features
from overrep.model.wrap import apply_preset, count_parameters, has_wrappers, merge_recovery
from overrep.core.schedule import AlphaSchedule, AnnealedActivation
from overrep.model.surgery import parse_layers, plan_pruning, prune, remove_layers, resolve_blocks

from tiny import ARCHS, tiny_ids, tiny_model

REMOVE = [2, 3]  # of 6 blocks: module = stitched block 1 + block 4


def perturb(modules, scale=0.05, seed=1):
    """Give every W, D, scale and bias a random non-identity value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in modules:
            for name, p in m.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf in ("W", "D", "scale", "bias") or leaf.startswith(("W_", "D_")):
                    p.add_(torch.randn(p.shape, generator=g) * scale)


def pruned(arch, preset="hybrid", remove=REMOVE, **plan_kw):
    model = tiny_model(arch)
    plan = plan_pruning(len(decoder_layers(model)), remove, **plan_kw)
    prune(model, plan)
    return model, plan


@pytest.mark.parametrize("arch", ARCHS)
def test_init_is_exactly_the_pruned_model(arch):
    model, plan = pruned(arch)
    ids = tiny_ids()
    ref = model(ids).logits
    apply_preset(model, plan, get_preset("hybrid"))
    assert torch.equal(model(ids).logits, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_merge_matches_overcomplete_and_removes_wrappers(arch, tmp_path):
    model, plan = pruned(arch)
    preset = Preset.from_dict({**get_preset("hybrid").to_dict(),
                               "blocks": [{"train_base": True, "w": ["q", "k", "v", "o"], "d": ["gate", "up", "down"],
                                           "norm_reparam": True},
                                          {"w": ["q", "k", "v", "o", "gate", "up", "down"],
                                           "d": ["q", "k", "v", "o", "gate", "up", "down"], "norm_reparam": True}]})
    ids = tiny_ids()
    untrained = model(ids).logits
    modules = apply_preset(model, plan, preset, AlphaSchedule(100))
    perturb(modules)
    modules[0].activation.set_step(100)  # end of schedule: alpha = 0
    before = model(ids).logits
    assert merge_recovery(model) > 0
    assert not has_wrappers(model)
    after = model(ids).logits
    assert (after - before).abs().max().item() < 1e-5
    # The check above is only meaningful if W, D and the norms really changed the function.
    assert (after - untrained).abs().max().item() > 1e-3

    # Save -> from_pretrained gives the same logits and the pruned architecture's size.
    out = export_model(model, None, tmp_path / "compact", {"method": "overrep"})
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.allclose(reloaded(ids).logits, after, atol=1e-6, rtol=0)
    assert count_parameters(reloaded) == count_parameters(model)
    fresh = meta_model(reloaded.config)
    assert count_parameters(fresh) == count_parameters(model)
    assert (out / PROVENANCE_FILE).is_file() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_merge_refuses_while_activation_is_not_identity(arch):
    model, plan = pruned(arch)
    modules = apply_preset(model, plan, get_preset("hybrid"), AlphaSchedule(100))
    modules[0].activation.set_step(50)
    assert modules[0].activation.alpha > 0
    with pytest.raises(MergeRefused):
        merge_recovery(model)
    assert has_wrappers(model)  # nothing was half-merged


def test_activation_changes_the_function_until_the_linear_phase():
    model, plan = pruned("llama")
    modules = apply_preset(model, plan, get_preset("hybrid"), AlphaSchedule(100))
    ids = tiny_ids()
    perturb(modules)
    act = modules[0].activation
    act.set_step(0)
    linear = model(ids).logits
    act.set_step(10)
    assert act.alpha > 0.9
    assert not torch.allclose(model(ids).logits, linear)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
@pytest.mark.parametrize("remove", [[1], [2, 4], [0, 1], [4]])
def test_remove_layers_roundtrip(arch, remove, tmp_path):
    model = tiny_model(arch)
    ids = tiny_ids()
    remove_layers(model, remove)
    assert model.config.num_hidden_layers == 6 - len(remove)
    assert [l.self_attn.layer_idx for l in decoder_layers(model)] == list(range(6 - len(remove)))
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.allclose(reloaded(ids).logits, ref, atol=1e-6, rtol=0)
    # Generation with a KV cache must work on the renumbered model.
    assert reloaded.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_per_layer_config_fields_are_sliced():
    model = tiny_model("gemma3")
    types = list(model.config.layer_types)
    remove_layers(model, [0, 3])
    assert model.config.layer_types == [types[i] for i in (1, 2, 4, 5)]
    moe = tiny_model("qwen3_moe")  # dense: 0 (mlp_only) and every even index; sparse: 1, 3, 5
    sparse_before = [type(l.mlp).__name__ for i, l in enumerate(decoder_layers(moe)) if i not in (1, 2)]
    remove_layers(moe, [1, 2])
    rebuilt = meta_model(moe.config)
    assert [type(l.mlp).__name__ for l in decoder_layers(rebuilt)] == sparse_before


@pytest.mark.parametrize("arch", ARCHS)
def test_recovery_module_reproduces_the_model_on_its_blocks(arch):
    """The module, fed the hidden state entering its first block, computes what the model
    computes there (same masks, rotary embeddings, sliding windows)."""
    model, plan = pruned(arch, remove=[1, 2], blocks=3)
    (module,) = apply_preset(model, plan, get_preset("hybrid"))
    ids = tiny_ids(seq=20)
    hs = model(ids, output_hidden_states=True).hidden_states
    first, last = module.compact_indices[0], module.compact_indices[-1]
    ctx = module_context(capture_layer_context(model, ids.shape[1]), module)
    out = module(hs[first], ctx)
    assert torch.allclose(out, hs[last + 1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_teacher_features_are_the_dense_hidden_states(arch):
    dense = tiny_model(arch)
    ids = tiny_ids()
    hs = dense(ids, output_hidden_states=True).hidden_states  # hs[-1] is after the final norm
    plan = plan_pruning(6, [1, 3, 4])  # modules [0, 2] and [2, 5] share block 2: one group
    assert [g.module_layers for g in plan.groups] == [[0, 2, 5]]
    feats = teacher_features(dense, ids, plan.groups)
    assert len(feats) == 1
    for g, f in zip(plan.groups, feats):
        assert torch.equal(f["inputs"], hs[g.input_layer])
        assert torch.equal(f["targets"], hs[-1] if g.final_norm else hs[g.target_layer + 1])


def test_plan_layouts():
    p = plan_pruning(30, parse_layers("21-28"))
    (g,) = p.groups
    assert g.module_layers == [20, 29] and g.stitch == {20: 28} and g.final_norm and g.target_layer == 29
    p = plan_pruning(30, parse_layers("21-28"), block1_init="retained")
    assert p.groups[0].stitch == {}
    p = plan_pruning(12, [2, 3, 8])  # separate runs -> separate modules
    assert [g.module_layers for g in p.groups] == [[1, 4], [7, 9]]
    p = plan_pruning(12, [2, 4])  # modules [1, 3] and [3, 5] share block 3 -> one module
    assert [g.module_layers for g in p.groups] == [[1, 3, 5]] and p.groups[0].stitch == {1: 2, 3: 4}
    p = plan_pruning(8, [0, 1])  # nothing before the run
    assert p.groups[0].module_layers == [2, 3] and p.groups[0].stitch == {}
    assert parse_layers("3,5,7-9") == [3, 5, 7, 8, 9]
    # one replacement block (Streamline): block 17 learns the whole run, up to block 28's output
    (g,) = plan_pruning(30, parse_layers("18-28"), blocks=1).groups
    assert g.module_layers == [17] and g.target_layer == 28 and not g.final_norm
    (g,) = plan_pruning(30, parse_layers("18-29"), blocks=1).groups
    assert g.module_layers == [17] and g.target_layer == 29 and g.final_norm


def test_final_block_off_keeps_modules_before_the_final_block():
    """recovery.final_block: false (the run default): a module stops before the model's final block."""
    paper = plan_pruning(30, parse_layers("18-28"), final_block=False)  # the paper's mask
    assert paper.to_dict() == plan_pruning(30, parse_layers("18-28"), blocks=1).to_dict()
    (g,) = paper.groups
    assert g.module_layers == [17] and g.target_layer == 28 and not g.final_norm and g.stitch == {17: 28}
    (g,) = plan_pruning(30, parse_layers("18-27"), final_block=False, blocks=3).groups  # only 28 before it
    assert g.module_layers == [17, 28] and g.target_layer == 28 and not g.final_norm
    inside = plan_pruning(12, [2, 3, 8], final_block=False)  # modules inside the network: unchanged
    assert inside.to_dict() == plan_pruning(12, [2, 3, 8]).to_dict()
    (g,) = plan_pruning(30, parse_layers("18-29"), final_block=False).groups  # the run takes the final block
    assert g.module_layers == [17] and g.final_norm


def test_auto_blocks_two_for_one_run_one_for_several():
    """recovery.blocks: auto (the run default) resolves by the mask's runs: 2 for one, 1 for several."""
    one = plan_pruning(30, parse_layers("9-19"), blocks="auto", final_block=False)  # the default cosine mask
    assert one.to_dict() == plan_pruning(30, parse_layers("9-19"), blocks=2, final_block=False).to_dict()
    assert one.groups[0].module_layers == [8, 20]
    bi = parse_layers("3,5-6,12-17,25-26")  # Block Influence's mask on the embedded model
    several = plan_pruning(30, bi, blocks="auto", final_block=False)
    assert several.to_dict() == plan_pruning(30, bi, blocks=1, final_block=False).to_dict()
    assert [g.module_layers for g in several.groups] == [[2], [4], [11], [24]]
    assert resolve_blocks(3, bi) == 3
    for bad in (0, "two", True, 1.5):
        with pytest.raises(OverRepError, match="recovery.blocks"):
            resolve_blocks(bad, bi)
    with pytest.raises(OverRepError, match="recovery.blocks"):
        RunConfig.load(overrides=["recovery.blocks=many"])
    assert RunConfig.load(overrides=["recovery.blocks=1"]).recovery.blocks == 1
    assert RunConfig.load().recovery.blocks == "auto"


@pytest.mark.parametrize("bad,msg", [([], "empty"), ([6], "out of range"), (list(range(6)), "leaves no block"),
                                     ([-1], "out of range")])
def test_plan_rejects_bad_removals(bad, msg):
    with pytest.raises(OverRepError, match=msg):
        plan_pruning(6, bad)


def test_stitched_block_takes_mlp_and_norms_from_the_last_removed_block():
    dense = tiny_model("llama")
    model, plan = pruned("llama", remove=[2, 3])
    b1 = decoder_layers(model)[1]
    assert torch.equal(b1.self_attn.q_proj.weight, decoder_layers(dense)[1].self_attn.q_proj.weight)
    assert torch.equal(b1.mlp.down_proj.weight, decoder_layers(dense)[3].mlp.down_proj.weight)
    assert torch.equal(b1.input_layernorm.weight, decoder_layers(dense)[3].input_layernorm.weight)


def test_hybrid_preset_trainability():
    model, plan = pruned("llama", remove=[3, 4])  # module: block 2 (stitched) + final block 5 + final norm
    (m,) = apply_preset(model, plan, get_preset("hybrid"))
    b1, b2 = m.blocks
    assert isinstance(b1.self_attn.q_proj, OvercompleteLinear) and b1.self_attn.q_proj.D is None
    assert b1.self_attn.q_proj.W.requires_grad and b1.self_attn.q_proj.base_layer.weight.requires_grad
    assert b1.mlp.gate_proj.W is None and b1.mlp.gate_proj.D.shape == (48, 48)
    assert b1.mlp.down_proj.side == "input" and b1.mlp.down_proj.D.shape == (48, 48)
    assert not b2.self_attn.o_proj.base_layer.weight.requires_grad and b2.self_attn.o_proj.D.shape == (32, 32)
    assert not b2.input_layernorm.weight.requires_grad and m.norm.weight.requires_grad
    assert not model.model.embed_tokens.weight.requires_grad
    assert not decoder_layers(model)[0].mlp.up_proj.weight.requires_grad


def test_moe_experts_get_their_own_w_and_d_and_router_stays_frozen():
    model, plan = pruned("qwen3_moe")
    (m,) = apply_preset(model, plan, get_preset("hybrid"))
    ex = m.blocks[0].mlp.experts
    assert isinstance(ex, OvercompleteExperts)
    assert ex.D_gate.shape == (4, 16, 16) and ex.D_down.shape == (4, 16, 16) and ex.W_gate is None
    assert not m.blocks[0].mlp.gate.weight.requires_grad


def assert_merges_exactly(model, modules):
    """With random W, D, norm factors and alpha at its end, the merged model's logits equal
    the overcomplete model's."""
    perturb(modules)
    modules[0].activation.set_step(10)
    ids = tiny_ids()
    before = model(ids).logits
    merge_recovery(model)
    assert (model(ids).logits - before).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", list(BUILTIN_PRESETS))
def test_every_builtin_preset_applies_and_merges(name):
    model, plan = pruned("qwen3")
    modules = apply_preset(model, plan, get_preset(name), AlphaSchedule(10))
    assert_merges_exactly(model, modules)
    assert not has_wrappers(model)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_hybrid_narrow_puts_the_mlp_d_on_the_hidden_side_and_merges(arch):
    model, plan = pruned(arch)
    modules = apply_preset(model, plan, get_preset("hybrid-narrow"), AlphaSchedule(10))
    hidden = model.config.hidden_size
    mlp = modules[0].blocks[1].mlp
    if arch == "llama":
        assert mlp.gate_proj.side == "input" and mlp.gate_proj.D.shape == (hidden, hidden)
        assert mlp.down_proj.side == "output" and mlp.down_proj.D.shape == (hidden, hidden)
    else:
        (ex, *_) = [m for m in modules[0].modules() if isinstance(m, OvercompleteExperts)]
        assert ex.D_gate.shape[-1] == ex.D_down.shape[-1] == hidden and ex.sides["gate"] == "input"
    assert_merges_exactly(model, modules)


def test_preset_from_yaml(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("name: mine\nblocks:\n  - {train_base: true, w: [q, v]}\n  - {d: [down]}\nanneal: false\n")
    p = get_preset(str(f))
    assert p.name == "mine" and p.block(0).w == ("q", "v") and p.block(5).d == ("down",) and not p.anneal
    with pytest.raises(OverRepError, match="unknown projection"):
        get_preset({"blocks": [{"w": ["qkv"]}]})
    with pytest.raises(OverRepError, match="unknown preset"):
        get_preset("nope")


def test_alpha_schedule_breakpoints():
    s = AlphaSchedule(1000, warmup_ratio=0.01, linear_ratio=0.2)
    assert s.alpha(0) == 0.0
    assert s.alpha(5) == pytest.approx(0.5)
    assert s.alpha(10) == pytest.approx(1.0)
    mid = (10 + 800) / 2
    assert s.alpha(mid) == pytest.approx(0.5)
    assert s.alpha(400) == pytest.approx(0.5 * (1 + math.cos(math.pi * 390 / 790)))
    assert s.alpha(799) > 0 and s.alpha(800) == 0.0 and s.alpha(1000) == 0.0


def test_learning_rate_warm_up_lasts_its_steps_however_short_the_run():
    from overrep.core.schedule import lr_factor

    assert lr_factor(0, 1000, 0.01, 0.1) == pytest.approx(0.1)  # 10 steps: 1% of 1000
    assert lr_factor(9, 1000, 0.01, 0.1) == pytest.approx(1.0)
    assert lr_factor(0, 80, 0.01, 0.1) == 1.0  # 1% of 80 rounds to one step: full rate at once
    assert [lr_factor(s, 80, 0.01, 0.1, warmup_steps=20) for s in (0, 9, 19)] == pytest.approx([0.05, 0.5, 1.0])
    assert lr_factor(79, 80, 0.01, 0.1, warmup_steps=20) == pytest.approx(0.1, abs=1e-3)  # the cosine still ends
    assert lr_factor(6, 7, 0.01, 0.1, warmup_steps=20) == pytest.approx(0.35)  # never reaches the peak
    assert lr_factor(50, 1000, 0.1, 0.1, warmup_steps=20) == pytest.approx(0.51)  # the longer of the two


def test_activation_state_roundtrips_through_state_dict():
    act = AnnealedActivation(torch.nn.functional.silu, AlphaSchedule(100))
    act.set_step(37)
    other = AnnealedActivation(torch.nn.functional.silu)
    other.load_state_dict(act.state_dict())
    assert other.step == 37 and other.alpha == act.alpha and other.schedule == act.schedule


def test_norm_reparam_folds_exactly():
    norm = tiny_model("llama").model.norm
    x = torch.randn(3, 32)
    r = ReparamNorm(copy.deepcopy(norm))
    with torch.no_grad():
        r.scale.normal_()
        r.bias.normal_()
    y = r(x)
    assert torch.allclose(r.merge()(x), y, atol=1e-6)


def test_parameter_account_matches_the_paper_for_llama3_3b():
    cfg = LlamaConfig(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
                      num_hidden_layers=28, vocab_size=128256, tie_word_embeddings=True, head_dim=128)
    n = blocks_for_ratio(meta_model(cfg), 0.25)
    assert n == 9  # Table tab:backbone-config: 28 -> 19 blocks at 25%
    acc = recovery_account(cfg, list(range(28 - 1 - n, 27)))
    assert round(acc["trainable_params"] / 1e6, 1) == 650.1  # Table tab:runtime
    cfg8 = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       num_hidden_layers=32, vocab_size=128256)
    assert blocks_for_ratio(meta_model(cfg8), 0.5) == 18  # 32 -> 14 blocks at 50%


@pytest.mark.parametrize("ratio", [0.0, 1.0, 1.5, -0.1])
def test_impossible_ratios(ratio):
    with pytest.raises(OverRepError, match="ratio"):
        blocks_for_ratio(tiny_model("llama"), ratio)


def test_unsupported_architecture_names_what_is_missing():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50))
    from overrep.model.arch import check_supported
    with pytest.raises(OverRepError, match="unsupported architecture GPT2LMHeadModel"):
        check_supported(gpt2)


def test_export_refuses_unmerged_and_existing(tmp_path):
    model, plan = pruned("llama")
    apply_preset(model, plan, get_preset("hybrid"))
    with pytest.raises(OverRepError, match="merge it first"):
        export_model(model, None, tmp_path / "x", {})
    assert not (tmp_path / "x").exists()
    merge_recovery(model)
    export_model(model, None, tmp_path / "x", {})
    with pytest.raises(OverRepError, match="already exists"):
        export_model(model, None, tmp_path / "x", {})
