"""Width (channel-wise) pruning: plans, the exact start and fold of OverRep's rectangular D,
export, and the pipeline through the CLI, on tiny random models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from overrep.app.cli import main
from overrep.app.config import RunConfig
from overrep.core.precision import autocast
from overrep.core.schedule import AlphaSchedule
from overrep.errors import OverRepError
from overrep.model.accounting import counted_parameters
from overrep.model.presets import get_preset
from overrep.model.width import WidthPlan, slice_width
from overrep.model.wrap import apply_preset, count_parameters, merge_recovery
from overrep.pruning.width import plan_width, width_counts

from tiny import tiny_cfg, tiny_ids, tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]  # q/k norms, biases, GeGLU, sliding windows


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("arch", ARCHS)
def test_overcomplete_width_model_starts_at_the_pruned_model_and_folds_exactly(arch, tmp_path):
    dense, ids = tiny_model(arch), tiny_ids()
    plan, _ = plan_width(dense, 0.25, "taylor", tiny_ids(4, 16, seed=1))
    sliced = slice_width(copy.deepcopy(dense), plan)
    wrapped = copy.deepcopy(dense)
    modules = apply_preset(wrapped, plan, get_preset("width"), AlphaSchedule(10, 0.1, 0.2))
    assert len(modules) == dense.config.num_hidden_layers
    assert torch.equal(_logits(wrapped, ids), _logits(sliced, ids))  # training starts exactly there
    _perturb(wrapped)
    for m in modules:
        m.activation.set_step(9)  # the final linear phase
    before = _logits(wrapped, ids)
    merge_recovery(wrapped)
    after = _logits(wrapped, ids)
    assert (after - before).abs().max().item() <= 1e-5 * before.abs().max().item()
    wrapped.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.allclose(_logits(reloaded, ids), after, atol=1e-6)
    assert count_parameters(reloaded) == count_parameters(sliced) < count_parameters(dense)
    w = plan.widths()
    assert reloaded.config.intermediate_size == w["intermediate_size"]
    assert reloaded.config.num_attention_heads == w["num_attention_heads"]


def test_rectangular_d_under_bf16_autocast_stays_close_to_fp32():
    dense, ids = tiny_model("llama"), tiny_ids()
    plan, _ = plan_width(dense, 0.25, "magnitude")
    model = copy.deepcopy(dense)
    modules = apply_preset(model, plan, get_preset("width"), AlphaSchedule(10, 0.1, 0.2))
    _perturb(model)
    for m in modules:
        m.activation.set_step(9)
    ref = _logits(model, ids)
    with autocast("bf16", ids.device):
        low = _logits(model, ids).float()
    assert (low - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    with autocast("bf16", ids.device):  # at initialisation the selection is exact: only bf16 matmuls differ
        assert torch.isfinite(_logits(model, ids)).all()


def test_width_counts_meet_the_ratio_and_keep_attention_valid():
    dense = tiny_model("llama")  # 4 query heads in 2 key/value groups
    total, _ = counted_parameters(dense)
    for ratio in (0.15, 0.25, 0.4):
        plan, _ = plan_width(dense, ratio, "magnitude")
        sliced = slice_width(copy.deepcopy(dense), plan)
        removed = (count_parameters(dense) - count_parameters(sliced)) / total
        assert abs(removed - ratio) < 0.02, (ratio, removed)
        w = plan.widths()
        assert w["num_attention_heads"] % w["num_key_value_heads"] == 0
    assert width_counts(dense, 0.25, heads=False)["heads"] == 4  # MLP channels only
    mha = AutoModelForCausalLM.from_config(
        type(dense.config)(**{**dense.config.to_dict(), "num_key_value_heads": 4}))
    c = width_counts(mha, 0.3)
    assert c["heads"] == c["kv_heads"] < 4  # multi-head attention: whole heads go, k and v with them
    plan, _ = plan_width(mha, 0.3, "magnitude")
    assert _logits(slice_width(copy.deepcopy(mha), plan), tiny_ids()).shape[-1] == 97
    with pytest.raises(OverRepError, match="more than the blocks' width"):
        width_counts(dense, 0.95)


def test_criteria_keep_the_important_channels():
    dense = tiny_model("llama")
    with torch.no_grad():
        dense.model.layers[0].mlp.down_proj.weight[:, 5] = 0  # channel 5 does nothing
        dense.model.layers[0].mlp.gate_proj.weight[7] *= 50  # channel 7 is large
    mag, scores = plan_width(dense, 0.25, "magnitude")
    assert 5 not in mag.channels[0] and 7 in mag.channels[0]
    taylor, t_scores = plan_width(dense, 0.25, "taylor", tiny_ids(4, 16, seed=1))
    assert 5 not in taylor.channels[0]  # no effect on the loss: zero Taylor importance
    assert t_scores[0]["channels"][5] == 0 and scores[0]["channels"] != t_scores[0]["channels"]


def test_moe_and_uneven_plans_are_refused():
    with pytest.raises(OverRepError, match="mixture-of-experts"):
        plan_width(tiny_model("qwen3_moe"), 0.25, "magnitude")
    with pytest.raises(OverRepError, match="same widths"):
        WidthPlan(2, 8, {0: [0], 1: [0, 1]}, {0: [0], 1: [0]}, {0: [1], 1: [1]})


def cli(*args):
    return main(list(args))


def test_cli_width_run_exports_a_loadable_model(assets, tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "w", prune__remove=None, prune__ratio=0.25, recovery__steps=4).save(cfg)
    assert cli("run", "--config", str(cfg), "--prune", "width", "--quiet") == 0
    out = tmp_path / "w"
    m = json.loads((out / "metrics.json").read_text())
    assert m["granularity"] == "width" and m["removed_layers"] == [] and m["merge_max_abs_diff"] <= 1e-4
    assert abs(m["param_fraction_removed_head_counted"] - 0.25) < 0.02
    saved = RunConfig.load(out / "config.yaml")
    assert saved.recovery.preset == "width-linear" and saved.cache.mode == "live"  # width's resolved defaults
    assert saved.recovery.lr == 1e-3  # given explicitly (tiny_cfg), so kept
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.config.intermediate_size == m["widths"]["after"]["intermediate_size"]
    assert count_parameters(model) == m["pruned_params"]
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
    capsys.readouterr()
    assert cli("inspect", "--config", str(cfg), "--prune", "width") == 0
    acc = json.loads(capsys.readouterr().out)
    assert acc["granularity"] == "width" and acc["trainable_params"] > 0


@pytest.mark.parametrize("extra, msg", [
    (["--remove", "2-3"], "width pruning takes prune.ratio"),
    (["--method", "streamline"], "block removal only"),
    (["--set", "prune.width_criterion=random"], "unknown prune.width_criterion"),
    (["--preset", "hybrid-narrow"], "needs D on its output side"),
])
def test_cli_width_bad_inputs_fail_in_one_line(assets, tmp_path, capsys, extra, msg):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "w", prune__remove=None, prune__ratio=0.25, recovery__steps=2).save(cfg)
    assert cli("run", "--config", str(cfg), "--prune", "width", "--quiet", *extra) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1], err
    assert not (tmp_path / "w" / "metrics.json").exists()


def test_plan_accounts_width_from_the_config_alone(assets, capsys):
    assert cli("plan", "--model", str(assets / "tiny-llama"), "--prune", "width", "--ratio", "0.25") == 0
    acc = json.loads(capsys.readouterr().out)
    dense = AutoModelForCausalLM.from_pretrained(assets / "tiny-llama")
    plan, _ = plan_width(dense, 0.25, "magnitude")
    wrapped = copy.deepcopy(dense)
    modules = apply_preset(wrapped, plan, get_preset("width"))
    assert acc["widths"] == plan.widths()
    assert acc["compact_params"] == count_parameters(slice_width(copy.deepcopy(dense), plan))
    assert acc["trainable_params"] == sum(count_parameters(m, trainable_only=True) for m in modules)
