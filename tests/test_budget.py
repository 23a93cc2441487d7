"""Time budgets: parsing, fitting a step count, and a budgeted run end to end."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest

from overrep.app.pipeline import Pipeline
from overrep.errors import OverRepError
from overrep.recovery.budget import Deadline, StepCosts, fit_steps, parse_duration, phase_costs, spread, validation_plan

from tiny import run_killed_at, tiny_cfg


@pytest.fixture(autouse=True)
def few_steps_allowed(monkeypatch):
    """These tests give the tiny model budgets of a few steps on purpose (cheap); the floor
    on a budget's step count has its own test below."""
    import overrep.app.budgeting as budgeting

    monkeypatch.setattr(budgeting, "MIN_BUDGET_STEPS", 1)
    monkeypatch.setattr(budgeting, "MIN_WARM_BUDGET_STEPS", 1)


def test_a_budget_that_leaves_too_few_steps_is_refused_before_training(assets, tmp_path, monkeypatch):
    """A budget whose measured step count is below the floor stops with a one-line error that
    says how much time would do, and leaves no run folder behind (1 step measured far worse
    than no training)."""
    import overrep.app.budgeting as budgeting
    from overrep.recovery.trainer import Trainer

    monkeypatch.setattr(budgeting, "MIN_BUDGET_STEPS", 10)
    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(5.0, 0.0, 0.0))  # ~3 steps fit in 20 s
    out = tmp_path / "short"
    cfg = tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                   recovery__time_budget="20s", recovery__warm_start="none")
    with pytest.raises(OverRepError, match=r"time_budget 20s leaves overrep [1-3] optimiser step\(s\).*at least 10 "
                                           r"are needed \(about \d+ s here; recovery.budget_min_steps sets the floor\).*--method replaceme"):
        Pipeline(cfg, progress=False).run()
    assert not (out / "metrics.json").exists() and not (out / "model").exists()
    # a warm start has a good model to lose: its floor is its own
    monkeypatch.setattr(budgeting, "MIN_BUDGET_STEPS", 1)
    monkeypatch.setattr(budgeting, "MIN_WARM_BUDGET_STEPS", 10)
    warm = tiny_cfg(assets, tmp_path / "warm", eval__perplexity=False, eval__latency=False, recovery__steps=None,
                    recovery__time_budget="20s", recovery__warm_start="replaceme")
    with pytest.raises(OverRepError, match=r"at least 10 are needed from a warm start.*start cold "
                                           r"\(--set recovery.warm_start=none\) or use a closed form"):
        Pipeline(warm, progress=False).run()
    assert not (tmp_path / "warm" / "metrics.json").exists()
    # recovery.budget_min_steps overrides both floors
    ok = tiny_cfg(assets, tmp_path / "ok", eval__perplexity=False, eval__latency=False, recovery__steps=None,
                  recovery__time_budget="20s", recovery__warm_start="replaceme", recovery__budget_min_steps=1)
    fits = count_map_fits(monkeypatch)
    done = Pipeline(ok, progress=False).run()
    assert done["train_steps"] >= 1 and len(fits) == 1  # fitted once, after the probe (which timed the layout)
    assert "before the warm start's map was fitted" in done["time_budget"]["timed_by"]


def count_map_fits(monkeypatch) -> list:
    """A list that grows by one each time a warm start's map is fitted."""
    import overrep.recovery.methods.closed_form as closed_form

    fits, real = [], closed_form.fit_and_fold
    monkeypatch.setattr(closed_form, "fit_and_fold", lambda *a, **k: fits.append(1) or real(*a, **k))
    return fits


def test_auto_warms_plain_only_up_to_its_step_ceiling(assets, tmp_path, monkeypatch):
    """``recovery.warm_start: auto`` warms Plain only where the run trains at most its method's
    ``auto_warm_max_steps`` (the map stops paying it past them): a step count set in the config
    decides before the plan; a time budget's once its probe has timed the warm start, before the
    map is fitted, and the fall-back is recorded in the run folder, so that a ``--resume``
    (whose checkpointed step count decides nothing) starts cold too."""
    from overrep.recovery.methods import METHODS
    from overrep.recovery.trainer import Trainer

    monkeypatch.setitem(METHODS._entries, "plain", replace(METHODS["plain"], auto_warm_max_steps=5))
    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(1.0, 0.0, 0.0))  # ~15 in 20 s

    def cfg(name, **over):
        return tiny_cfg(assets, tmp_path / name, eval__latency=False, eval__domains="", recovery__closed_rows=8,
                        prune__remove="2-3", recovery__method="plain", **over)

    fits = count_map_fits(monkeypatch)
    few = Pipeline(cfg("few", recovery__steps=5), progress=False).run()
    assert few["warm_start"]["used"] == "replaceme" and len(fits) == 1
    many = Pipeline(cfg("many", recovery__steps=6), progress=False).run()
    assert many["warm_start"]["used"] == "none" and many["warm_start"]["cold"] == "steps" and len(fits) == 1
    assert "plain trains 6 steps, past the 5 up to which the map was measured to pay it" in many["warm_start"]["why"]
    budgeted = cfg("budgeted", recovery__steps=None, recovery__time_budget="20s")
    long = Pipeline(budgeted, progress=False).run()
    assert long["warm_start"]["used"] == "none" and long["warm_start"]["cold"] == "steps" and len(fits) == 1
    assert re.search(r"plain trains \d+ steps, past the 5", long["warm_start"]["why"]) and long["train_steps"] > 5
    assert "warm start's probe" in long["time_budget"]["timed_by"]  # timed once, warm
    assert json.loads((tmp_path / "budgeted" / "cold_start.json").read_text())["cold"] == "steps"
    again = cfg("again", recovery__steps=None, recovery__time_budget="20s")
    run_killed_at(monkeypatch, again, 2)
    resumed = Pipeline(again, resume=True, progress=False).run()
    assert resumed["warm_start"]["used"] == "none" and resumed["warm_start"]["cold"] == "steps" and len(fits) == 1
    assert resumed["warm_start"]["why"].startswith("the run it resumes started cold: plain trains")
    (tmp_path / "again" / "cold_start.json").write_text("{}")  # a damaged record: one clear line, not a KeyError
    with pytest.raises(OverRepError, match=r"cold_start.json .*the run folder is damaged"):
        Pipeline(again, resume=True, progress=False).run()
    named = Pipeline(cfg("named", recovery__steps=6, recovery__warm_start="replaceme"), progress=False).run()
    assert named["warm_start"]["used"] == "replaceme" and len(fits) == 2  # asked for by name: any step count


def test_auto_warm_start_starts_cold_where_the_budget_leaves_it_too_few_steps(assets, tmp_path, monkeypatch):
    """``recovery.warm_start: auto`` where the budget leaves the warm start fewer steps than its
    floor trains the cold start instead (a warm start asked for by name is refused, above): the
    cold start's plan, its stitched unrecovered model scored as a cold run scores it, the reason
    in metrics.json; a --resume of that run resumes the cold start."""
    import overrep.app.budgeting as budgeting
    from overrep.recovery.trainer import Trainer

    monkeypatch.setattr(budgeting, "MIN_WARM_BUDGET_STEPS", 100)
    probes = []
    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: probes.append(1) or StepCosts(1.0, 0.0, 0.0))  # ~15 steps in 20 s

    def cfg(name, **over):
        over = {"recovery__steps": None, "recovery__time_budget": "20s", **over}
        return tiny_cfg(assets, tmp_path / name, eval__latency=False, eval__domains="", recovery__closed_rows=8,
                        prune__remove="2-3", **over)

    fits = count_map_fits(monkeypatch)
    auto = Pipeline(cfg("auto"), progress=False).run()
    assert not fits  # refused on the probe, before the map's fit spent the budget's seconds
    assert auto["warm_start"]["setting"] == "auto" and auto["warm_start"]["used"] == "none"
    assert re.search(r"leaves the warm start \d+ of the 100 optimiser steps it needs \(about \d+ s here\)", auto["warm_start"]["why"])
    assert auto["warm_start"]["cold"] == "budget"  # the reason as a code, for the grid's tables
    from overrep.app.compare_summary import cold_reason  # a grid cell of older code: named from the sentence
    assert cold_reason({"cold_because": auto["warm_start"]["why"]}) == "too short for the warm start"
    assert auto["train_steps"] >= 3
    assert len(probes) == 1 and "warm start's probe" in auto["time_budget"]["timed_by"]  # not timed a second time
    cold = Pipeline(cfg("cold", recovery__warm_start="none"), progress=False).run()
    assert json.loads((tmp_path / "auto" / "plan.json").read_text()) == json.loads(
        (tmp_path / "cold" / "plan.json").read_text())
    assert auto["recovery_modules"] == cold["recovery_modules"]
    assert auto["pruned_ppl"] == cold["pruned_ppl"]  # the stitched block, not the warm layout's retained one
    warm = Pipeline(cfg("warm", recovery__time_budget=None, recovery__steps=2), progress=False).run()  # no budget: warm
    assert warm["warm_start"]["used"] == "replaceme" and warm["pruned_ppl"] != auto["pruned_ppl"]
    assert "of the 100 optimiser steps it needs" in (tmp_path / "auto" / "report.md").read_text()
    # killed while training cold, resumed: the run's own plan (the cold one), not the warm start's
    again = cfg("again")
    run_killed_at(monkeypatch, again, 2)
    resumed = Pipeline(again, resume=True, progress=False).run()
    assert resumed["warm_start"] == {"setting": "auto", "used": "none", "preset": "hybrid", "cold": "budget",
                                     "why": "the run it resumes started cold: " + json.loads(
                                         (tmp_path / "again" / "cold_start.json").read_text())["why"]}
    assert "of the 100 optimiser steps it needs" in resumed["warm_start"]["why"]
    assert resumed["recovery_modules"] == cold["recovery_modules"]
    # a budget too short for the cold start too: its refusal says the warm start was tried first
    monkeypatch.setattr(budgeting, "MIN_BUDGET_STEPS", 100)
    with pytest.raises(OverRepError, match=r"at least 100 are needed .*tried the warm start first: \d+ of the 100"):
        Pipeline(cfg("neither"), progress=False).run()
    assert not (tmp_path / "neither" / "metrics.json").exists()


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("20m", 1200), ("1.5h", 5400), ("300", 300), (45, 45),
                                          ("2min", 120)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["abc", "-5m", "0", "5d", "nan"])
def test_bad_durations_are_refused(bad):
    with pytest.raises(OverRepError, match="time_budget"):
        parse_duration(bad)


def test_fit_steps_is_the_largest_count_that_fits():
    costs = StepCosts(step=2.0, validation=5.0, checkpoint=3.0)
    for left in (1.0, 10.0, 100.0, 1234.5):
        n = fit_steps(left, costs, eval_every=10, checkpoint_every=25)
        assert n == 1 or costs.run_seconds(n, 10, 25) <= left
        assert costs.run_seconds(n + 1, 10, 25) > left or n == 1
    assert fit_steps(1000.0, StepCosts(1.0, 0.0, 0.0), 10, 10) == 1000


def test_budget_flag_and_max_steps_conflict(assets, tmp_path, capsys):
    from overrep.app.cli import main

    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "x").save(cfg)
    assert main(["run", "--config", str(cfg), "--max-steps", "3", "--time-budget", "1m", "--quiet"]) == 2
    assert "give one" in capsys.readouterr().err


def test_explicit_steps_take_precedence_over_a_budget(assets, tmp_path):
    cfg = tiny_cfg(assets, tmp_path / "x", eval__perplexity=False, eval__latency=False, recovery__steps=3,
                   recovery__time_budget="1h")
    m = Pipeline(cfg, progress=False).run()
    assert m["train_steps"] == 3 and "time_budget" not in m


def no_deadline_stop(monkeypatch):
    """For the tests of the step plan: a tiny model's step times vary too much for its plan to
    land on the deadline, and stopping there is tested on its own below."""
    from overrep.recovery.trainer import Trainer

    monkeypatch.setattr(Trainer, "past_deadline", lambda self, step_seconds=(): False)


def test_budgeted_run_fixes_its_steps_and_completes_its_schedules(assets, tmp_path, monkeypatch):
    no_deadline_stop(monkeypatch)
    out = tmp_path / "budget"
    cfg = tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                   recovery__time_budget="5s", recovery__warm_start="none")  # cold: the annealed preset
    m = Pipeline(cfg, progress=False).run()
    tb = m["time_budget"]
    assert tb["seconds"] == 5 and tb["steps"] == m["train_steps"] >= 1
    assert tb["measured_seconds_per_step"] > 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == tb["steps"] and log[-1]["alpha"] == 0.0  # the schedule ran to its end
    assert m["merge_max_rel_diff"] <= 1e-5


def test_fit_steps_counts_the_features_of_the_rows_it_will_train_on():
    costs = StepCosts(step=1.0, validation=0.0, checkpoint=0.0, row=0.5, rows_per_step=4, max_rows=24)
    assert costs.rows(3) == 12 and costs.rows(100) == 24  # never more rows than the data has
    assert costs.run_seconds(3, 10, 10) == 3 * 1.0 + 12 * 0.5
    assert fit_steps(9.0, costs, 10, 10) == 3  # 3 steps on 12 new rows: 9 s
    assert fit_steps(100.0, costs, 10, 10) == 88  # all 24 rows cached (12 s), then 88 steps


def test_more_passes_buy_more_steps_on_fewer_rows():
    """``recovery.budget_passes``: each cached row planned to be seen twice halves the rows
    a step count needs, so a budget dominated by features fits more steps."""
    once = StepCosts(step=1.0, validation=0.0, checkpoint=0.0, row=0.5, rows_per_step=4, max_rows=24)
    twice = StepCosts(step=1.0, validation=0.0, checkpoint=0.0, row=0.5, rows_per_step=4, max_rows=24, passes=2)
    assert twice.rows(3) == 6 and twice.rows(1) == 4  # at least one step's batch
    assert fit_steps(9.0, once, 10, 10) == 3 and fit_steps(9.0, twice, 10, 10) == 4  # 4 s + 8 rows x 0.5 s
    assert twice.rows(100) == once.rows(100) == 24  # a long budget caches everything either way


def test_a_short_budget_caches_only_the_rows_it_trains_on(assets, tmp_path, monkeypatch):
    """Layer-wise method, disk cache: the probe fixes steps and rows together, and the cache
    holds exactly ``steps x batch`` rows when each is planned to be seen once
    (``recovery.budget_passes: 1``) and that is less than the data."""
    from overrep.recovery.trainer import Trainer

    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(5.0, 0.0, 0.0))  # a slow step
    out = tmp_path / "short"
    cfg = tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                   recovery__time_budget="20s", recovery__budget_passes=1)
    m = Pipeline(cfg, progress=False).run()
    tb = m["time_budget"]
    assert 1 <= tb["steps"] <= 3 and tb["rows"] == 4 * tb["steps"] < 24
    assert tb["measured_feature_seconds_per_row"] > 0
    manifest = json.loads((tmp_path / m["cache"]["path"] / "manifest.json").read_text())
    assert manifest["layout"]["num_samples"] == tb["rows"]
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == tb["steps"] == m["train_steps"] and log[-1]["alpha"] == 0.0
    assert m["merge_max_rel_diff"] <= 1e-5


def test_a_loss_with_per_row_extras_prices_them_per_row(assets, tmp_path, monkeypatch):
    """``ce+kl`` (and ``kl-topk``) caches the dense model's top-K for every training row after
    the features: a budget prices that per row, from what the probe's few rows cost, not as a
    fixed cost of the probe's size."""
    from overrep.recovery import teacher_stats

    real = teacher_stats.teacher_topk

    def slow(dense, ids, k, batch=8):  # a dear teacher pass: 0.05 s a row
        time.sleep(0.05 * ids.shape[0])
        return real(dense, ids, k, batch)

    monkeypatch.setattr(teacher_stats, "teacher_topk", slow)
    monkeypatch.setattr("overrep.recovery.losses.teacher_topk", slow)
    no_deadline_stop(monkeypatch)
    out = tmp_path / "extras"
    cfg = tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                   recovery__time_budget="20s", recovery__warm_start="none", recovery__loss="normed>ce+kl")
    tb = Pipeline(cfg, progress=False).run()["time_budget"]
    assert tb["measured_extras_seconds_per_row"] >= 0.05


def test_a_budgeted_run_resumes_on_the_same_rows_and_steps(assets, tmp_path, monkeypatch):
    """Killed after its second step, the budgeted run resumes with the step count and the
    rows from its checkpoint (no new measurement) and ends where an unbroken run ends."""
    no_deadline_stop(monkeypatch)
    import torch
    from safetensors.torch import load_file

    from overrep.recovery.trainer import Trainer

    import overrep.app.budgeting as budgeting

    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(4.0, 0.0, 0.0))
    monkeypatch.setattr(budgeting, "fit_steps", lambda *a, **k: 4)  # the same plan, however fast this machine is
    monkeypatch.setattr(Deadline, "steps_left", lambda self, seconds, now, **k: 1)  # and the re-fit keeps it
    kw = dict(eval__perplexity=False, eval__latency=False, recovery__steps=None, recovery__time_budget="20s",
              recovery__checkpoint_every=1, recovery__budget_passes=1)  # one pass: 16 of the 24 rows
    ref = Pipeline(tiny_cfg(assets, tmp_path / "ref", **kw), progress=False).run()
    steps, rows = ref["time_budget"]["steps"], ref["time_budget"]["rows"]
    assert (steps, rows) == (4, 16)
    cfg = tiny_cfg(assets, tmp_path / "killed", **kw)
    run_killed_at(monkeypatch, cfg, 2)
    ckpt = torch.load(tmp_path / "killed" / "checkpoints" / "step-000002.pt", weights_only=True)
    before = ckpt["budget_seconds"]  # the killed process's seconds, features included, up to its checkpoint
    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: pytest.fail("measured again on resume"))
    m = Pipeline(cfg, resume=True, progress=False).run()
    tb = m["time_budget"]
    assert (tb["steps"], tb["rows"]) == (steps, rows) == (m["train_steps"], rows)
    # the seconds used count both processes: the resumed one's alone would flatter the budget
    assert tb["resumed_from_step"] == 2 and tb["seconds_before_resume"] == before > 0
    assert tb["used_seconds"] > before and "resumed_from_step" not in ref["time_budget"]
    a = load_file(tmp_path / "ref" / "model" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "model" / "model.safetensors")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k


def test_validations_take_at_most_their_share_of_a_budget():
    costs = StepCosts(step=0.5, validation=11.5, checkpoint=0.2)
    assert validation_plan(720.0, 0.05, costs) == 3  # 36 s of a 12-minute run: three validations
    assert validation_plan(150.0, 0.05, costs) == 0  # one would take 7.7% of 2.5 minutes: none
    assert validation_plan(720.0, 0.0, costs) == 0
    assert spread(820, 3) == 274 and -(-820 // 274) == 3  # at 274, 548 and the last step
    assert spread(820, 0) == 0
    assert costs.run_seconds(10, 0, 100) == 10 * 0.5 + 0.2  # eval_every 0: no validation counted


def test_a_budgeted_run_validates_as_often_as_its_share_allows(assets, tmp_path, monkeypatch):
    """recovery.validation_share fixes the cadence: with validations of 1 s in a 20-s budget
    and a share of 0.1, two validations (the last at the end), whatever eval_every says."""
    no_deadline_stop(monkeypatch)
    from overrep.recovery.trainer import Trainer

    import overrep.app.budgeting as budgeting

    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(0.1, 1.0, 0.0))
    monkeypatch.setattr(budgeting, "fit_steps", lambda *a, **k: 6)
    monkeypatch.setattr(Deadline, "steps_left", lambda self, seconds, now, **k: 3)  # re-fit at step 3: still 6
    # a warm start also scores its closed form before step 1 and always its last step
    # (recovery.keep_best's guard), whatever the share affords
    for warm, share, expected, every in (("none", 0.1, [3, 6], 3), ("none", 0.0, [], 0), ("replaceme", 0.0, [6], 6),
                                         ("replaceme", 0.1, [3, 6], 3)):
        out = tmp_path / f"{warm}-{share}"
        m = Pipeline(tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                              recovery__time_budget="20s", recovery__eval_every=1, recovery__validation_share=share,
                              recovery__warm_start=warm), progress=False).run()
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log if r.get("val_ppl") is not None] == expected
        assert m["time_budget"]["eval_every"] == every
        assert ("start_val_ppl" in (m["keep_best"] or {})) == (warm != "none")


def test_a_refit_that_adds_steps_moves_the_last_validation_to_the_last_step(assets, tmp_path, monkeypatch):
    """Six steps planned, nine after the re-fit at step 3: the validations the plan afforded
    are spread over the nine, the last at step 9, not left at the old cadence's step 6
    (where the last step then went unvalidated and keep_best could not compare it)."""
    no_deadline_stop(monkeypatch)
    from overrep.recovery.trainer import Trainer

    import overrep.app.budgeting as budgeting

    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(0.1, 1.0, 0.0))
    monkeypatch.setattr(budgeting, "fit_steps", lambda *a, **k: 6)
    for warm, share, expected in (("none", 0.1, [5, 9]), ("replaceme", 0.0, [9])):
        left = iter([6, 3])  # the re-fits at steps 3 and 6: nine steps in all
        monkeypatch.setattr(Deadline, "steps_left", lambda self, seconds, now, **k: next(left))
        out = tmp_path / warm
        m = Pipeline(tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                              recovery__time_budget="20s", recovery__eval_every=1, recovery__validation_share=share,
                              recovery__warm_start=warm), progress=False).run()
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        assert len(log) == 9 and [r["step"] for r in log if r.get("val_ppl") is not None] == expected
        assert m["time_budget"]["refit"]["at"][0]["eval_every"] == expected[0]
        assert m["keep_best"]["last_val_ppl"] is not None  # the last step was scored


def test_the_deadline_refits_steps_to_the_observed_step_time():
    costs = StepCosts(step=1.5, validation=0.0, checkpoint=0.0, anneal=2.0)  # linear-phase steps are cheaper
    deadline = Deadline(at=100.0, costs=costs, eval_every=10, checkpoint_every=10)
    assert deadline.steps_left(2.0, now=40.0) == fit_steps(0.99 * 60.0, costs, 10, 10) == 39
    assert deadline.steps_left(1.0, now=40.0) == 79  # steps twice as fast as the probe said: twice as many
    assert deadline.steps_left(2.0, now=120.0) == 1  # past the deadline: one step ends the schedule
    assert deadline.refit_steps(1000) == (20, 40) and deadline.refit_steps(50) == (5, 10)
    assert deadline.refit_steps(4) == (3, 6)


def test_a_later_phase_is_priced_on_its_own_and_held_to_one_pass():
    """``normed>ce``: the ``ce`` steps cost several ``normed`` ones and see each of the rows once
    at most, so the steps it cannot take go to the cheap first phase (an average of the two had
    left a run's time unused once the one-pass limit shortened the costly phase)."""
    costs = StepCosts(step=1.0, validation=0.0, checkpoint=0.0, later=4.0, later_share=0.2, one_pass=True,
                      rows_per_step=8, max_rows=80)
    assert costs.later_steps(100) == 10  # one pass over 80 rows, not the 20 steps of its share
    assert costs.train_seconds(100) == 90 * 1.0 + 10 * 4.0
    assert costs.train_seconds(100, done=40) == 50 * 1.0 + 10 * 4.0
    assert fit_steps(130.0, costs, 0, 1000) == 100
    free = replace(costs, one_pass=False)
    assert free.later_steps(100) == 20 and fit_steps(130.0, free, 0, 1000) == 82  # 66 x 1 s + 16 x 4 s
    deadline = Deadline(at=100.0, costs=costs, eval_every=0, checkpoint_every=1000)
    # 40 steps done, 60 s left: the re-fit prices the rest with the rows the run cached
    assert deadline.steps_left(1.0, now=40.0, done=40, rows=80) + 40 == fit_steps(0.99 * 60, costs, 0, 1000, 40) == 69
    assert deadline.steps_left(1.0, now=40.0, done=40, rows=160) == 22  # 20 more rows: 10 costly steps more
    timed = [(0, 0.7, 1.2), (70, 0.1, 0.8), (80, 0.2, 4.0)]  # (step, share, seconds) of each stretch
    measured = phase_costs(timed, 80, (0.2, True), 5.0, 1.0)
    assert measured.anneal == 1.2 and measured.later == 4.0 and abs(measured.step - (0.7 * 1.2 + 0.1 * 0.8) / 0.8) < 1e-9
    assert phase_costs(timed[:2], None, None, 5.0, 1.0).later_share == 0.0


def test_a_budgeted_run_refits_its_steps_once_it_has_timed_them(assets, tmp_path, monkeypatch):
    """The probe claims 0.5 s a step; the real steps are far faster, so after a few of them
    the run takes more steps, on the rows it cached, and still ends its schedules."""
    no_deadline_stop(monkeypatch)
    from overrep.recovery.trainer import Trainer

    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(0.5, 0.0, 0.0, anneal=0.5))
    out = tmp_path / "refit"
    cfg = tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                   recovery__time_budget="8s", recovery__warm_start="none",  # cold: the annealed preset
                   recovery__loss="normed")  # one phase: a later one is re-fitted on its own (below)
    m = Pipeline(cfg, progress=False).run()
    tb = m["time_budget"]
    refit = tb["refit"]
    assert refit["steps_before"] < refit["steps_after"] == tb["steps"] == m["train_steps"]
    first, second = refit["at"][:2]  # after the first steps, and as many again timed on the steps in between
    assert second["step"] == 2 * first["step"] and refit["at"][-1]["steps"] == refit["steps_after"]
    assert first["seconds_per_step"] < refit["probe_seconds_per_step"] == 0.5
    # each re-fit records the seconds it had and those it planned: the slack it left itself
    assert all(0 < a["seconds_planned"] <= 0.99 * a["seconds_left"] + 0.01 for a in refit["at"])
    assert all(b["seconds_left"] < a["seconds_left"] for a, b in zip(refit["at"], refit["at"][1:]))
    manifest = json.loads((tmp_path / m["cache"]["path"] / "manifest.json").read_text())
    assert manifest["layout"]["num_samples"] == tb["rows"]  # the cache was built before the re-fit
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == tb["steps"] and log[-1]["alpha"] == 0.0 and log[-1]["lr"] < log[first["step"]]["lr"]
    assert m["merge_max_rel_diff"] <= 1e-5


def slow_until_refits(assets, out, monkeypatch, refits: int, pause: float, **cfg):
    """A budgeted run whose steps take ``pause`` s more until ``refits`` re-fits are done, its
    probe pricing a step at ``pause``: the run's metrics and each step's first-stretch end."""
    no_deadline_stop(monkeypatch)
    from overrep.recovery.trainer import Trainer

    real_step, ends = Trainer._step, []

    def step(self):
        if self.refit is None or len(self.refit["at"]) < refits:
            time.sleep(pause)
        ends.append(self.first_stretch_end())
        return real_step(self)

    monkeypatch.setattr(Trainer, "_step", step)
    monkeypatch.setattr(Trainer, "measure",
                        lambda self, steps=2, within=None: StepCosts(pause, 0.0, 0.0, anneal=pause))
    cfg = tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                   recovery__time_budget="8s", **cfg)
    return Pipeline(cfg, progress=False).run(), ends


def test_a_second_refit_catches_steps_that_got_faster(assets, tmp_path, monkeypatch):
    """Steps that are slow until the first re-fit and fast after it: the first re-fit plans
    for the slow rate, the second, timed on the steps in between, takes more steps (one
    re-fit left LoRA 10% of a CPU budget unused this way)."""
    m, _ = slow_until_refits(assets, tmp_path / "second", monkeypatch, 1, 0.5, recovery__warm_start="none",
                             recovery__loss="normed")
    first, second = m["time_budget"]["refit"]["at"][:2]
    # the real step's own time (which a loaded machine stretches) is in both; the half second is not
    assert first["seconds_per_step"] >= 0.5 and second["seconds_per_step"] < first["seconds_per_step"] - 0.3
    assert second["steps"] > first["steps"] and m["train_steps"] == m["time_budget"]["refit"]["at"][-1]["steps"]


def test_a_run_priced_alike_throughout_goes_on_refitting_at_doubling_steps(assets, tmp_path, monkeypatch):
    """LoRA (no α phases, one loss): steps slow until the second re-fit and fast after it are
    caught by a third, at twice the second's step, which takes more steps."""
    m, _ = slow_until_refits(assets, tmp_path / "lora", monkeypatch, 2, 0.3, recovery__method="lora")
    at = m["time_budget"]["refit"]["at"]
    assert len(at) >= 3 and at[1]["step"] == 2 * at[0]["step"] and at[2]["step"] == 2 * at[1]["step"]
    assert at[2]["seconds_per_step"] < at[1]["seconds_per_step"] - 0.2 and at[2]["steps"] > at[1]["steps"]
    assert m["train_steps"] == at[-1]["steps"]


def test_a_run_priced_by_stretch_refits_at_doubling_steps_inside_its_first_stretch(assets, tmp_path, monkeypatch):
    """OverRep cold (α phases: the final linear stretch priced apart): steps slow until the
    second re-fit are caught by a third at twice its step, and no re-fit is timed past the end
    of the first stretch, whose steps price the rest (OverRep-KD had left 28 s of 300 unused
    with two re-fits)."""
    m, ends = slow_until_refits(assets, tmp_path / "kd", monkeypatch, 2, 0.3, recovery__warm_start="none",
                                recovery__loss="normed")
    at = m["time_budget"]["refit"]["at"]
    assert len(at) >= 3 and at[1]["step"] == 2 * at[0]["step"] and at[2]["step"] == 2 * at[1]["step"]
    assert at[2]["seconds_per_step"] < at[1]["seconds_per_step"] - 0.2 and at[2]["steps"] > at[1]["steps"]
    assert all(r["step"] <= ends[r["step"] - 1] for r in at)  # each timed inside the first stretch as it then stood
    assert ends[-1] < m["train_steps"] == at[-1]["steps"]  # the run has a stretch after it (the linear phase)


@pytest.mark.parametrize("method", ["overrep", "lora", "overrep-warm"])
def test_a_budget_is_fitted_once_and_no_stage_runs_twice(assets, tmp_path, monkeypatch, method):
    """The fit measures a copy of the pruned model between pruning and the method's set-up:
    the model is pruned once, the method built once for the measurement and once to train,
    and a warm start's closed form is fitted once (before the probe, which copies it)."""
    no_deadline_stop(monkeypatch)
    import overrep.app.budgeting as budgeting
    import overrep.app.pipeline as pipeline
    import overrep.recovery.methods.closed_form as closed_form
    from overrep.recovery.trainer import Trainer

    calls = {"prune": 0, "probe": 0, "build": 0, "measure": 0, "fit": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(pipeline, "prune", counted("prune", pipeline.prune))
    monkeypatch.setattr(budgeting, "build_recovery", counted("probe", budgeting.build_recovery))
    monkeypatch.setattr(pipeline, "build_recovery", counted("build", pipeline.build_recovery))
    monkeypatch.setattr(Trainer, "measure", counted("measure", Trainer.measure))
    monkeypatch.setattr(closed_form, "fit_and_fold", counted("fit", closed_form.fit_and_fold))
    import overrep.recovery.teacher as teacher
    from overrep.memo import tensor_digest
    forwards = []  # the rows of every dense forward for features: the method reads the probe's, never again

    def features(model, ids, *a, **k):
        forwards.append(tensor_digest(ids))
        return features.real(model, ids, *a, **k)
    features.real = teacher.teacher_features
    monkeypatch.setattr(teacher, "teacher_features", features)
    warm = method == "overrep-warm"  # the default (auto) warm-starts OverRep on this model; "overrep": cold
    start = {} if warm else {"recovery__warm_start": "none"}
    cfg = tiny_cfg(assets, tmp_path / method, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                   recovery__time_budget="5s", recovery__method=method.removesuffix("-warm"), **start)
    m = Pipeline(cfg, progress=False).run()
    assert calls == {"prune": 1, "probe": 1, "build": 1, "measure": 1, "fit": int(warm)}
    assert len(forwards) == len(set(forwards)) and (method == "lora" or forwards)
    if warm:  # the exported model's provenance names the fit it started from
        provenance = json.loads((tmp_path / method / "model" / "overrep.json").read_text())
        assert provenance["recovery"]["warm_start"]["kind"] == "lstsq"
    assert m["time_budget"]["steps"] == m["train_steps"] >= 1


def test_a_budgeted_run_stops_at_its_deadline_and_still_folds(assets, tmp_path, monkeypatch):
    """When the machine slows down after the step count was fixed, training stops at the
    deadline (the cell is scored at its budget, not after it); the α schedule still ends at 0,
    so the module folds exactly, and ``metrics.json`` says where it stopped."""
    from overrep.recovery.trainer import Trainer

    import overrep.app.budgeting as budgeting

    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(0.001, 0.0, 0.0))
    monkeypatch.setattr(budgeting, "fit_steps", lambda *a, **k: 100_000)  # far more steps than 4 s allow
    monkeypatch.setattr(Deadline, "steps_left", lambda self, seconds, now, **k: 100_000)
    m = Pipeline(tiny_cfg(assets, tmp_path / "run", eval__perplexity=False, eval__latency=False, recovery__steps=None,
                          recovery__time_budget="4s", recovery__checkpoint_every=1000), progress=False).run()
    tb = m["time_budget"]
    assert tb["stopped_at_step"] is not None and m["train_steps"] == tb["stopped_at_step"] < 100_000
    assert tb["used_seconds"] < 4.0 + 3.0  # the final bookkeeping
    assert m["merge_max_rel_diff"] <= 1e-5 and m["train_flops"] > 0


def slow_steps(monkeypatch, seconds: float, validation: float) -> None:
    """Steps of ``seconds`` each, a plan of far more steps than fit, and a probe that says a
    validation takes ``validation`` seconds: the deadline, not the plan, ends the run."""
    import time

    from overrep.recovery.trainer import Trainer

    import overrep.app.budgeting as budgeting

    real_step = Trainer._step

    def slow_step(self):
        time.sleep(seconds)
        return real_step(self)

    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(0.001, validation, 0.0))
    monkeypatch.setattr(budgeting, "fit_steps", lambda *a, **k: 1000)
    monkeypatch.setattr(Deadline, "steps_left", lambda self, seconds, now, **k: 1000)
    monkeypatch.setattr(Trainer, "_step", slow_step)


def test_a_run_of_long_steps_stops_before_a_step_that_would_end_past_its_deadline(assets, tmp_path, monkeypatch):
    """A step of a large share of the budget is not started when it would end after the
    deadline: the run ends within its budget instead of overrunning it by most of a step. The
    FLOP count after training (bookkeeping) is no part of the seconds it used."""
    from overrep.recovery.trainer import Trainer

    slow_steps(monkeypatch, 0.9, validation=0.0)
    count = Trainer.count_flops
    monkeypatch.setattr(Trainer, "count_flops", lambda self: (time.sleep(1.0), count(self))[1])
    m = Pipeline(tiny_cfg(assets, tmp_path / "run", eval__perplexity=False, eval__latency=False, recovery__steps=None,
                          recovery__time_budget="5s", recovery__checkpoint_every=1000), progress=False).run()
    tb = m["time_budget"]
    assert tb["stopped_at_step"] == m["train_steps"] >= 1
    # a tenth of a step for timer jitter; before, the step that crossed the deadline ran to its end
    assert tb["used_seconds"] <= 5.0 + 0.1, tb
    assert m["merge_max_rel_diff"] <= 1e-5 and m["train_flops"] > 0


def test_a_run_stopped_at_its_deadline_validates_the_step_it_stops_at(assets, tmp_path, monkeypatch):
    """Steps slower than the plan: the run stops one validation before its deadline and scores
    the step it stops at, so keep_best compares the model it exports with the warm start's
    closed form (before, the last validation stayed wherever the cadence had put it)."""
    slow_steps(monkeypatch, 0.5, validation=1.0)  # the stop leaves the 1 s of a validation
    out = tmp_path / "run"
    m = Pipeline(tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                          recovery__time_budget="6s", recovery__checkpoint_every=1000,
                          recovery__warm_start="replaceme"), progress=False).run()
    tb = m["time_budget"]
    assert tb["stopped_at_step"] == m["train_steps"] >= 1 and tb["used_seconds"] <= 6.0 + 0.1, tb
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r.get("val_ppl") is not None] == [m["train_steps"]]
    sel = m["keep_best"]
    assert sel["last_step"] == m["train_steps"] and sel["last_val_ppl"] is not None and "start_val_ppl" in sel
    assert m["merge_max_rel_diff"] <= 1e-5


def test_a_validation_slower_than_the_probe_said_is_priced_at_its_own_seconds(assets, tmp_path, monkeypatch):
    """The probe scales a quarter of the rows up to price a validation; a real one can take
    longer. A warm start validates its closed form first, and from then on the run reserves
    what that validation took, so the last one still ends inside the budget (before, a
    2.5-minute run priced it at 9.9 s, let one more step through and ended 4 s over)."""
    from overrep.recovery.objectives import Layerwise

    slow_steps(monkeypatch, 0.3, validation=0.1)  # the probe says 0.1 s
    real = Layerwise.validation_loss
    monkeypatch.setattr(Layerwise, "validation_loss", lambda self: (time.sleep(1.5), real(self))[1])  # it takes 1.5
    out = tmp_path / "run"
    m = Pipeline(tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                          recovery__time_budget="6s", recovery__checkpoint_every=1000,
                          recovery__warm_start="replaceme"), progress=False).run()
    tb = m["time_budget"]
    assert tb["used_seconds"] <= 6.0 + 0.1, tb
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    scored = [r for r in log if r.get("val_ppl") is not None]
    assert scored and scored[-1]["step"] == m["train_steps"] and scored[-1]["val_seconds"] >= 1.5


def test_the_probe_times_a_validation_on_a_sample_of_its_rows():
    """A budget learns what a validation costs from a quarter of its rows, scaled up, not from
    a whole one (at a short budget a whole one was up to a fifth of it); the rows are all back
    afterwards, also when the timing fails."""
    from overrep.recovery.objectives import LanguageModeling
    from overrep.recovery.probe import VALIDATION_PROBE_FRACTION

    from tiny import tiny_ids, tiny_model

    objective = LanguageModeling(tiny_model("llama"), tiny_ids(8, 32), tiny_ids(12, 32, seed=1))
    with objective.validation_sample(VALIDATION_PROBE_FRACTION) as scale:
        assert objective.val_ids.shape[0] == 3 and scale == 4.0
        assert objective.validation_ppl() > 1
    assert objective.val_ids.shape[0] == 12
    with pytest.raises(RuntimeError), objective.validation_sample(0.5):
        raise RuntimeError("timing failed")
    assert objective.val_ids.shape[0] == 12


def test_the_probe_times_each_phase_of_a_two_loss_objective(tmp_path, monkeypatch):
    """A step of a loss through the frozen tail (``ce``, ``kl-topk``) costs several of a
    layer-wise one: ``A>B`` is timed in each phase, each priced on its own (``step`` and
    ``later``, for the last ``later_share`` of the steps), and ``anneal`` (what a re-fit scales
    by) is the first phase, where a run starts."""
    import torch

    from overrep.recovery import trainer as trainer_mod
    from overrep.recovery.losses import LossOptions
    from overrep.recovery.objectives import Layerwise
    from overrep.recovery.options import TrainingOptions
    from tiny import LinearModule

    clock, cost = [0.0], {"mse": 1.0, "normed": 4.0}
    objective = Layerwise([LinearModule()], [[]], None, options=LossOptions(loss="mse>normed", loss_switch=0.75), total_steps=100)
    objective.activations = []  # no annealed activation: the loss's phases alone
    seen = []

    def step(self):
        seen.append((self.step, self.objective.current()))
        clock[0] += cost[self.objective.current()]
        self.objective.after_optimizer_step(self.step)
        return 0.0, torch.tensor(0.0)

    monkeypatch.setattr(trainer_mod.Trainer, "_step", step)
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: clock[0])
    t = trainer_mod.Trainer(objective, 64, TrainingOptions(batch_size=8, lr=1e-3), 100, tmp_path / "ckpt", progress=False)
    assert t.stretches() == [(37, 0.75), (87, 0.25)]
    costs = t.measure()
    assert {phase for _, phase in seen} == {"mse", "normed"}
    assert costs.step == costs.anneal == 1.0 and costs.later == 4.0 and costs.later_share == 0.25
    assert not costs.one_pass  # (a layer-wise later phase may see its rows again)
    assert costs.train_seconds(100) == pytest.approx(75 * 1.0 + 25 * 4.0)
    assert objective.current() == "mse"  # back at the start
    assert len(seen) == 2 * (1 + 3)  # an untimed step and three timed ones a stretch
    # a short budget's share: fewer timed steps in a stretch whose first step says they cost more, never none
    seen.clear()
    assert t.measure(within=6.0).later == 4.0 and len(seen) == (1 + 3) + (1 + 1)  # 3 s a stretch: 3 x 1 s, 1 x 4 s
    seen.clear()
    assert t.measure(within=0.01).step == 1.0 and len(seen) == 2 * (1 + 1)
    # what a cheap stretch leaves goes to the next: of 12 s, the first takes 3 of its 6, the
    # dearer later phase gets the other 9 (two 4-s steps; an equal half each would give it one)
    seen.clear()
    assert t.measure(within=12.0).later == 4.0 and len(seen) == (1 + 3) + (1 + 2)


def test_the_probe_prices_a_stretch_at_its_fastest_timed_step(tmp_path, monkeypatch, caplog):
    """What disturbs a timed step only slows it: a stretch whose timed steps are still warming
    up (3, 2, then 1.5 s) or hit by a spike (1, 4, 1 s) is priced at its fastest, the price the
    run's own steps then pay; the line it logs is the one scripts/probe_accuracy.py reads."""
    import importlib.util
    import logging

    import torch

    from overrep.recovery import trainer as trainer_mod
    from overrep.recovery.objectives import Layerwise
    from overrep.recovery.options import TrainingOptions
    from tiny import LinearModule

    clock, durations = [0.0], []
    objective = Layerwise([LinearModule()], [[]], None, total_steps=100)
    objective.activations = []

    def step(self):
        clock[0] += durations.pop(0)
        return 0.0, torch.tensor(0.0)

    monkeypatch.setattr(trainer_mod.Trainer, "_step", step)
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: clock[0])
    t = trainer_mod.Trainer(objective, 64, TrainingOptions(batch_size=8, lr=1e-3), 100, tmp_path / "ckpt", progress=False)
    assert len(t.stretches()) == 1
    durations[:] = [9.0, 3.0, 2.0, 1.5]  # the untimed first step, then three timed ones
    assert t.measure().step == 1.5 and durations == []
    durations[:] = [9.0, 1.0, 4.0, 1.0]
    with caplog.at_level(logging.INFO, logger="overrep.recovery.probe"):
        assert t.measure().step == 1.0 and durations == []
    script = Path(__file__).resolve().parents[1] / "scripts" / "probe_accuracy.py"
    spec = importlib.util.spec_from_file_location("probe_accuracy", script)
    accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accuracy)
    log = tmp_path / "run.log"
    log.write_text(caplog.text)
    assert accuracy.probe_stretches(log) == [(9.0, [1.0, 4.0, 1.0])]


def test_a_next_token_phase_gets_rows_of_its_own():
    """The ``ce`` phase of ``normed>ce`` memorises rows it sees twice (docs/losses.md): a budget
    caches enough rows for its steps to see each once, and the phase starts a fresh pass."""
    from overrep.recovery.losses import fresh_share

    assert fresh_share("normed", 0.8) == 0.0 and fresh_share("ce", 0.8) == 1.0
    assert fresh_share("normed>ce", 0.8) == pytest.approx(0.2)
    layerwise = StepCosts(1.0, 0.0, 0.0, rows_per_step=8, max_rows=10_000, passes=6)
    assert layerwise.rows(200) == 267  # 200 steps x 8 rows / 6 passes
    mixed = StepCosts(1.0, 0.0, 0.0, rows_per_step=8, max_rows=10_000, passes=6, fresh_share=0.5)
    assert mixed.rows(200) == 800  # the last 100 steps x 8 rows, each once


def test_a_costlier_later_phase_shortens_the_run_to_its_deadline(assets, tmp_path, monkeypatch):
    """``normed>ce``: the probe prices every step alike and the first re-fits time the cheap
    layer-wise steps, but each next-token step costs 0.35 s or more. After three timed steps of
    that phase, and every three after, the step count is re-fitted to what the deadline leaves
    at their cost, so the schedules end inside the budget; the switch stays where the phase
    began, and the first phase is never re-fitted this way.

    Every step takes at least the probe's 0.05 s, so that the plan does not follow how fast the
    machine runs the tiny model: at its real 0.013 s a layer-wise step, the re-fits had fitted
    621 steps, the last 100 (one pass) of them next-token ones priced at 0.013 s, and left that
    phase 5 steps, on a slower machine fewer than the 4 its first re-fit waits for."""
    no_deadline_stop(monkeypatch)
    from overrep.recovery.trainer import Trainer

    real_step = Trainer._step

    def step(self):
        t0, floor = time.perf_counter(), 0.35 if self.objective.phase() == "ce" else 0.05
        out = real_step(self)
        time.sleep(max(0.0, floor - (time.perf_counter() - t0)))
        return out

    monkeypatch.setattr(Trainer, "_step", step)
    monkeypatch.setattr(Trainer, "measure", lambda self, steps=2, within=None: StepCosts(0.05, 0.0, 0.0, anneal=0.05))
    out = tmp_path / "late"
    m = Pipeline(tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                          recovery__time_budget="10s", recovery__warm_start="none", recovery__loss="normed>ce",
                          recovery__loss_switch=0.5,
                          data__train_sequences=400),  # rows for a phase longer than a pass of the default 24
                 progress=False).run()
    refit = m["time_budget"]["refit"]
    at = refit["at"]
    late = [a for a in at if "phase" in a]
    assert late and {a["phase"] for a in late} == {"ce"} and min(a["seconds_per_step"] for a in late) >= 0.3
    assert late[0]["steps"] < at[at.index(late[0]) - 1]["steps"] and m["train_steps"] == refit["steps_after"]
    assert [a["step"] for a in late] == list(range(late[0]["step"], late[-1]["step"] + 1, 3))  # every 3 steps
    assert all(0 < a["seconds_planned"] <= 0.99 * a["seconds_left"] + 0.01 for a in late)  # the phase's own slack
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in log]
    first_ce = phases.index("ce")
    assert set(phases[first_ce:]) == {"ce"} and late[0]["step"] == first_ce + 4  # its first step is not timed
    assert len(log) == m["train_steps"] and log[-1]["alpha"] == 0.0 and log[-1]["lr"] < log[first_ce]["lr"]


def test_a_refit_keeps_the_probes_price_for_a_later_phase_it_timed():
    """Layer-wise steps faster than the probe said do not make the ``ce`` steps faster: a later
    phase the probe timed on its own steps keeps that price at a re-fit; one it did not time (it
    was priced as the first phase) is scaled with the first."""
    costs = StepCosts(step=2.0, validation=0.0, checkpoint=0.0, anneal=2.0, later=4.0, later_share=0.2)
    timed = replace(costs, later_timed=True)

    def left(c):
        return Deadline(at=100.0, costs=c, eval_every=0, checkpoint_every=1000).steps_left(1.0, now=0.0)

    assert left(timed) == fit_steps(0.99 * 100, replace(timed, step=1.0, anneal=1.0), 0, 1000) == 62  # 50 x 1 s + 12 x 4 s
    assert left(costs) == fit_steps(0.99 * 100, replace(costs, step=1.0, anneal=1.0, later=2.0), 0, 1000) == 82  # 66 + 16 x 2
    assert phase_costs([(0, 0.8, 2.0), (80, 0.2, 4.0)], 80, (0.2, False), 0.0, 0.0).later_timed
    assert not phase_costs([(0, 1.0, 2.0)], 80, (0.2, False), 0.0, 0.0).later_timed  # the probe never reached it


def test_the_later_phase_prices_the_rows_it_reads_past_the_cache():
    """A re-fit that lengthens a one-pass ``ce`` phase past the rows the first plan cached
    reads the data's other rows live: their steps cost a row's features each on top."""
    costs = StepCosts(step=1.0, validation=0.0, checkpoint=0.0, later=4.0, later_share=0.2, one_pass=True,
                      rows_per_step=8, max_rows=160, row=0.5)
    assert costs.later_steps(100) == 20 and costs.live_steps(100) == 0  # (no live rows priced: the first plan)
    live = replace(costs, live_row=0.5, cached=80)
    assert live.live_steps(100) == 10  # the phase's last 10 steps read rows 80-159
    assert live.train_seconds(100) == 80 * 1.0 + 20 * 4.0 + 10 * 8 * 0.5
    assert live.train_seconds(100, done=95) == 5 * 4.0 + 5 * 8 * 0.5  # they are the phase's last ones
    deadline = Deadline(at=100.0, costs=costs, eval_every=0, checkpoint_every=1000)
    cached_only = deadline.steps_left(1.0, now=40.0, done=40, rows=80)
    with_live = deadline.steps_left(1.0, now=40.0, done=40, rows=160, cached=80)
    free = deadline.steps_left(1.0, now=40.0, done=40, rows=160)
    assert cached_only > with_live and free > with_live  # the live rows' features are priced
    # ... at their inputs' share of a row's cost (the blocks before the gap: Teacher.live_share)
    share = Deadline(at=100.0, costs=replace(costs, live_share=0.25), eval_every=0, checkpoint_every=1000)
    assert with_live < share.steps_left(1.0, now=40.0, done=40, rows=160, cached=80) <= free


def test_a_next_token_phase_reads_past_the_cached_rows_when_a_refit_lengthens_it(assets, tmp_path, monkeypatch):
    """``normed>ce`` under a budget: the probe prices a step too high, so the first plan caches
    few rows; its re-fits then add steps, and the ``ce`` phase goes on past the cached rows to
    the data's others (their features computed as they are read, each row once) instead of
    leaving the steps to the layer-wise phase."""
    no_deadline_stop(monkeypatch)
    import overrep.recovery.trainer as trainer_module

    monkeypatch.setattr(trainer_module.Trainer, "measure", lambda self, steps=2, within=None: StepCosts(5.0, 0.0, 0.0, anneal=5.0))
    monkeypatch.setattr(Deadline, "steps_left", lambda self, seconds, now, **k: 100)  # the re-fit: 100 steps more
    monkeypatch.setattr(trainer_module, "refit_late_phase", lambda trainer, phase, began, seconds: began)
    out = tmp_path / "live"
    m = Pipeline(tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                          recovery__time_budget="60s", recovery__warm_start="none", recovery__loss="normed>ce",
                          recovery__budget_passes=1, data__train_sequences=64), progress=False).run()
    tb = m["time_budget"]
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    ce = [r for r in log if r.get("phase") == "ce"]
    assert tb["rows"] == 4 * tb["refit"]["steps_before"] < 64 and tb["steps"] == m["train_steps"] > 100
    # the phase's share (a fifth) is more than the cached rows hold: one pass over all 64 rows
    assert len(ce) == 16 and tb["live_rows"] == 64 - tb["rows"] and tb["live_seconds"] > 0
    assert m["merge_max_rel_diff"] <= 1e-5 and log[-1]["alpha"] == 0.0


def _two_phase_trainer(tmp_path, monkeypatch, clock, checkpoint_every=1000):
    """A trainer of ``mse>normed`` (the switch at step 50 of 100) on a clock the test sets."""
    from overrep.recovery import trainer as trainer_mod
    from overrep.recovery.losses import LossOptions
    from overrep.recovery.objectives import Layerwise
    from overrep.recovery.options import TrainingOptions
    from tiny import LinearModule

    objective = Layerwise([LinearModule()], [[]], None, options=LossOptions(loss="mse>normed", loss_switch=0.5),
                          total_steps=100)
    objective.activations = []
    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: clock[0])
    cfg = TrainingOptions(batch_size=8, lr=1e-3, checkpoint_every=checkpoint_every)
    return trainer_mod.Trainer(objective, 64, cfg, 100, tmp_path / "ckpt", progress=False)


def test_the_probe_prices_a_validation_in_each_phase(tmp_path, monkeypatch):
    """A later phase validates its own loss (``ce`` through the frozen tail and the head): the
    probe times the loss part of a validation in each phase it timed, the perplexity part once,
    and the run's last validation is priced at the later phase's (five-minute two-phase cells
    had mostly validated at the end in 1.1-1.5x what a first-phase one cost, one 7 s past its budget)."""
    import torch

    from overrep.recovery.objectives import Layerwise

    clock = [0.0]
    t = _two_phase_trainer(tmp_path, monkeypatch, clock)
    monkeypatch.setattr(type(t), "_step", lambda self: (self.objective.after_optimizer_step(self.step),
                                                        clock.__setitem__(0, clock[0] + 1.0), (0.0, torch.tensor(0.0)))[2])
    seconds = {"mse": 0.25, "normed": 1.0}  # a validation's loss on a quarter of the rows
    monkeypatch.setattr(Layerwise, "validation_loss",
                        lambda self: clock.__setitem__(0, clock[0] + seconds[self.current()]))
    costs = t.measure()
    # (no perplexity rows here, so nothing to scale up)
    assert costs.validation == 0.25 and costs.later_validation == 1.0 and costs.last_validation == 1.0
    assert costs.validations_seconds(3) == 2 * 0.25 + 1.0 and costs.validations_seconds(0) == 0.0
    assert costs.run_seconds(100, 50, 1000) == 50 * 1.0 + 50 * 1.0 + 0.25 + 1.0 + costs.checkpoint
    assert t.objective.current() == "mse" and t.step == 0  # back at the start
    # a later phase the probe never reached is priced as the first, its validation too
    assert phase_costs([(0, 1.0, 2.0)], 80, (0.2, False), 1.0, 0.0, 4.0).last_validation == 1.0


def test_the_stop_at_the_deadline_reserves_the_next_steps_checkpoint_and_its_phases_validation(tmp_path, monkeypatch):
    """Before the next step the run keeps room for what follows it: the validation of the step
    it would stop at, priced in that step's phase, and the checkpoint that step writes (the
    last step's, for one); a validation the run times replaces the price of its own phase."""
    clock = [0.0]
    t = _two_phase_trainer(tmp_path, monkeypatch, clock, checkpoint_every=24)
    costs = StepCosts(1.0, validation=2.0, checkpoint=3.0, later=1.0, later_share=0.5, later_validation=5.0)
    t.deadline, t.eval_every = Deadline(at=100.0, costs=costs, eval_every=100, checkpoint_every=24), 100
    switch = t.objective.phase_starts()[0]
    steps = [1.0, 1.0, 1.0]

    def stops(step: int, left: float) -> bool:
        t.step, clock[0] = step, 100.0 - left
        return t.past_deadline(steps)

    assert not stops(10, 3.5) and stops(10, 2.5)  # a step and a first-phase validation: 3 s
    assert not stops(switch + 1, 6.5) and stops(switch + 1, 5.5)  # a later-phase validation: 6 s
    assert stops(switch - 1, 5.5)  # the next step is the later phase's first
    assert not stops(23, 6.5) and stops(23, 5.5) and not stops(25, 3.5)  # step 24 writes a checkpoint
    assert t.stopped_at is not None
    # the validation the run times prices its own phase from then on
    from overrep.recovery.objectives import Layerwise

    monkeypatch.setattr(Layerwise, "validation_loss", lambda self: clock.__setitem__(0, clock[0] + 7.0))
    t.step = switch + 2
    t.objective.after_optimizer_step(t.step - 1)
    assert t.validate()["val_seconds"] == 7.0
    assert t.deadline.costs.later_validation == 7.0 and t.deadline.costs.validation == 2.0
    assert t.validation_price(switch + 3) == 7.0 and t.validation_price(10) == 2.0
