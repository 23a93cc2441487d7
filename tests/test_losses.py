"""The layer-wise losses (recovery.loss): each against an explicit computation, plus one CLI run each."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from overrep.recovery import losses, teacher_stats
from overrep.app.cli import main
from overrep.app.config import RunConfig
from overrep.errors import OverRepError
from overrep.recovery.losses import LossOptions
from overrep.recovery.objectives import Layerwise
from overrep.app.pipeline import Pipeline

from tiny import tiny_cfg, tiny_model


def test_normed_loss_ignores_per_token_scale_except_through_lambda():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    gain = torch.rand(16, generator=g) + 0.5
    scale = torch.rand(2, 5, 1, generator=g) * 3 + 0.5  # under 10x the median: no token is an attention sink
    same = losses.normed_loss(pred, target, gain, 0.0, 0.1)
    assert torch.allclose(losses.normed_loss(pred, target * scale, gain, 0.0, 0.1), same, rtol=1e-5)
    # with lambda the magnitude term (and only it) sees the scale
    lam = 0.3
    mag = (pred.pow(2).mean(-1).sqrt().log() - (target * scale).pow(2).mean(-1).sqrt().log()).pow(2).mean()
    assert torch.allclose(losses.normed_loss(pred, target * scale, gain, lam, 0.1), same + lam * mag, rtol=1e-5)
    # raw MSE is not scale-invariant (what the normed loss is for)
    assert not torch.allclose(F.mse_loss(pred, target * scale), F.mse_loss(pred, target))


@pytest.mark.parametrize("weight", [1.0, 0.1])
def test_normed_loss_weighs_the_attention_sinks_apart_from_the_other_tokens(weight):
    g = torch.Generator().manual_seed(1)
    target = torch.randn(2, 64, 16, generator=g)
    target[:, 0] *= 100  # a massive activation on each row's first token (an attention sink)
    turned = target.clone()
    turned[:, 0] = -target[:, 0]  # the sinks turned away (their size right), every other token exact
    # the sinks' mean counts with its weight, not as 1/64 of a plain mean over the tokens:
    # opposite unit-RMS vectors differ by 4 per channel
    assert torch.isclose(losses.normed_loss(turned, target, torch.ones(16), 0.1, weight), torch.tensor(4.0 * weight))
    off = target.clone()
    off[:, 1:] = -target[:, 1:]  # now the ordinary tokens are turned and the sinks exact
    assert torch.isclose(losses.normed_loss(off, target, torch.ones(16), 0.1, weight), torch.tensor(4.0))


def test_norm_gain_reads_the_norm_weight():
    model = tiny_model("llama")
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, norm.weight.numel()))
    assert torch.allclose(losses.norm_gain(norm, norm.weight.numel()), norm.weight, rtol=1e-5)


def test_logit_loss_is_the_centred_logit_mse_through_the_real_head():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(2, 4, 32, generator=g), torch.randn(2, 4, 32, generator=g)
    with torch.no_grad():
        lp, lt = model.lm_head(pred), model.lm_head(target)
        lp, lt = lp - lp.mean(-1, keepdim=True), lt - lt.mean(-1, keepdim=True)
        explicit = (lp - lt).pow(2).mean(-1).mean()
        got = losses.logit_loss(pred, target, losses.centred_gram(model))
    assert torch.allclose(got, explicit, rtol=1e-4)
    assert got > 0


def test_topk_kl_equals_full_kl_at_full_vocabulary_and_ignores_the_rest_below():
    g = torch.Generator().manual_seed(2)
    teacher, student = torch.randn(3, 7, 97, generator=g) * 3, torch.randn(3, 7, 97, generator=g) * 3
    v, i = teacher.topk(97, dim=-1)
    full = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                    reduction="none").sum(-1).mean()
    assert torch.allclose(losses.topk_kl(student, v, i.int()), full, rtol=1e-5)
    v, i = teacher.topk(8, dim=-1)
    changed = student.clone()
    mask = torch.ones_like(changed, dtype=torch.bool).scatter_(-1, i, False)
    changed[mask] += 5.0  # logits outside the support do not enter the renormalised KL
    assert torch.allclose(losses.topk_kl(student, v, i), losses.topk_kl(changed, v, i), rtol=1e-5)


def test_fisher_weights_are_positive_finite_and_cached(assets, tmp_path, monkeypatch):
    cfg = tiny_cfg(assets, tmp_path / "f", recovery__loss="fisher", prune__remove="2-3")
    pipe = Pipeline(cfg, progress=False)
    pipe.load(create_output=False)
    w = teacher_stats.cached_fisher(pipe.teacher, pipe.cfg.recovery.fisher_sequences)
    assert len(w) == len(pipe.plan.groups) == 1
    assert w[0].shape == (pipe.dense.config.hidden_size,)
    assert torch.isfinite(w[0]).all() and (w[0] > 0).all()
    assert abs(w[0].mean().item() - 1) < 1e-5
    monkeypatch.setattr(teacher_stats, "fisher_diagonal", lambda *a, **k: pytest.fail("recomputed"))
    assert torch.equal(teacher_stats.cached_fisher(pipe.teacher, pipe.cfg.recovery.fisher_sequences)[0], w[0])


def test_mse_is_the_original_objective_bit_for_bit():
    g = torch.Generator().manual_seed(3)

    class Mod(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.activation = None
            self.norm = None

        def forward(self, h, ctx):
            return self.lin(h)

    mods = [Mod(), Mod()]
    batch = [{"inputs": torch.randn(2, 3, 8, generator=g), "targets": torch.randn(2, 3, 8, generator=g) * 100}
             for _ in mods]
    got = Layerwise(mods, [[], []], None).batch_loss(batch)
    expected = torch.stack([F.mse_loss(m(b["inputs"], None).float(), b["targets"].float())
                            for m, b in zip(mods, batch)]).mean()
    assert torch.equal(got, expected)


def test_loss_spelling():
    assert losses.parse_loss("normed>kl-topk") == ["normed", "kl-topk"]
    assert RunConfig.load().recovery.loss == "normed>ce"  # the default (docs/losses.md, README)
    assert RunConfig.load().recovery.loss_switch == 0.75  # chosen on validation (docs/results-log.md)
    with pytest.raises(OverRepError, match="A>B"):
        RunConfig.load(overrides={"recovery": {"loss": "mse>normed>logit"}})
    with pytest.raises(OverRepError, match="available: mse, normed"):
        RunConfig.load(overrides={"recovery": {"loss": "cosine"}})


@pytest.mark.parametrize("loss,remove", [("normed", "2-3"), ("fisher", "3-4"), ("logit", "3-4"),
                                         ("kl-topk", "2-3"), ("mse>kl-topk", "3-4"), ("normed>ce", "2-3"),
                                         ("normed>ce+kl", "2-3")])
def test_each_loss_runs_through_the_cli(assets, tmp_path, loss, remove):
    cfg = tmp_path / "c.yaml"
    out = tmp_path / "run"
    tiny_cfg(assets, out, recovery__steps=4, eval__latency=False).save(cfg)
    assert main(["run", "--config", str(cfg), "--quiet", "--remove", remove, "--loss", loss]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["recovered_ppl"] > 0 and m["merge_max_abs_diff"] <= 1e-4
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert any(r.get("val_ppl") for r in log)  # validation perplexity while training
    assert RunConfig.load(out / "config.yaml").recovery.loss == loss


def test_logit_refuses_a_module_inside_the_network(assets, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    # two blocks: the module [1, 4] ends inside the network (three would reach the final norm)
    tiny_cfg(assets, tmp_path / "run", recovery__steps=2, recovery__blocks=2).save(cfg)
    assert main(["run", "--config", str(cfg), "--quiet", "--remove", "2-3", "--loss", "logit"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("needs a module that ends at the final norm" in line for line in err)


def test_val_ppl_matches_the_pruned_model_as_it_stands(assets, tmp_path):
    cfg = tiny_cfg(assets, tmp_path / "v", recovery__steps=2, recovery__eval_every=1)
    pipe = Pipeline(cfg, progress=False)
    pipe.load(create_output=False)
    pipe.prune()
    pipe.build_recovery()
    from overrep.model.perplexity import perplexity

    ppl = pipe.recovery.objective.validation_ppl()
    assert ppl == pytest.approx(perplexity(pipe.pruned, pipe.val_ids, progress=False))


def test_ce_is_the_pruned_models_next_token_loss(assets, tmp_path):
    """``ce`` through the frozen tail is the loss of the whole pruned model on the same rows."""
    cfg = tiny_cfg(assets, tmp_path / "ce", recovery__steps=2, recovery__loss="ce")
    pipe = Pipeline(cfg, progress=False)
    pipe.load(create_output=False)
    pipe.prune()
    pipe.build_recovery()
    from overrep.model.perplexity import perplexity

    got = pipe.recovery.objective.validation_loss()
    assert got == pytest.approx(math.log(perplexity(pipe.pruned, pipe.val_ids, progress=False)), rel=1e-4)


def test_ce_once_is_the_pruned_models_loss_and_trains_every_module_on_a_mask_of_several_runs(assets, tmp_path):
    """With two removed runs, ``loss_tail: once`` is the whole pruned model's next-token loss (the
    first module's tail runs the second module), its gradient reaches both modules, and ``each``
    (every module from the dense model's state at its input) is another loss."""
    from overrep.model.perplexity import perplexity

    got = {}
    for tail in ("each", "once"):
        cfg = tiny_cfg(assets, tmp_path / tail, recovery__steps=2, recovery__loss="ce", recovery__loss_tail=tail,
                       recovery__final_block=False, prune__remove="1,4")
        pipe = Pipeline(cfg, progress=False)
        pipe.load(create_output=False)
        pipe.prune()
        pipe.build_recovery()
        objective = pipe.recovery.objective
        assert len(objective.modules) == 2
        got[tail] = objective.validation_loss()
        if tail == "once":
            assert got[tail] == pytest.approx(math.log(perplexity(pipe.pruned, pipe.val_ids, progress=False)), rel=1e-4)
            objective.loss([0, 1]).backward()
            for m in objective.modules:
                assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters() if p.requires_grad)
    assert got["each"] != pytest.approx(got["once"], rel=1e-4)
    with pytest.raises(OverRepError, match="loss_tail"):
        tiny_cfg(assets, tmp_path / "bad", recovery__loss_tail="twice").recovery.check_loss()


def test_ce_plus_kl_mixes_the_text_and_the_teacher_on_one_pass_of_the_tail(assets, tmp_path):
    """``ce+kl`` is ``(1 - w)·ce + w·kl-topk`` on the same rows: at w = 0 it is ``ce``, at w = 1
    ``kl-topk``, and between them their mix."""
    got = {}
    for loss, w in [("ce", 0.0), ("kl-topk", 0.0), ("ce+kl", 0.0), ("ce+kl", 1.0), ("ce+kl", 0.3)]:
        cfg = tiny_cfg(assets, tmp_path / f"{loss}{w}", recovery__steps=2, recovery__loss=loss, recovery__loss_kd=w)
        pipe = Pipeline(cfg, progress=False)
        pipe.load(create_output=False)
        pipe.prune()
        pipe.build_recovery()
        got[loss, w] = pipe.recovery.objective.validation_loss()
    ce, kl = got["ce", 0.0], got["kl-topk", 0.0]
    assert got["ce+kl", 0.0] == pytest.approx(ce, rel=1e-5) and got["ce+kl", 1.0] == pytest.approx(kl, rel=1e-5)
    assert got["ce+kl", 0.3] == pytest.approx(0.7 * ce + 0.3 * kl, rel=1e-5) and kl < ce


def test_every_loss_setting_reaches_the_loss(assets, tmp_path):
    """The objective reads the run's own loss options (``recovery.loss_sinks`` set in a config
    once stopped at the config and the loss weighed the sinks at the default)."""
    for sinks in (0.1, 5.0):
        cfg = tiny_cfg(assets, tmp_path / str(sinks), recovery__steps=2, recovery__loss="normed",
                       recovery__loss_sinks=sinks)
        pipe = Pipeline(cfg, progress=False)
        pipe.load(create_output=False)
        pipe.prune()
        pipe.build_recovery()
        assert pipe.recovery.objective.options.loss_sinks == sinks


def test_topk_kl_with_the_rest_bucket_sees_mass_outside_the_support():
    g = torch.Generator().manual_seed(4)
    teacher, student = torch.randn(2, 5, 97, generator=g) * 3, torch.randn(2, 5, 97, generator=g) * 3
    logp = F.log_softmax(teacher, -1)
    full = F.kl_div(F.log_softmax(student, -1), logp, log_target=True, reduction="none").sum(-1).mean()
    v, i = logp.topk(97, dim=-1)
    assert torch.allclose(losses.topk_kl(student, v, i, rest=True), full, rtol=1e-4)
    v, i = logp.topk(8, dim=-1)
    changed = student.clone()
    mask = torch.ones_like(changed, dtype=torch.bool).scatter_(-1, i, False)
    changed[mask] += 5.0
    assert losses.topk_kl(changed, v, i, rest=True) > losses.topk_kl(student, v, i, rest=True) + 1


def test_the_second_phase_starts_a_fresh_pass_over_the_rows(tmp_path):
    """Steps from an A>B objective's switch draw a new shuffle that covers every row before
    any repeats, whatever the first phase had reached; before it the order is unchanged."""
    from overrep.recovery.options import TrainingOptions
    from overrep.recovery.sampler import epoch_batches
    from overrep.recovery.trainer import Trainer
    from tiny import LinearModule

    obj = Layerwise([LinearModule()], [[]], None, options=LossOptions(loss="normed>ce", loss_switch=0.7), total_steps=20)
    obj.activations = []
    t = Trainer(obj, 24, TrainingOptions(batch_size=4, lr=1e-3), 20, tmp_path, progress=False)
    assert obj.phase_starts() == [14]
    assert t.batch_indices(3) == epoch_batches(24, 4, seed=0, epoch=0)[3]
    second = [i for s in range(14, 20) for i in t.batch_indices(s)]
    assert sorted(second) == list(range(24))
    # a re-fit inside the second phase shortens the run but never moves the switch (the fresh
    # pass it started would change order mid-phase); a checkpoint keeps where it is
    obj.after_optimizer_step(15)
    t.set_total(17)
    assert obj.phase_starts() == [14] and obj.current() == "ce" and obj.extra_state()["switch_step"] == 14
    again = Layerwise([LinearModule()], [[]], None, options=LossOptions(loss="normed>ce", loss_switch=0.7), total_steps=17)
    again.load_extra_state(obj.extra_state())
    assert again.phase_starts() == [14]


def test_a_next_token_phase_is_one_pass_over_the_rows_at_most(tmp_path):
    """``ce`` learns the training text, so its phase never sees a row twice: where the switch's
    share of the steps is more than one pass, the switch moves later (the first phase gets
    those steps), and a re-fit after the switch cannot lengthen the phase past one pass. A
    layer-wise later phase (``mse>normed``) keeps its share."""
    from overrep.recovery.options import TrainingOptions
    from overrep.recovery.trainer import Trainer
    from tiny import LinearModule

    def trainer(loss, rows):
        obj = Layerwise([LinearModule()], [[]], None, options=LossOptions(loss=loss, loss_switch=0.8), total_steps=100)
        obj.activations = []
        return obj, Trainer(obj, rows, TrainingOptions(batch_size=4, lr=1e-3), 100, tmp_path, progress=False)

    obj, t = trainer("normed>ce", 40)  # one pass: 10 steps, against the switch's 20
    assert obj.phase_starts() == [90] and t.total == 100 and obj.step_limit() is None  # the switch bounds it
    second = [i for s in range(90, 100) for i in t.batch_indices(s)]
    assert sorted(second) == list(range(40))
    t.set_total(200)  # a re-fit before the switch moves it with the count
    assert obj.phase_starts() == [190] and t.total == 200
    obj.after_optimizer_step(192)
    t.set_total(230)  # after it: no step beyond one pass
    assert t.total == 200 and obj.phase_starts() == [190] and obj.step_limit() == 200
    t.set_total(195)  # shortening still works
    assert t.total == 195
    obj, t = trainer("normed>ce", 400)  # rows enough: the share stands
    assert obj.phase_starts() == [80] and t.total == 100
    obj, t = trainer("mse>normed", 40)
    assert obj.phase_starts() == [80] and obj.step_limit() is None


def test_rows_past_the_cache_are_read_with_the_features_a_cache_would_hold(tmp_path):
    """The later phase's rows past the cached ones: their inputs computed when read (the
    blocks before the gap only: the next-token loss reads no targets), equal to what caching
    them would have stored, in the batch's order, and counted."""
    from overrep.model.surgery import plan_pruning
    from overrep.recovery.teacher import Teacher
    from tiny import tiny_ids, tiny_model

    dense = tiny_model("llama").eval()
    plan = plan_pruning(6, [3, 4])
    ids = tiny_ids(batch=12, seq=16)
    whole = Teacher(dense, plan, ids, tmp_path, {"t": "whole"}, progress=False)
    part = Teacher(dense, plan, ids, tmp_path, {"t": "part"}, progress=False)
    part.use_rows(8)
    assert part.train_ids.shape[0] == 8 and part.all_ids.shape[0] == 12
    want, got = whole.features(), part.features()
    for idx in ([9, 11], [1, 3], [10, 8]):  # past the cache; cached; past it again
        for a, b in zip(want(idx), got(idx)):
            assert set(b) == ({"inputs"} if min(idx) >= 8 else {"inputs", "targets"})
            for k in b:
                assert torch.allclose(a[k].float(), b[k].float(), atol=1e-5) and a[k].dtype == b[k].dtype
    assert part.live_rows_read == 4 and part.live_seconds > 0 and whole.live_rows_read == 0
    blocks = [(g.input_layer, g.target_layer) for g in plan.groups]
    assert part.live_share == max(1, max(i for i, _ in blocks)) / (max(t for _, t in blocks) + 1) < 1


def test_a_budget_that_caches_fewer_of_the_same_rows_reads_them_from_the_cache_on_disk(tmp_path, monkeypatch):
    """Two runs of one plan whose probes timed a step differently cache 8 and 12 of the same
    rows: the second reads the first's cache instead of running the dense model again, and the
    other way round only the rows the smaller cache lacks are computed."""
    from overrep.model.surgery import plan_pruning
    from overrep.recovery import teacher as teacher_mod
    from tiny import tiny_ids, tiny_model

    dense = tiny_model("llama").eval()
    plan = plan_pruning(6, [3, 4])
    ids = tiny_ids(batch=12, seq=16)
    forwards = []
    real = teacher_mod.teacher_features
    monkeypatch.setattr(teacher_mod, "teacher_features", lambda m, x, *a: forwards.append(x.shape[0]) or real(m, x, *a))

    def teacher(root, rows):
        t = teacher_mod.Teacher(dense, plan, ids, root, {"t": "same"}, progress=False)
        t.use_rows(rows)
        return t, t.features()

    whole, want = teacher(tmp_path / "a", 12)
    assert sum(forwards) == 12
    part, got = teacher(tmp_path / "a", 8)
    assert sum(forwards) == 12 and part.cache.path == whole.cache_path and len(part.cache) == 8
    for a, b in zip(want([7, 0]), got([7, 0])):
        assert all(torch.equal(a[k], b[k]) for k in ("inputs", "targets"))
    small, _ = teacher(tmp_path / "b", 8)
    forwards.clear()
    bigger, got = teacher(tmp_path / "b", 12)
    assert sum(forwards) == 4 and bigger.cache.path == bigger.cache_path != small.cache_path
    for a, b in zip(want([11, 2]), got([11, 2])):
        assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-5) for k in ("inputs", "targets"))


def test_a_next_token_phase_reads_the_cached_rows_then_the_rows_past_them(tmp_path):
    """With rows past the cache (``Objective.live_rows``), the ``ce`` phase's one pass is the
    cached rows in a fresh order, then the others, each once: the switch moves only where
    both together are less than its share."""
    from overrep.recovery.options import TrainingOptions
    from overrep.recovery.trainer import Trainer
    from tiny import LinearModule

    obj = Layerwise([LinearModule()], [[]], None, options=LossOptions(loss="normed>ce", loss_switch=0.8), total_steps=100)
    obj.activations, obj.live_rows = [], 16
    t = Trainer(obj, 40, TrainingOptions(batch_size=4, lr=1e-3), 100, tmp_path, progress=False)
    assert obj.pass_steps == 14 and obj.phase_starts() == [86]  # 10 cached + 4 live steps, against 20
    cached = [i for s in range(86, 96) for i in t.batch_indices(s)]
    live = [i for s in range(96, 100) for i in t.batch_indices(s)]
    assert sorted(cached) == list(range(40)) and sorted(live) == list(range(40, 56))
    obj.after_optimizer_step(90)
    t.set_total(130)  # after the switch: one pass over both, no more
    assert t.total == 100
    few = Layerwise([LinearModule()], [[]], None, options=LossOptions(loss="normed>ce", loss_switch=0.8), total_steps=100)
    few.activations, few.live_rows = [], 3  # fewer than a batch: none
    assert Trainer(few, 40, TrainingOptions(batch_size=4, lr=1e-3), 100, tmp_path, progress=False).live_rows == 0
