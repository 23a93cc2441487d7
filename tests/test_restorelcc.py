"""RestoreLCC (recovery.method: restorelcc) on tiny models: probe, selection, exact start,
exact merge into attention biases, export, resume, refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from overrep.recovery.config import RecoveryConfig
from overrep.app.pipeline import Pipeline
from overrep.errors import OverRepError
from overrep.model.arch import decoder_layers
from overrep.model.surgery import plan_pruning, prune
from overrep.model.wrap import count_parameters
from overrep.recovery.methods import METHODS, build_recovery
from overrep.recovery.methods import restorelcc_probe as probe_mod
from overrep.recovery.methods.base import logits_of
from overrep.recovery.methods.restorelcc_probe import o_projections, run_probe, select_heads
from overrep.recovery.teacher import MethodInputs

from tiny import run_killed_at, tiny_cfg, tiny_ids, tiny_model

FAST = dict(eval__perplexity=False, eval__latency=False)
REMOVED = [2, 3]  # block 1 is stitched (MLP and norms of block 3); blocks 1, 4, 5 differ from the dense model


def dense_model(arch: str):
    """A tiny model whose norms are not all ones, so that stitching changes block 1's attention input."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def setup(arch: str = "llama", **config):
    dense = dense_model(arch)
    plan = plan_pruning(6, REMOVED)
    pruned = prune(copy.deepcopy(dense), plan)
    cfg = RecoveryConfig(**{"method": "restorelcc", "restorelcc_probe_rows": 4, **config})
    inputs = MethodInputs(pruned, dense, plan, cfg, tiny_ids(8, 16), tiny_ids(2, 16, seed=1), 4, None)
    return inputs, build_recovery(inputs, METHODS["restorelcc"])


def head_outputs(model, ids, kept=None):
    """Input of every (or every ``kept``) o_proj, by plain hooks: the explicit computation."""
    projs = o_projections(model)
    projs = projs if kept is None else [projs[i] for i in kept]
    got = {}
    handles = [m.register_forward_pre_hook(lambda mod, a, j=j: got.__setitem__(j, a[0].detach()))
               for j, m in enumerate(projs)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return [got[j] for j in range(len(projs))]


def test_probe_is_the_svd_of_the_head_differences_and_selects_the_top_scores():
    dense = dense_model("llama")
    plan = plan_pruning(6, REMOVED)
    pruned = prune(copy.deepcopy(dense), plan)
    ids = tiny_ids(4, 16)
    k = 3
    probe = run_probe(pruned, dense, plan.kept, ids, components=k, mode="gradient")
    heads, dim = 4, 8
    diffs = [(a - b).double().reshape(-1, heads, dim)
             for a, b in zip(head_outputs(dense, ids, plan.kept), head_outputs(pruned, ids))]
    assert diffs[0].abs().max() == 0 and probe.lost[0].abs().max() == 0  # block 0: nothing was lost
    for j, x in enumerate(diffs):
        for h in range(heads):
            u, s, vt = torch.linalg.svd(x[:, h], full_matrices=False)
            # the reference's lost component: sum_{i<k} mean(U[:, i]) S_i V_i
            lost = sum(u[:, i].mean() * s[i] * vt[i] for i in range(k))
            assert torch.allclose(probe.lost[j, h].double(), lost, atol=1e-5), (j, h)
            assert torch.allclose(probe.singular[j, h].double(), s, atol=1e-4)
            if s[0] > 1e-6:  # the leading direction, up to its sign
                assert torch.allclose(probe.directions[j, h, 0].double().abs(), vt[0].abs(), atol=1e-4)
    # the directions are orthonormal rows
    d = probe.directions[1].double()
    assert torch.allclose(d @ d.transpose(-1, -2), torch.eye(dim, dtype=torch.float64).expand(heads, -1, -1),
                          atol=1e-5)
    # activation editing measured head by head agrees with the one-backward estimate
    edit = run_probe(pruned, dense, plan.kept, ids, components=k, mode="edit")
    assert torch.equal(edit.lost, probe.lost)
    assert edit.scores.abs().max() > 0
    assert torch.allclose(probe.scores, edit.scores, rtol=0.1, atol=0.05 * edit.scores.abs().max().item())
    # selection: the top scores, ties by block then head
    chosen = select_heads(probe.scores, 0.25)
    assert len(chosen) == 4 == len(select_heads(probe.scores, 4))
    flat = sorted(((-probe.scores[j, h].item(), j, h) for j in range(4) for h in range(4)))
    assert chosen == sorted((j, h) for _, j, h in flat[:4])
    worst_chosen = min(probe.scores[j, h].item() for j, h in chosen)
    assert all(probe.scores[j, h].item() <= worst_chosen for j in range(4) for h in range(4) if (j, h) not in chosen)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3_moe"])
def test_starts_at_the_pruned_model_and_merges_into_attention_biases(arch, tmp_path):
    inputs, run = setup(arch, restorelcc_init_std=0.0)
    reference = prune(copy.deepcopy(inputs.dense), plan_pruning(6, REMOVED))
    ids = tiny_ids(2, 16, seed=3)
    assert torch.equal(logits_of(run.model, ids), logits_of(reference, ids))  # vectors at zero: the pruned model
    params = run.objective.parameters()
    assert all(not p.requires_grad for p in run.model.parameters())
    n_heads = len(run.heads)
    assert n_heads == round(0.25 * 4 * 4) and run.trainable_params == n_heads * 2 * 8 == sum(p.numel() for p in params)
    with torch.no_grad():  # "trained" vectors
        for p in params:
            p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    trained = logits_of(run.model, ids)
    assert not torch.allclose(trained, logits_of(reference, ids), atol=1e-3)
    pruned_params = count_parameters(run.model)
    out = run.finish()
    assert out["merge_max_rel_diff"] < 1e-5
    assert torch.allclose(logits_of(run.model, ids), trained, atol=1e-5 * trained.abs().max().item())
    assert run.model.config.attention_bias is True and not run.comp.handles  # no hook left
    cfg = run.model.config
    per_block = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * 8 + cfg.hidden_size
    assert out["restorelcc_bias_params"] == 4 * per_block == count_parameters(run.model) - pruned_params
    compensated = {j for j, _ in run.heads}
    for j, layer in enumerate(decoder_layers(run.model)):
        attn = layer.self_attn
        assert all(getattr(attn, f"{x}_proj").bias.abs().max() == 0 for x in "qkv")
        assert (attn.o_proj.bias.abs().max() > 0) == (j in compensated)
    run.model.save_pretrained(tmp_path / arch)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=torch.float32)
    assert count_parameters(reloaded) == count_parameters(run.model)
    assert torch.allclose(logits_of(reloaded, ids), logits_of(run.model, ids), atol=1e-5)
    assert "restorelcc" in run.describe() and run.describe()["restorelcc"]["trainable_params"] == n_heads * 16


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "nemotron_h", "bamba"])
def test_unmergeable_architectures_are_refused_before_probing(arch, monkeypatch):
    def never(*a, **k):
        raise AssertionError("probed an architecture it then refuses")

    monkeypatch.setattr(probe_mod, "run_probe", never)
    dense = tiny_model(arch)
    plan = plan_pruning(6, [2], block1_init="retained")  # (a one-part hybrid block takes no stitch)
    pruned = prune(copy.deepcopy(dense), plan)
    inputs = MethodInputs(pruned, dense, plan, RecoveryConfig(method="restorelcc"), tiny_ids(4, 16),
                          tiny_ids(2, 16), 4, None)
    with pytest.raises(OverRepError) as err:
        build_recovery(inputs, METHODS["restorelcc"])
    msg = str(err.value)
    assert "\n" not in msg and "restorelcc" in msg and type(pruned).__name__ in msg
    assert ("attention_bias" in msg) if arch in ("mistral", "qwen2") else ("no attention" in msg)


def test_bad_config_values_are_one_line_errors_and_set_up_is_seeded(assets, tmp_path):
    for field, value, match in [("restorelcc_heads", 0, "restorelcc_heads"), ("restorelcc_heads", 2.5, "whole count"),
                                ("restorelcc_components", 0, "restorelcc_components"),
                                ("restorelcc_probe", "exact", "gradient, edit"),
                                ("restorelcc_init_std", -1, "restorelcc_init_std")]:
        with pytest.raises(OverRepError, match=match):
            tiny_cfg(assets, tmp_path / "x", recovery__method="restorelcc", **{f"recovery__{field}": value})
    with pytest.raises(OverRepError, match="granularity: blocks"):
        tiny_cfg(assets, tmp_path / "x", recovery__method="restorelcc", prune__remove=None, prune__granularity="width")
    _, run = setup()
    with pytest.raises(OverRepError, match="asks for 99 heads"):
        select_heads(run.probe.scores, 99)
    # reproducible: the same seed gives the same heads and initial vectors, another seed other vectors
    _, same = setup()
    _, other = setup(seed=1)
    assert same.heads == run.heads == other.heads
    first = run.objective.parameters()
    assert all(torch.equal(a, b) for a, b in zip(first, same.objective.parameters()))
    assert not any(torch.equal(a, b) for a, b in zip(first, other.objective.parameters()))


def test_pipeline_trains_exports_reuses_the_probe_and_resumes_exactly(assets, tmp_path, monkeypatch):
    kw = dict(recovery__method="restorelcc", recovery__steps=8, **FAST)
    m = Pipeline(tiny_cfg(assets, tmp_path / "ref", **kw), progress=False).run()
    info = m["restorelcc"]
    assert not info["probe_cached"] and len(info["heads"]) == 4 and m["trainable_params"] == 4 * 2 * 8
    assert m["merge_max_rel_diff"] < 1e-5 and m["export_reload_max_abs_diff"] < 1e-5
    assert m["recovered_params"] == m["pruned_params"] + m["restorelcc_bias_params"] == m["pruned_params"] + 4 * 96
    assert len(list((tmp_path / "cache" / "restorelcc").glob("probe-*.pt"))) == 1
    assert m["timings_seconds"]["search"] == info["probe_computed_seconds"] > 0  # the probe's cost is reported
    provenance = json.loads((tmp_path / "ref" / "model" / "overrep.json").read_text())
    assert provenance["recovery"]["restorelcc"]["heads"] == info["heads"]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ref" / "model").config.attention_bias is True
    # the same run killed at step 5 and resumed: the probe comes from the cache, the weights are identical
    monkeypatch.setattr(probe_mod, "run_probe", lambda *a, **k: pytest.fail("the probe ran again"))
    cfg = tiny_cfg(assets, tmp_path / "killed", **kw)
    run_killed_at(monkeypatch, cfg, 5)
    again = Pipeline(cfg, resume=True, progress=False).run()
    assert again["restorelcc"]["probe_cached"] and again["restorelcc"]["heads"] == info["heads"]
    a = load_file(tmp_path / "ref" / "model" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and any(k.endswith("o_proj.bias") for k in a)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k
