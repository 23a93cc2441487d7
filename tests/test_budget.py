"""Time budgets: parsing, fitting a step count, and a budgeted run end to end."""

from __future__ import annotations

import json

import pytest

from overrep.app.pipeline import Pipeline
from overrep.errors import OverRepError
from overrep.recovery.budget import StepCosts, fit_steps, parse_duration

from tiny import tiny_cfg


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


def test_budgeted_run_fixes_its_steps_and_completes_its_schedules(assets, tmp_path):
    out = tmp_path / "budget"
    cfg = tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False, recovery__steps=None,
                   recovery__time_budget="20s")
    m = Pipeline(cfg, progress=False).run()
    tb = m["time_budget"]
    assert tb["seconds"] == 20 and tb["steps"] == m["train_steps"] >= 1
    assert tb["measured_seconds_per_step"] > 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == tb["steps"] and log[-1]["alpha"] == 0.0  # the schedule ran to its end
    assert m["merge_max_rel_diff"] <= 1e-5
