"""Closed forms (ReplaceMe, Prune&Comp, LinearPatch) on planted problems and tiny models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from overrep.app.pipeline import Pipeline
from overrep.errors import OverRepError
from overrep.model.arch import decoder_layers
from overrep.model.surgery import plan_pruning, prune
from overrep.recovery.closed_form import (FitOptions, NormalEquations, _block_output, down_projection, fit_and_fold,
                                          balance_sinks, fold_blocker, fold_map, token_weights)
from overrep.recovery.compensation import fold_scale, hadamard, linear_patch, prunecomp, tune_patches
from overrep.recovery.methods import build_recovery, get_method
from overrep.recovery.methods.closed_form import (PLAIN_AUTO_WARM_MAX_STEPS, STREAMLINE_AUTO_WARM_MAX_STEPS,
                                                  fit_options)

from tiny import tiny_cfg, tiny_config, tiny_ids, tiny_model

FAST = dict(eval__perplexity=False, eval__latency=False)


def test_least_squares_solves_a_planted_map_and_ignores_zero_weight_outliers():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(500, 12, generator=g, dtype=torch.float64)
    t0 = torch.randn(12, 12, generator=g, dtype=torch.float64)
    r = m @ t0
    m[:5] *= 1e4  # "massive activations" whose targets disagree with the map
    r[:5] = torch.randn(5, 12, generator=g, dtype=torch.float64) * 1e6
    w = torch.ones(500, dtype=torch.float64)
    w[:5] = 0
    eq = NormalEquations(12, 12)
    for i in range(0, 500, 64):  # streamed in batches: the same sums as all at once
        eq.add(m[i:i + 64], r[i:i + 64], w[i:i + 64])
    assert torch.allclose(eq.solve(0.0), t0, atol=1e-8)
    plain = NormalEquations(12, 12)
    plain.add(m, r, torch.ones(500, dtype=torch.float64))
    assert (plain.solve(0.0) - t0).abs().max() > 1.0  # the unweighted fit is spent on the outliers


def test_token_weights_leave_out_sinks_and_normalise_rows():
    x = torch.ones(2, 6, 4)
    x[:, 0] *= 100.0
    w = token_weights(x, "sinks+rms")
    assert (w[:, 0] == 0).all() and torch.allclose(w[:, 1:], torch.ones(2, 5, dtype=torch.float64))
    assert (token_weights(x, "skip-first")[:, 0] == 0).all()
    assert (token_weights(x, "all") == 1).all()
    for bad in ("all+rms", "balanced+skip-first"):
        with pytest.raises(OverRepError):
            token_weights(x, bad)


def test_balanced_weights_give_the_sinks_a_fixed_share_of_the_squared_residual():
    x = torch.ones(2, 6, 4)
    x[:, 0] *= 100.0  # the first token of each row: a sink
    x[1, 3] *= 50.0  # a sink inside a row
    w = token_weights(x, "balanced")  # the sinks left out (what a fit that only selects tokens keeps)
    assert w[:, 0].eq(0).all() and w[1, 3] == 0 and w.sum() == 12 - 3
    residual = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
    residual[x > 10] *= 1e3
    bw = balance_sinks(w, residual, balance=3.0)
    sinks = bw != 1
    size = residual.double().pow(2).sum(-1)
    assert sinks.sum() == 3 and torch.equal(bw[~sinks], w[~sinks])
    assert torch.isclose((bw * size)[sinks].sum(), 3.0 * size[~sinks].sum())


def test_folding_the_map_into_down_proj_equals_applying_it():
    model = tiny_model("llama")
    ids = tiny_ids(2, 16)
    down = down_projection(decoder_layers(model)[2], 2)
    y, m = _block_output(model, 2, ids, down)
    t = torch.eye(32) + 0.1 * torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    fold_map(down, t)
    after, _ = _block_output(model, 2, ids)
    assert torch.allclose(after, y - m + m @ t, atol=1e-5)


def test_fit_reduces_the_gap_error_one_map_per_run():
    dense = tiny_model("llama")
    plan = plan_pruning(6, [2, 4], blocks=1)
    ids = tiny_ids(8, 16)

    def gap_error(model):
        return sum((_block_output(model, plan.compact_index(a - 1), ids)[0]
                    - _block_output(dense, b, ids)[0]).pow(2).sum().item() for a, b in [(2, 2), (4, 4)])

    pruned = prune(copy.deepcopy(dense), plan)
    before = gap_error(pruned)
    info = fit_and_fold(pruned, dense, plan, ids, FitOptions(rows=8, tokens="all", ridge=0.0))
    assert [r["block"] for r in info["runs"]] == [1, 3]
    assert gap_error(pruned) < 0.75 * before  # (T = I, no map, is one of the candidates)


def test_fit_with_bf16_forwards_finds_the_same_map_and_folds_exactly():
    """bf16 autocast only for the calibration forwards: the map is the fp32 one to bf16's
    rounding, and the fold check (run in the model's fp32) still passes."""
    dense = tiny_model("llama")
    plan = plan_pruning(6, [2, 3], blocks=1)
    ids = tiny_ids(8, 16)
    maps = {}
    for precision in ("fp32", "bf16"):
        pruned = prune(copy.deepcopy(dense), plan)
        info = fit_and_fold(pruned, dense, plan, ids, FitOptions(rows=8, precision=precision))
        assert info["precision"] == precision
        maps[precision] = down_projection(decoder_layers(pruned)[1], 1).weight.detach().clone()
    rel = (maps["bf16"] - maps["fp32"]).norm() / maps["fp32"].norm()
    assert 0 < rel < 0.05, rel


@pytest.mark.parametrize("tied", [True, False])
def test_prunecomp_scale_fold_is_exact(tied):
    cfg = tiny_config("llama")
    cfg.tie_word_embeddings, cfg.rms_norm_eps = tied, 1e-12  # eps is the fold's only inexact part
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = tiny_ids(2, 16)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    scaled = copy.deepcopy(model)
    fold_scale(scaled, 6, 2.5)  # the whole stream: logits must not change (tied head included)
    with torch.no_grad():
        out = scaled(ids, output_hidden_states=True)
    assert torch.allclose(out.logits, ref.logits, atol=1e-4)
    assert torch.allclose(out.hidden_states[3], 2.5 * ref.hidden_states[3], rtol=1e-5, atol=1e-6)
    cut = copy.deepcopy(model)
    fold_scale(cut, 3, 2.5)  # the stream entering block 3 is scaled, nothing before it changes direction
    assert torch.allclose(_block_output(cut, 3, ids, before=True)[0],
                          2.5 * _block_output(model, 3, ids, before=True)[0], rtol=1e-5, atol=1e-6)


def test_prunecomp_matches_the_gap_magnitude_and_linear_patch_hooks_come_off():
    dense = tiny_model("llama")
    plan = plan_pruning(6, [2, 3], blocks=1)
    ids = tiny_ids(4, 16)
    pruned = prune(copy.deepcopy(dense), plan)
    info = prunecomp(pruned, dense, plan, ids)
    before = _block_output(pruned, 1, ids)[0]
    assert before.abs().mean().item() == pytest.approx(_block_output(dense, 3, ids)[0].abs().mean().item(), rel=1e-4)
    assert len(info["scales"]) == 1
    with torch.no_grad():
        ref = pruned(ids).logits
        handles = linear_patch(pruned, dense, plan, ids)
        patched = pruned(ids).logits
        for h in handles:
            h.remove()
        assert not torch.allclose(patched, ref) and torch.equal(pruned(ids).logits, ref)


@pytest.mark.parametrize("arch, removed", [("gemma3", [2, 3]), ("qwen3_moe", [2]), ("bamba", [2, 3]),
                                           ("nemotron_h", [2]), ("llama", [0, 1]), ("llama", [4, 5])])
def test_linear_patch_applies_wherever_there_is_a_residual_stream(arch, removed):
    """The patch multiplies the stream at the gap, so it needs no foldable block before it: the
    architectures and masks ReplaceMe refuses (Gemma's post-norm, experts, a block without an MLP,
    a gap at block 0) and a gap at the end (the final norm's input) all take it."""
    dense = tiny_model(arch)
    plan = plan_pruning(6, removed, blocks=1, block1_init="retained")
    ids = tiny_ids(4, 16)
    pruned = prune(copy.deepcopy(dense), plan)
    with torch.no_grad():
        ref = pruned(ids).logits
        hooks = linear_patch(pruned, dense, plan, ids)
        patched = pruned(ids).logits
    assert len(hooks) == 1 and torch.isfinite(patched).all() and not torch.allclose(patched, ref)


def test_linear_patch_distillation_trains_only_the_patch_and_lowers_the_kl():
    dense = tiny_model("llama")
    plan = plan_pruning(6, [2, 3], blocks=1)
    ids = tiny_ids(16, 16)
    pruned = prune(copy.deepcopy(dense), plan)
    weights = {k: v.clone() for k, v in pruned.state_dict().items()}
    hooks = linear_patch(pruned, dense, plan, ids[:4], trainable=True)
    start = hooks[0].matrix.detach().clone()
    info = tune_patches(pruned, hooks, dense, torch.cat([ids] * 4), k=8, lr=1e-2, batch=4)
    assert info["steps"] == 16 and info["last_loss"] < info["first_loss"]
    assert not torch.equal(hooks[0].matrix.detach(), start)
    assert all(torch.equal(v, weights[k]) for k, v in pruned.state_dict().items())  # the model itself unchanged
    assert all(p.requires_grad for p in pruned.parameters())  # and left as it was found
    with pytest.raises(OverRepError, match="trainable patches"):
        tune_patches(pruned, linear_patch(pruned, dense, plan, ids[:4]), dense, ids, k=8)


@pytest.mark.parametrize("n", [12, 72, 576, 896])
def test_hadamard_is_orthonormal_with_equal_magnitudes(n):
    h = hadamard(n)
    assert torch.allclose(h @ h.T, torch.eye(n), atol=1e-5)
    assert torch.allclose(h.abs(), torch.full_like(h, n ** -0.5))


@pytest.mark.parametrize("method", ["replaceme", "replaceme-cos"])
def test_replaceme_runs_end_to_end_without_training_and_reloads(assets, tmp_path, method):
    out = tmp_path / method
    m = Pipeline(tiny_cfg(assets, out, recovery__method=method, recovery__closed_rows=8, recovery__closed_cos_steps=5,
                          eval__latency=False), progress=False).run()
    assert m["train_steps"] == 0 and m["trainable_params"] == 0
    assert m["closed_form"]["runs"][0]["block"] == 2 and m["recovered_ppl"] != m["pruned_ppl"]
    assert m["export_reload_max_abs_diff"] < 1e-5
    reloaded = AutoModelForCausalLM.from_pretrained(out / "model")
    assert reloaded.config.num_hidden_layers == 4
    assert json.loads((out / "model" / "overrep.json").read_text())["method"] == method


@pytest.mark.parametrize("method", ["linearpatch", "linearpatch-kd"])
def test_linear_patch_is_scored_with_its_extra_module_and_never_exported(assets, tmp_path, method):
    out = tmp_path / method
    p = Pipeline(tiny_cfg(assets, out, recovery__method=method, recovery__closed_rows=8, recovery__patch_kd_topk=8,
                          eval__latency=False), progress=False)
    m = p.run()
    assert m["exportable"] is False and m["model_dir"] is None and not (out / "model").exists()
    assert m["train_steps"] == 0 and m["trainable_params"] == 0 and m["extra_params"] == 32 * 32
    assert m["recovered_ppl"] != m["pruned_ppl"] and m["closed_form"]["patches"] == 1
    test = m["recovered_perplexity"]["test"]
    assert test["low"] <= test["value"] <= test["high"] and "validation" in m["recovered_perplexity"]
    assert ("kd" in m["closed_form"]) == (method == "linearpatch-kd")
    if method == "linearpatch-kd":  # one pass over the training rows, 8 a step
        assert m["closed_form"]["kd"]["steps"] == -(-p.train_ids.shape[0] // 8)
    assert all(not g["stitch"] for g in json.loads((out / "plan.json").read_text())["groups"])  # the block as it is
    assert "**not exported**" in (out / "report.md").read_text()
    with pytest.raises(OverRepError, match="never exported"):
        p.export()


def test_prunecomp_alone_is_a_method_that_trains_nothing_and_reloads(assets, tmp_path):
    out = tmp_path / "pc-alone"
    m = Pipeline(tiny_cfg(assets, out, recovery__method="prunecomp", recovery__closed_rows=8, eval__latency=False),
                 progress=False).run()
    assert m["train_steps"] == 0 and m["trainable_params"] == 0 and m["closed_form"]["seconds"] > 0
    assert m["closed_form"]["scales"][0]["scale"] > 0 and m["recovered_ppl"] != m["pruned_ppl"]
    assert AutoModelForCausalLM.from_pretrained(out / "model").config.num_hidden_layers == 4


def test_prunecomp_option_applies_before_a_method_and_is_recorded(assets, tmp_path):
    m = Pipeline(tiny_cfg(assets, tmp_path / "pc", recovery__method="replaceme", recovery__compensate="prunecomp",
                          recovery__closed_rows=8, **FAST), progress=False).run()
    prov = json.loads((tmp_path / "pc" / "model" / "overrep.json").read_text())
    assert m["train_steps"] == 0 and prov["recovery"]["prunecomp"]["scales"][0]["scale"] > 0


def warm_pipeline(assets, out, method):
    """A pruned pipeline whose method starts from ReplaceMe's map, and the down_proj weight of
    block 2 (the block before the removed run) that the map's fold should give it."""
    p = Pipeline(tiny_cfg(assets, out, recovery__method=method, recovery__warm_start="replaceme",
                          recovery__closed_rows=8, **FAST), progress=False)
    p.load(create_output=False)
    p.prune()
    fitted = copy.deepcopy(p.pruned)
    fit_and_fold(fitted, p.dense, p.plan, p.train_ids, fit_options(p.rcfg))  # the run's options and precision
    return p, down_projection(decoder_layers(fitted)[2], 2).weight


@pytest.mark.parametrize("method", ["overrep", "streamline"])
def test_warm_start_starts_from_the_fitted_weights(assets, tmp_path, method):
    p, want = warm_pipeline(assets, tmp_path / "w", method)
    run = build_recovery(p.method_inputs(), get_method(method))
    block = run.modules[0].blocks[0]
    wrapped = block.mlp.down_proj
    got = getattr(wrapped, "base_layer", wrapped).weight
    assert torch.allclose(got, want, atol=1e-6)
    assert run.prepared["warm_start"]["runs"][0]["block"] == 2
    assert run.describe()["warm_start"]["kind"] == "lstsq"
    assert p.rcfg.warmup_steps == 20  # a warm start warms its learning rate up over 20 steps by default


@pytest.mark.parametrize("method", ["lora-iso", "overrep-kd"])
def test_a_method_trained_end_to_end_starts_from_the_fitted_compact_model(assets, tmp_path, method):
    """The fair baseline of a warm start: LoRA (or any method that trains) on ReplaceMe's model."""
    p, want = warm_pipeline(assets, tmp_path / "w", method)
    assert p.metrics["warm_start"] == {"setting": "replaceme", "used": "replaceme"}
    before = down_projection(decoder_layers(p.pruned)[2], 2).weight.detach().clone()
    run = build_recovery(p.method_inputs(), get_method(method))
    assert run.prepared["warm_start"]["runs"][0]["block"] == 2
    got = [m.weight for n, m in run.model.named_modules() if n.endswith("layers.2.mlp.down_proj.base_layer")
           or (n.endswith("layers.2.mlp.down_proj") and not hasattr(m, "base_layer"))]
    assert len(got) == 1 and torch.allclose(got[0], want, atol=1e-6) and not torch.allclose(got[0], before)


def test_a_warm_lora_run_exports_the_merged_fitted_model(assets, tmp_path):
    out = tmp_path / "lora-warm"
    m = Pipeline(tiny_cfg(assets, out, recovery__method="lora-iso", recovery__warm_start="replaceme",
                          recovery__closed_rows=8, recovery__steps=3, eval__latency=False), progress=False).run()
    assert m["train_steps"] == 3 and m["warm_start"]["used"] == "replaceme"
    assert m["export_reload_max_abs_diff"] < 1e-4
    prov = json.loads((out / "model" / "overrep.json").read_text())
    assert prov["recovery"]["warm_start"]["kind"] == "lstsq"


@pytest.mark.parametrize("over, steps", [(dict(recovery__warm_start="none"), 0), ({}, 20),  # the default: auto, warm here
                                         (dict(recovery__warm_start="none", recovery__warmup_steps=5), 5),
                                         (dict(recovery__warm_start="replaceme", recovery__warmup_steps=0), 0)])
def test_warm_up_steps_default_to_zero_for_a_cold_start_and_can_be_set(assets, tmp_path, over, steps):
    p = Pipeline(tiny_cfg(assets, tmp_path / "w", **FAST, **over), progress=False)
    p.load(create_output=False)
    assert p.rcfg.warmup_steps == steps


@pytest.mark.parametrize("over, words", [
    (dict(recovery__method="replaceme", recovery__warm_start="replaceme"), "trains nothing"),
    (dict(recovery__compensate="prunecomp"), "unscaled"),
    (dict(recovery__closed_tokens="sinks+first"), "closed_tokens"),
    (dict(recovery__compensate="yes"), "compensate"),
    (dict(recovery__warm_start="replaceme", recovery__warmup_steps=-1), "warmup_steps"),
])
def test_bad_closed_form_settings_are_one_clear_error(assets, tmp_path, over, words):
    with pytest.raises(OverRepError, match=words):
        tiny_cfg(assets, tmp_path / "x", **over)


def test_replaceme_refuses_a_run_that_starts_at_block_zero():
    dense = tiny_model("llama")
    plan = plan_pruning(6, [0, 1], blocks=1)
    with pytest.raises(OverRepError, match="block 0"):
        fit_and_fold(prune(copy.deepcopy(dense), plan), dense, plan, tiny_ids(2, 16), FitOptions(rows=2))


@pytest.mark.parametrize("arch, removed, words", [
    ("llama", [2, 3], None), ("bamba", [2, 3], None),  # a gated MLP after Mamba or attention: foldable
    ("qwen3_moe", [3], None), ("nemotron_h", [3], None),  # the block before is a dense MLP
    ("llama", [0, 1], "block 0"), ("qwen3_moe", [2], "experts"), ("nemotron_h", [2], "no feed-forward"),
    ("gemma3", [2, 3], "not added to its residual"),  # the post-feed-forward norm
])
def test_fold_blocker_says_where_replacemes_map_cannot_fold(arch, removed, words):
    why = fold_blocker(tiny_model(arch), removed, tiny_ids(2, 16))
    assert why is None if words is None else words in why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocker_agrees_with_the_fold_check(dtype):
    """Where the blocker sees nothing, the map folds exactly (to the rounding of the weights'
    dtype: bf16 weights are what `model.dtype: auto` loads on a GPU); where it objects, so does
    the fit."""
    for arch, removed in (("llama", [2, 3]), ("gemma3", [2, 3])):
        dense = tiny_model(arch).to(dtype)
        plan = plan_pruning(6, removed, blocks=1)
        ids = tiny_ids(4, 16)
        blocked = fold_blocker(dense, removed, ids[:2]) is not None
        try:
            fit_and_fold(prune(copy.deepcopy(dense), plan), dense, plan, ids, FitOptions(rows=4))
            folded = True
        except OverRepError:
            folded = False
        assert folded != blocked, arch


@pytest.mark.parametrize("teacher", ["model", "stream"])
def test_auto_warm_start_warms_overrep_where_the_fit_applies(assets, tmp_path, teacher):
    p = Pipeline(tiny_cfg(assets, tmp_path / "a", recovery__warm_start="auto", recovery__closed_rows=8,
                          cache__teacher=teacher, prune__remove="2-3", **FAST), progress=False)
    p.load(create_output=False)
    assert p.metrics["warm_start"] == {"setting": "auto", "used": "replaceme", "preset": "hybrid-linear",
                                       "block1_init": "retained", "blocks": 3}
    assert (p.rcfg.warm_start, p.rcfg.preset, p.rcfg.warmup_steps) == ("replaceme", "hybrid-linear", 20)
    # the warm start's own layout: block 1 retained (no stitch), three blocks for the one run
    assert [(g.module_layers, g.stitch) for g in p.plan.groups] == [([1, 4, 5], {})]
    p.prune()
    run = build_recovery(p.method_inputs(), p.method)
    assert run.prepared["warm_start"]["kind"] == "lstsq" and run.preset.name == "hybrid-linear"


def test_auto_warm_start_keeps_the_blocks_the_user_set_and_cold_runs_keep_the_stitched_two(assets, tmp_path):
    warm = Pipeline(tiny_cfg(assets, tmp_path / "w", recovery__warm_start="auto", recovery__closed_rows=8,
                             recovery__blocks=2, prune__remove="2-3", **FAST), progress=False)
    warm.load(create_output=False)
    assert [(g.module_layers, g.stitch) for g in warm.plan.groups] == [([1, 4], {})]
    cold = Pipeline(tiny_cfg(assets, tmp_path / "c", recovery__warm_start="none", prune__remove="2-3", **FAST),
                    progress=False)
    cold.load(create_output=False)
    assert [(g.module_layers, g.stitch) for g in cold.plan.groups] == [([1, 4], {1: 3})]
    assert cold.metrics["warm_start"] == {"setting": "none", "used": "none"}
    # a mask of several runs starts cold under auto (measured worse warm on Block Influence's mask)
    runs = Pipeline(tiny_cfg(assets, tmp_path / "r", recovery__warm_start="auto", recovery__closed_rows=8,
                             prune__remove="1,3", **FAST), progress=False)
    runs.load(create_output=False)
    assert runs.metrics["warm_start"]["used"] == "none"
    assert "removes 2 separate runs, where the warm start measured worse" in runs.metrics["warm_start"]["why"]
    assert runs.metrics["warm_start"]["cold"] == "runs"  # the reason as a code, for the grid's tables
    from overrep.app.compare_summary import cold_reason  # a grid cell of older code: named from the sentence
    assert cold_reason({"cold_because": runs.metrics["warm_start"]["why"]}) == "a mask of several runs"
    assert runs.rcfg.warm_start == "none"
    # asked for, it warms them in the layout configured: stitched, one block a run
    asked = Pipeline(tiny_cfg(assets, tmp_path / "q", recovery__warm_start="replaceme", recovery__closed_rows=8,
                              prune__remove="1,3", **FAST), progress=False)
    asked.load(create_output=False)
    assert asked.metrics["warm_start"]["used"] == "replaceme"
    assert [(g.module_layers, g.stitch) for g in asked.plan.groups] == [([0], {0: 1}), ([2], {2: 3})]


def test_auto_warm_start_keeps_the_layout_configured_where_the_run_leaves_no_room_for_three_blocks(assets, tmp_path):
    # one block after the run (the final one), as on the paper's mask: the module cannot reach
    # three blocks, and there retained block 1 measured worse than the stitched one
    p = Pipeline(tiny_cfg(assets, tmp_path / "a", recovery__warm_start="auto", recovery__closed_rows=8,
                          prune__remove="3-4", **FAST), progress=False)
    p.load(create_output=False)
    w = p.metrics["warm_start"]
    assert (w["used"], w["preset"], w["block1_init"], w["blocks"]) == ("replaceme", "hybrid-linear", "stitched", 2)
    assert "no room for 3 recovery blocks" in w["layout_why"]
    assert [(g.module_layers, g.stitch) for g in p.plan.groups] == [([2, 5], {2: 4})]
    # without the final block in reach, a run two blocks from the end has no room either
    q = Pipeline(tiny_cfg(assets, tmp_path / "b", recovery__warm_start="auto", recovery__closed_rows=8,
                          recovery__final_block=False, prune__remove="2-3", **FAST), progress=False)
    q.load(create_output=False)
    assert q.metrics["warm_start"]["block1_init"] == "stitched"


@pytest.mark.parametrize("method, preset", [("plain", "plain"), ("streamline", "plain-full")])
def test_auto_warms_plain_and_streamline_under_their_ceilings_with_their_own_presets(assets, tmp_path, method, preset):
    p = Pipeline(tiny_cfg(assets, tmp_path / "a", recovery__method=method, recovery__warm_start="auto",
                          recovery__steps=8, recovery__closed_rows=8, **FAST), progress=False)
    p.load(create_output=False)
    assert p.metrics["warm_start"]["used"] == "replaceme" and p.rcfg.preset_name == preset
    assert p.metrics["warm_start"].get("block1_init") is None  # OverRep's warm layout is OverRep's alone


def test_an_explicit_warm_start_warms_plain_and_keeps_its_preset(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "a", recovery__method="plain", recovery__warm_start="replaceme",
                          recovery__closed_rows=8, **FAST), progress=False)
    p.load(create_output=False)
    assert p.metrics["warm_start"] == {"setting": "replaceme", "used": "replaceme"}
    assert p.rcfg.warm_start == "replaceme"
    p.prune()
    run = build_recovery(p.method_inputs(), p.method)
    assert run.prepared["warm_start"]["kind"] == "lstsq" and run.preset.name == "plain"


@pytest.mark.parametrize("over, words", [
    # Plain and Streamline past their ceilings of steps, where the map stopped paying them
    (dict(recovery__method="streamline", recovery__steps=STREAMLINE_AUTO_WARM_MAX_STEPS + 1),
     f"past the {STREAMLINE_AUTO_WARM_MAX_STEPS} up to which"),
    (dict(recovery__method="plain", recovery__epochs=1000, recovery__steps=None, recovery__time_budget=None),
     f"past the {PLAIN_AUTO_WARM_MAX_STEPS}"),
    (dict(recovery__method="lora"), "not measured to gain"),  # an explicit warm_start warms it (below)
    (dict(prune__remove="0-1"), "block 0"),
    (dict(prune__granularity="width", prune__remove=None, prune__ratio=0.25), "widths"),
])
def test_auto_warm_start_starts_cold_and_says_why_elsewhere(assets, tmp_path, over, words):
    p = Pipeline(tiny_cfg(assets, tmp_path / "a", recovery__warm_start="auto", **FAST, **over), progress=False)
    p.load(create_output=False)
    decided = p.metrics["warm_start"]
    assert decided["used"] == "none" and words in decided["why"]
    assert p.rcfg.warm_start == "none" and p.rcfg.warmup_steps == 0 and p.rcfg.preset == p.cfg.recovery.preset


def test_an_explicit_warm_start_with_width_pruning_is_one_clear_error(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "a", recovery__warm_start="replaceme", prune__granularity="width",
                          prune__remove=None, prune__ratio=0.25, **FAST), progress=False)
    with pytest.raises(OverRepError, match="width pruning removes none"):
        p.load(create_output=False)


def test_an_explicit_warm_start_keeps_the_preset_it_is_given(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "e", recovery__warm_start="replaceme", **FAST), progress=False)
    p.load(create_output=False)
    assert p.rcfg.preset == "hybrid" and p.metrics["warm_start"] == {"setting": "replaceme", "used": "replaceme"}


def test_the_report_says_how_training_started():
    from overrep.app.report import _warm_start_line

    assert "ReplaceMe" in _warm_start_line({"setting": "auto", "used": "replaceme", "preset": "hybrid-linear"})[0]
    assert "did not apply (experts)" in _warm_start_line({"setting": "auto", "used": "none", "why": "experts"})[0]
    assert "cold" in _warm_start_line({"setting": "none", "used": "none"})[0] and _warm_start_line(None) == []
