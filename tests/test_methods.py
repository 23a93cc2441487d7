"""Recovery methods (OverRep and the baselines) on the tiny model: each trains, folds and exports."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from overrep.model.arch import decoder_layers
from overrep.errors import OverRepError
from overrep.model.accounting import recovery_account
from overrep.recovery.methods import METHODS, iso_rank, lora_params_per_rank
from overrep.recovery.objectives import LogitDistillation
from overrep.app.pipeline import Pipeline
from overrep.core.precision import resolve_precision

from tiny import run_killed_at, tiny_cfg, tiny_ids, tiny_model

FAST = dict(eval__perplexity=False, eval__latency=False)


@pytest.mark.parametrize("method", [m for m in METHODS if METHODS[m].trains])  # closed forms: test_closed_form
def test_every_method_exports_a_loadable_compact_model(assets, tmp_path, method):
    out = tmp_path / method
    m = Pipeline(tiny_cfg(assets, out, recovery__method=method, recovery__lora_rank=4, recovery__lr=None,
                          eval__latency=False), progress=False).run()
    assert m["method"] == method and m["train_steps"] == 8
    # same compact architecture for every method; restorelcc's merge switches on attention_bias
    # (q/k/v/o biases in every block) and counts exactly the parameters that adds
    extra = m["restorelcc_bias_params"] if method == "restorelcc" else 0
    assert m["recovered_params"] == m["pruned_params"] + extra
    if METHODS[method].family == "full":  # nothing to fold: the compact model's own weights were trained
        assert m.get("merge_max_abs_diff") is None
    else:
        assert 0.0 <= m["merge_max_abs_diff"] < 1e-4
    assert m["export_reload_max_abs_diff"] < 1e-5
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.config.num_hidden_layers == 4
    assert not any("lora" in k for k in load_file(out / "model" / "model.safetensors"))
    provenance = json.loads((out / "model" / "overrep.json").read_text())
    assert provenance["method"] == method and provenance["recovery"]["method"] == method
    assert m["lr"] == METHODS[method].default_lr
    assert m["precision"] == resolve_precision("auto", "cpu")  # the default, resolved for this CPU
    # the layer-wise loss is recorded where one applies (the run default), absent for LM/KD methods
    assert m.get("loss") == ("normed>ce" if METHODS[method].objective == "layerwise" else None)
    losses = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(losses)))


def test_trained_weights_differ_from_the_pruned_model(assets, tmp_path):
    """Each family really changes the compact model (the adapter merge is not a no-op)."""
    for method in ("lora", "full-ft", "overrep-kd", "streamline"):
        p = Pipeline(tiny_cfg(assets, tmp_path / method, recovery__method=method, recovery__lora_rank=4, **FAST),
                     progress=False)
        p.run()
        ref = Pipeline(tiny_cfg(assets, tmp_path / f"{method}-ref", **FAST), progress=False)
        ref.load()
        ref.prune()
        a, b = p.pruned.state_dict(), ref.pruned.state_dict()
        assert any(not torch.equal(a[k], b[k]) for k in b), method


def test_adalora_reallocates_ranks_during_training(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "ada", recovery__method="adalora", recovery__lora_rank=4,
                          recovery__steps=20, **FAST), progress=False)
    p.prepare_output()
    p.load()
    p.prune()
    p.build_recovery()
    p.train()
    ranks = p.recovery.ranks()
    assert ranks, "update_and_allocate never produced a rank pattern"
    assert len(ranks) == 4 * 7  # every projection of the 4 retained blocks
    assert min(ranks.values()) < 8  # some matrices lost rank ...
    assert len(set(ranks.values())) > 1  # ... unevenly: the allocation is data-driven, not uniform
    assert abs(sum(ranks.values()) / len(ranks) - 4) <= 1  # the budget is the target rank on average
    m = p.recovery.finish()
    assert m["adalora_ranks"]["min"] < 8


def test_adalora_resume_is_exact(assets, tmp_path, monkeypatch):
    kw = dict(recovery__method="adalora", recovery__lora_rank=4, recovery__steps=10, **FAST)
    Pipeline(tiny_cfg(assets, tmp_path / "ref", **kw), progress=False).run()
    cfg = tiny_cfg(assets, tmp_path / "killed", **kw)
    run_killed_at(monkeypatch, cfg, 5)
    Pipeline(cfg, resume=True, progress=False).run()
    a = load_file(tmp_path / "ref" / "model" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "model" / "model.safetensors")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k


def test_iso_rank_matches_overrep_trainable_parameters(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "iso", recovery__method="lora-iso", **FAST), progress=False)
    p.prepare_output()
    p.load()
    p.prune()
    per_rank = lora_params_per_rank(p.pruned)
    layers_before = p.dense.config.num_hidden_layers
    r = p.cfg.recovery
    target = recovery_account(p.dense.config, p.plan.removed, r.preset, blocks=r.blocks,
                              block1_init=r.block1_init)["trainable_params"]
    assert p.dense.config.num_hidden_layers == layers_before  # the account never touches the model's config
    expected_rank = iso_rank(p.pruned, target)
    p.build_recovery(with_data=False)
    assert p.recovery.iso_target == target
    assert p.recovery.rank == expected_rank == round(target / per_rank)
    assert p.recovery.trainable_params == expected_rank * per_rank
    assert abs(p.recovery.trainable_params - target) <= per_rank / 2 + 1
    over = Pipeline(tiny_cfg(assets, tmp_path / "over", **FAST), progress=False)
    over.load()
    over.prune()
    over.build_recovery(with_data=False)
    assert over.recovery.trainable_params == target


def test_full_ft_trains_every_block_and_nothing_else(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "ft", recovery__method="full-ft", **FAST), progress=False)
    p.load()
    p.prune()
    p.build_recovery()
    blocks = sum(q.numel() for layer in decoder_layers(p.pruned) for q in layer.parameters())
    assert p.recovery.trainable_params == blocks
    assert not p.pruned.get_input_embeddings().weight.requires_grad


def test_non_contiguous_mask_is_recovered_segment_by_segment(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "nc", prune__remove="1,4", recovery__steps=12, recovery__loss="mse",
                          **FAST), progress=False)
    p.prepare_output()
    p.load()
    p.prune()
    p.build_recovery()
    modules = p.recovery.modules
    assert len(p.plan.groups) == 2 and len(modules) == 2
    assert [g.runs for g in p.plan.groups] == [[(1, 1)], [(4, 4)]]
    assert modules[0].compact_indices != modules[1].compact_indices

    def per_module_mse():
        with torch.no_grad():
            return [F.mse_loss(m(f["inputs"], c), f["targets"]).item()
                    for m, f, c in zip(modules, p.recovery.val_probe, p.recovery.contexts)]

    before = per_module_mse()
    p.train()
    after = per_module_mse()
    assert all(a < b for a, b in zip(after, before)), (before, after)  # each segment recovers
    p.merge()
    assert p.metrics["merge_max_abs_diff"] < 1e-4


def test_logit_kd_is_the_forward_kl_to_the_teacher():
    teacher, student = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids = tiny_ids(2, 12)
    kd = LogitDistillation(student, teacher, ids, None)
    assert kd.rows_loss(ids).item() > 0
    p_t = torch.softmax(teacher(ids).logits, -1)
    log_s = torch.log_softmax(student(ids).logits, -1)
    naive = (p_t * (p_t.log() - log_s)).sum(-1).mean()
    assert torch.allclose(kd.rows_loss(ids), naive, atol=1e-5)
    assert LogitDistillation(teacher, teacher, ids, None).rows_loss(ids).abs().item() < 1e-6


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_whole_model_objectives_train_at_the_chosen_precision_and_validate_in_fp32(precision):
    """recovery.precision reaches the whole-model methods: their training forward runs under bf16
    autocast (the teacher's too) when asked, their validation always in fp32."""
    teacher, student = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids = tiny_ids(4, 12)
    seen = []
    for m in (teacher, student):
        m.model.layers[0].mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    kd = LogitDistillation(student, teacher, ids, ids[:2], precision=precision)
    loss = kd.loss([0, 1])
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()  # gradients reach the fp32 weights
    assert student.model.layers[0].mlp.down_proj.weight.grad.dtype == torch.float32
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert seen == [want, want]  # teacher, then student
    seen.clear()
    kd.validation_loss()
    assert seen and set(seen) == {torch.float32}


def test_unknown_method_is_one_clear_error(assets, tmp_path):
    with pytest.raises(OverRepError, match="unknown recovery.method 'lroa'"):
        tiny_cfg(assets, tmp_path / "x", recovery__method="lroa")


def test_data_driven_criterion_runs_on_the_pipeline_and_is_reused(assets, tmp_path, monkeypatch):
    """block-influence from the config: scored on the training rows, cached, and recovered."""
    cfg = tiny_cfg(assets, tmp_path / "bi", prune__remove=None, prune__ratio=0.3,
                   prune__criterion="block-influence", **FAST)
    m = Pipeline(cfg, progress=False).run()
    assert m["criterion"] == "block-influence" and len(m["criterion_scores"]["block_influence"]) == 6
    assert len(list((tmp_path / "cache" / "criteria").glob("block-influence-*.pt"))) == 1

    def never(*a, **k):
        raise AssertionError("the criterion ran again instead of reusing its cached selection")

    import overrep.pruning.cached as cached_module

    monkeypatch.setattr(cached_module, "get_criterion", lambda name: never)
    again = Pipeline(tiny_cfg(assets, tmp_path / "bi2", prune__remove=None, prune__ratio=0.3,
                              prune__criterion="block-influence", **FAST), progress=False)
    again.load()
    assert again.selection.removed == m["removed_layers"]


@pytest.mark.parametrize("criterion", ["cosine", "laco"])
def test_overrep_runs_on_other_criteria_masks(assets, tmp_path, criterion):
    m = Pipeline(tiny_cfg(assets, tmp_path / criterion, prune__remove=None, prune__ratio=0.3,
                          prune__criterion=criterion, **FAST), progress=False).run()
    assert m["criterion"] == criterion and m["merge_max_abs_diff"] < 1e-4
    model = AutoModelForCausalLM.from_pretrained(tmp_path / criterion / "model")
    assert model.config.num_hidden_layers == 6 - len(m["removed_layers"])
    if criterion == "laco":  # the collapsed block keeps its merged weights (no stitching over them)
        assert m["criterion_scores"]["merges"]
