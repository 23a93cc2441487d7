"""Hybrid Mamba-attention decoders (tiny random Nemotron-H, pattern ``M*-M-*``): discovery,
pruning with the layer-type pattern kept consistent, recovery with Mamba blocks in the
module, an exact merge, the save -> from_pretrained round trip, criteria and the CLI; and
tiny Bamba (Mamba-2 or attention plus an MLP per block, attention blocks listed by index)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, NemotronHConfig

from overrep.app.cli import main
from overrep.app.export import export_model
from overrep.core.projection import OvercompleteLinear
from overrep.core.schedule import AlphaSchedule
from overrep.errors import OverRepError
from overrep.model.accounting import blocks_for_ratio, recovery_account
from overrep.model.arch import block_parts, check_supported, decoder_layers, final_norm
from overrep.model.hooks import capture_layer_context, module_context, teacher_features
from overrep.model.presets import Preset, get_preset
from overrep.model.surgery import can_stitch, plan_pruning, prune, remove_layers
from overrep.model.wrap import apply_preset, has_wrappers, merge_recovery, plan_recovery, recoverable_blocks
from overrep.pruning.criteria import get_criterion

from test_core import perturb
from tiny import HYBRID_PATTERN, corpus, make_tiny_model_dir, tiny_cfg, tiny_ids, tiny_model

ARCH = "nemotron_h"
KIND = {"M": "Mamba2Mixer", "*": "Attention", "-": "MLP"}
ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def stitchable(model):
    """The stitches ``model``'s blocks allow (what plan_recovery gives plan_pruning)."""
    return lambda target, source: can_stitch(decoder_layers(model), target, source)


def pruned(remove, **plan_kw):
    model = tiny_model(ARCH)
    plan = plan_pruning(len(decoder_layers(model)), remove, stitchable=stitchable(model), **plan_kw)
    prune(model, plan)
    return model, plan


def pattern(model) -> str:
    return model.config.hybrid_override_pattern


def reloaded_logits(model, path, ids):
    model.save_pretrained(path)
    again = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return again, again(ids).logits


# --------------------------------------------------------------------------- discovery


def test_discovery_finds_one_part_per_block_from_the_modules():
    model = tiny_model(ARCH)
    check_supported(model)
    assert final_norm(model) is model.model.norm_f
    for i, (layer, kind) in enumerate(zip(decoder_layers(model), HYBRID_PATTERN)):
        parts = block_parts(layer, i)
        part = parts.mlp if kind == "-" else parts.attention
        assert type(part).__name__.endswith(KIND[kind]) and list(parts.norms) == ["norm"]
        assert (parts.attention is None) == (kind == "-") and (parts.mlp is None) == (kind != "-")
        keys = {"M": ["in"], "*": ["q", "k", "v", "o"], "-": ["up", "down"]}[kind]
        assert list(parts.projections) == keys
        assert parts.frozen == ([layer.mixer] if kind == "M" else [])


def test_unknown_hybrid_part_is_one_clear_error():
    cfg = NemotronHConfig(vocab_size=97, hidden_size=32, hybrid_override_pattern="*E", num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(OverRepError, match=r"decoder block 1 .* part 'mixer' \(NemotronHMoE\)") as info:
        check_supported(model)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- pruning


@pytest.mark.parametrize("remove", [[2, 3], [0], [1, 4], [5]])
def test_remove_keeps_the_pattern_and_reloads_identically(remove, tmp_path):
    model = tiny_model(ARCH)
    ids = tiny_ids()
    remove_layers(model, remove)
    kept = [c for i, c in enumerate(HYBRID_PATTERN) if i not in remove]
    assert pattern(model) == "".join(kept) and model.config.num_hidden_layers == len(kept)
    assert [l.layer_idx for l in decoder_layers(model)] == list(range(len(kept)))
    assert [getattr(l.mixer, "layer_idx", j) for j, l in enumerate(decoder_layers(model))] == list(range(len(kept)))
    ref = model(ids).logits
    again, logits = reloaded_logits(model, tmp_path, ids)
    assert json.loads((tmp_path / "config.json").read_text())["layers_block_type"] == model.config.layers_block_type
    assert torch.allclose(logits, ref, atol=1e-6, rtol=0)
    # Generation with the hybrid cache (conv/SSM states and KV) works on the renumbered model.
    out = again.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_pattern_string_fields_are_sliced():
    from overrep.model.surgery import _patch_config

    class Cfg:  # a config that keeps its pattern as a string attribute (older hybrid configs)
        def __init__(self):
            self.num_hidden_layers, self.hybrid_override_pattern = 6, "M*-M-*"
            self.model_type, self.mtp_layers_block_type = "hybrid", ["full_attention"] * 6

    cfg = Cfg()
    _patch_config(cfg, [0, 1, 4, 5])
    assert cfg.hybrid_override_pattern == "M*-*" and cfg.num_hidden_layers == 4
    assert cfg.model_type == "hybrid" and len(cfg.mtp_layers_block_type) == 6


def test_stitched_falls_back_to_retained_on_one_part_blocks():
    """The plan is final when made: block 1 is planned retained, and pruning refuses a plan
    that asks for a stitch the blocks do not allow."""
    dense = tiny_model(ARCH)
    assert not can_stitch(decoder_layers(dense), 1, 3)
    with pytest.raises(OverRepError, match="stitches block 1 from block 3"):
        prune(tiny_model(ARCH), plan_pruning(6, [2, 3]))
    model, plan = pruned([2, 3])
    assert plan.groups[0].stitch == {}
    assert plan_recovery(dense, [2, 3], get_preset("hybrid")).groups[0].stitch == {}
    assert torch.equal(decoder_layers(model)[1].mixer.q_proj.weight, decoder_layers(dense)[1].mixer.q_proj.weight)


@pytest.mark.parametrize("criterion", ["cosine", "block-influence", "last"])
def test_prune_by_ratio_with_a_criterion(criterion, tmp_path):
    model = tiny_model(ARCH)
    n = blocks_for_ratio(model, 0.34)
    assert 1 <= n < 6
    selection = get_criterion(criterion)(model, n, tiny_ids(batch=4, seq=16, seed=1))
    assert len(selection.removed) == n
    plan = plan_pruning(6, selection.removed, stitchable=stitchable(model))
    prune(model, plan)
    assert pattern(model) == "".join(c for i, c in enumerate(HYBRID_PATTERN) if i not in selection.removed)
    ids = tiny_ids()
    assert torch.allclose(reloaded_logits(model, tmp_path, ids)[1], model(ids).logits, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- recovery


def test_hybrid_preset_init_is_exact_and_keeps_mamba_frozen():
    model, plan = pruned([1, 2], blocks=3)  # module: Mamba block 0 (block 1, trainable) + M + MLP
    (m,) = apply_preset(model, plan, get_preset("hybrid"), AlphaSchedule(10))
    assert [type(b.mixer).__name__ for b in m.blocks] == ["NemotronHMamba2Mixer", "NemotronHMamba2Mixer",
                                                          "NemotronHMLP"]
    b1, b2, b3 = m.blocks
    assert not any(p.requires_grad for p in b1.mixer.parameters())  # the paper: Mamba-2 stays frozen
    assert b1.norm.weight.requires_grad  # block 1's own norm trains, as in any block 1
    assert not any(isinstance(x, OvercompleteLinear) for x in b2.mixer.modules())
    assert b3.mixer.up_proj.D.shape == (48, 48) and b3.mixer.down_proj.W is not None
    assert not b3.mixer.up_proj.base_layer.weight.requires_grad
    assert model.config.hybrid_override_pattern == "MM-*"


def test_recovery_module_reproduces_the_model_on_mamba_and_attention_blocks():
    model, plan = pruned([2], blocks=3)  # module: attention 1 + Mamba 3 + MLP 4
    (module,) = apply_preset(model, plan, get_preset("hybrid"))
    ids = tiny_ids(seq=20)
    hs = model(ids, output_hidden_states=True).hidden_states
    first, last = module.compact_indices[0], module.compact_indices[-1]
    ctx = module_context(capture_layer_context(model, ids.shape[1]), module)
    assert torch.allclose(module(hs[first], ctx), hs[last + 1], atol=1e-6, rtol=0)
    dense = tiny_model(ARCH)
    (f,) = teacher_features(dense, ids, plan.groups)
    hd = dense(ids, output_hidden_states=True).hidden_states
    assert torch.equal(f["inputs"], hd[1]) and torch.equal(f["targets"], hd[plan.groups[0].target_layer + 1])


MAMBA_W_D = {"blocks": [{"train_base": True, "w": ["q", "k", "v", "o", "in"], "d": ["up", "down", "in"],
                         "norm_reparam": True},
                        {"w": ALL + ["in"], "d": ALL + ["in"], "norm_reparam": True}]}


@pytest.mark.parametrize("preset", ["hybrid", "uniform", "hybrid-narrow", "mamba-in", "mamba-in-output"])
@pytest.mark.parametrize("remove", [[2, 3], [1, 2]])
def test_merge_is_exact_and_exports_identically(preset, remove, tmp_path):
    if preset.startswith("mamba-in"):
        side = "output" if preset.endswith("output") else "input"
        preset = Preset.from_dict({**MAMBA_W_D, "name": preset, "d_side": {"in": side}})
    model, plan = pruned(remove, blocks=3)
    ids = tiny_ids()
    untrained = model(ids).logits
    modules = apply_preset(model, plan, get_preset(preset), AlphaSchedule(10))
    wrapped_in = [b.mixer.in_proj for m in modules for b in m.blocks if hasattr(b.mixer, "in_proj")]
    if not isinstance(preset, str) and remove == [1, 2]:  # the module holds two Mamba blocks
        assert len(wrapped_in) == 2 and all(isinstance(p, OvercompleteLinear) for p in wrapped_in)
        hidden, d_proj = 32, wrapped_in[0].out_features
        assert wrapped_in[0].D.shape == ((hidden, hidden) if preset.side("in") == "input" else (d_proj, d_proj))
        assert not wrapped_in[0].base_layer.weight.requires_grad and wrapped_in[0].W.requires_grad
    perturb(modules)
    modules[0].activation.set_step(10)  # end of schedule: alpha = 0, the linear phase
    before = model(ids).logits
    assert merge_recovery(model) > 0 and not has_wrappers(model)
    after = model(ids).logits
    assert (after - before).abs().max().item() < 1e-5
    assert (after - untrained).abs().max().item() > 1e-3  # W, D and the norms really changed it
    out = export_model(model, None, tmp_path / "compact", {"method": "overrep"})
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.allclose(again(ids).logits, after, atol=1e-6, rtol=0)
    assert again.config.hybrid_override_pattern == pattern(model)


def test_a_module_counts_only_the_blocks_its_preset_can_train():
    """Pattern M*-M-*: a module around removed blocks 1-2 crosses the frozen Mamba blocks 0
    and 3 and ends once it holds two blocks that learn (MLP 4, attention 5); one around
    block 4 starts at the MLP block 2 before the Mamba block 3."""
    model = tiny_model(ARCH)
    assert recoverable_blocks(model, get_preset("hybrid")) == [False, True, True, False, True, True]
    assert recoverable_blocks(model, get_preset("plain")) == [False, True, True, False, True, True]
    mamba_in = Preset.from_dict({**MAMBA_W_D, "name": "mamba-in"})
    assert all(recoverable_blocks(model, mamba_in))  # a preset naming 'in' trains Mamba blocks too
    plan = plan_recovery(model, [1, 2], get_preset("hybrid"), blocks=2)
    assert plan.groups[0].module_layers == [0, 3, 4, 5] and plan.groups[0].final_norm
    assert plan_pruning(6, [1, 2], blocks=2).groups[0].module_layers == [0, 3]  # counted by position
    assert plan_recovery(model, [1, 2], mamba_in, blocks=2).groups[0].module_layers == [0, 3]
    assert plan_recovery(model, [2, 3], get_preset("hybrid")).groups[0].module_layers == [1, 4]  # both learn
    (g,) = plan_recovery(model, [4], get_preset("hybrid")).groups  # block 1: MLP 2, the nearest that learns
    assert (g.module_layers, g.input_layer, g.target_layer, g.stitch) == ([2, 3, 5], 2, 5, {})
    llama = tiny_model("llama")  # a transformer: every block learns, the plan is positional
    assert plan_recovery(llama, [2, 3], get_preset("hybrid")).to_dict() == plan_pruning(6, [2, 3]).to_dict()
    by_kind = recovery_account(model.config, [1, 2], "hybrid")["trainable_params"]
    prune(model, plan)
    modules = apply_preset(model, plan, get_preset("hybrid"))
    assert by_kind == sum(p.numel() for m in modules for p in m.parameters() if p.requires_grad)
    assert any(isinstance(x, OvercompleteLinear) for b in modules[0].blocks for x in b.modules())


def test_mamba_projection_keys_only_where_presets_name_them():
    with pytest.raises(OverRepError, match="unknown projection.*'in'"):
        get_preset({"blocks": [{"w": ["out"]}]})
    acc = recovery_account(tiny_model(ARCH).config, [2, 3], "hybrid")
    assert acc["num_layers_after"] == 4 and acc["trainable_params"] > 0


# --------------------------------------------------------------------------- the CLI


def test_cli_run_on_a_tiny_nemotron_h_folder(assets, tmp_path):
    folder = make_tiny_model_dir(tmp_path / "tiny-nemotron-h", corpus(60), arch=ARCH)
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "run", model__source=str(folder), prune__remove="2-3", recovery__steps=4,
             recovery__checkpoint_every=4, recovery__eval_every=4, eval__domains=None, eval__latency=False).save(cfg)
    assert main(["run", "--config", str(cfg), "--quiet"]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["removed_layers"] == [2, 3] and metrics["num_layers_after"] == 4
    assert metrics["merge_max_abs_diff"] < 1e-5 and metrics["export_reload_max_abs_diff"] < 1e-5
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["groups"][0]["stitch"] == {}  # one-part blocks: block 1 retained
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model").eval()
    assert model.config.hybrid_override_pattern == "M*-*"
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


def test_streaming_teacher_reads_a_hybrid_folder_block_by_block(tmp_path):
    from overrep.model.streaming import stream_features

    dense = tiny_model(ARCH)
    dense.save_pretrained(tmp_path)
    ids = tiny_ids()
    plan = plan_pruning(6, [2, 3])
    (want,), (got,) = teacher_features(dense, ids, plan.groups), stream_features(tmp_path, ids, plan.groups)
    assert torch.allclose(got["inputs"], want["inputs"], atol=1e-6, rtol=0)
    assert torch.allclose(got["targets"], want["targets"], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- Bamba


@pytest.mark.parametrize("remove,indices,stitch", [([2, 3], [1, 2], {1: 3}), ([0], [0, 3], {}), ([4], [1], {3: 4})])
def test_bamba_prune_stitch_merge_and_reload(remove, indices, stitch, tmp_path):
    """Bamba: every block is a Mamba-2 or attention mixer plus a gated MLP, and the config
    lists the attention blocks by index (``attn_layer_indices``), renumbered on removal."""
    model = tiny_model("bamba")
    check_supported(model)
    plan = plan_pruning(6, remove)
    prune(model, plan)
    assert model.config.attn_layer_indices == indices and plan.groups[0].stitch == stitch
    ids = tiny_ids()
    ref = model(ids).logits
    preset = Preset.from_dict({**MAMBA_W_D, "name": "mamba-in"})
    modules = apply_preset(model, plan, preset, AlphaSchedule(10))
    assert torch.equal(model(ids).logits, ref)
    perturb(modules)
    modules[0].activation.set_step(10)
    before = model(ids).logits
    merge_recovery(model)
    after = model(ids).logits
    assert (after - before).abs().max().item() < 1e-5 and (after - ref).abs().max().item() > 1e-3
    again, logits = reloaded_logits(model, tmp_path, ids)
    assert again.config.attn_layer_indices == indices and torch.allclose(logits, after, atol=1e-6, rtol=0)
    assert again.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)
