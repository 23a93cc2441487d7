"""recovery.run_limit: a whole run's wall-clock, which cuts the time budget to what it leaves
after the final evaluation (predicted from the dense model's)."""

from __future__ import annotations

import pytest

from overrep.app.budgeting import RUN_LIMIT_RESERVE, cut_to_run_limit, measured_pace, per_token_macs, predict_final_eval
from overrep.app.pipeline import Pipeline
from overrep.errors import OverRepError

from tiny import tiny_cfg


def test_a_budget_with_room_is_kept_whole():
    seconds, record = cut_to_run_limit(720, 1200, elapsed=200, final_eval=150)
    assert seconds == 720 and "cut_to" not in record
    assert record["predicted_final_eval_seconds"] == 150 and record["budget_asked"] == 720


def test_a_budget_without_room_is_cut_to_what_the_limit_leaves():
    # a 2-core AVX2 CPU's default run: 539 s before recovery, the final evaluation ~285 s
    seconds, record = cut_to_run_limit(720, 1200, elapsed=539, final_eval=285)
    assert seconds == pytest.approx(1200 * (1 - RUN_LIMIT_RESERVE) - 539 - 285)
    assert record["cut_to"] == pytest.approx(seconds, abs=0.01)


def test_a_limit_spent_before_recovery_is_one_clear_error():
    with pytest.raises(OverRepError, match=r"recovery.run_limit 600 s is spent before recovery starts \(700 s gone"):
        cut_to_run_limit(720, 600, elapsed=700, final_eval=100)


def test_an_unknown_final_evaluation_cuts_nothing():
    seconds, record = cut_to_run_limit(720, 1200, elapsed=900, final_eval=None)
    assert seconds == 720 and record["predicted_final_eval_seconds"] is None


def test_a_run_under_a_limit_records_it_and_predicts_its_final_evaluation(assets, tmp_path):
    """The figures' cost is kept (a cached entry is read back at what computing it cost), the
    prediction is the dense model's cost scaled by the parameters kept, and a limit with room
    leaves the budget whole."""
    # (budget_min_steps: a loaded machine may fit fewer than the floor's 10 steps in 3 s)
    kw = dict(recovery__steps=None, recovery__time_budget="3s", recovery__run_limit="1h", recovery__warm_start="none",
              recovery__budget_min_steps=1)
    first = Pipeline(tiny_cfg(assets, tmp_path / "a", **kw), progress=False)
    m = first.run()
    limit = m["time_budget"]["run_limit"]
    assert m["time_budget"]["seconds"] == 3 and "cut_to" not in limit and limit["seconds"] == 3600
    assert 0 < limit["elapsed_before_recovery"] < 3600
    assert limit["predicted_final_eval_seconds"] == pytest.approx(predict_final_eval(first), abs=0.01)
    assert 0 < first.eval_rows_cost["dense"] < first.eval_cost["dense"]
    # the unrecovered model's rows, scored in this run, timed the machine now and scaled the prediction
    assert limit["final_eval_pace"] == pytest.approx(measured_pace(first), abs=1e-3) and limit["final_eval_pace"] > 0
    # a second run reads the dense figures from the cache, with what computing them cost then
    again = Pipeline(tiny_cfg(assets, tmp_path / "b", **kw), progress=False)
    m_again = again.run()
    computed = first.dense_scores["seconds"]
    assert again.dense_scores["seconds"] == computed > 0
    assert again.eval_cost["dense"] >= computed  # the cached scoring's cost, plus what ran anew (latency)
    # ... and the unrecovered figures too: nothing of this run timed the machine, nothing scales
    assert "pruned" not in again.eval_rows_timed and "final_eval_pace" not in m_again["time_budget"]["run_limit"]


def test_a_cut_budget_is_the_budget_the_run_trains_to_and_reports(assets, tmp_path, monkeypatch):
    """Where the limit leaves less than the budget, the probe, the deadline and the report all
    use the cut budget (the arithmetic is the unit tests' above; here the wiring)."""
    import overrep.app.budgeting as budgeting

    seen = {}

    def cut(budget, limit, elapsed, final_eval):
        seen.update(budget=budget, limit=limit, elapsed=elapsed, final=final_eval)
        return 2.0, {"seconds": limit, "elapsed_before_recovery": elapsed, "predicted_final_eval_seconds": final_eval,
                     "budget_asked": budget, "cut_to": 2.0}

    monkeypatch.setattr(budgeting, "cut_to_run_limit", cut)
    monkeypatch.setattr(budgeting, "MIN_BUDGET_STEPS", 1)
    out = tmp_path / "cut"
    m = Pipeline(tiny_cfg(assets, out, recovery__steps=None, recovery__time_budget="1h", recovery__run_limit="20m",
                          recovery__warm_start="none"), progress=False).run()
    assert seen["budget"] == 3600 and seen["limit"] == 1200 and seen["elapsed"] > 0 and seen["final"] > 0
    tb = m["time_budget"]
    assert tb["seconds"] == 2.0 and tb["run_limit"]["cut_to"] == 2.0
    assert tb["used_seconds"] <= 2.0 * 1.5  # trained to the cut budget's deadline, not the hour asked for
    assert "cut from 3,600 s so that the whole run ends within `recovery.run_limit` (1,200 s)" in (
        out / "report.md").read_text()


def test_the_final_evaluation_is_predicted_from_the_dense_one_by_macs():
    """The perplexity rows scale by the compact model's blocks after the shared prefix and its
    head where a model of the run kept a set's states, by the whole compact model where none
    did; the rest (generation check, latency) by the whole compact model; and all of it by the
    pace the unrecovered model's own rows measured in this run."""
    from types import SimpleNamespace

    import torch

    from overrep.eval.figures import EvalData
    from overrep.model.surgery import plan_pruning, prune
    from tiny import tiny_model

    dense = tiny_model("llama")
    pruned = prune(tiny_model("llama"), plan_pruning(6, [3, 4], blocks=1))
    rows, unseen = torch.zeros(4, 32, dtype=torch.long), torch.ones(4, 32, dtype=torch.long)
    kept = {"test": True, "unseen": True}  # whether a model was scored whole on those rows in this run
    p = SimpleNamespace(eval_cost={"dense": 100.0}, eval_rows_cost={"dense": 80.0}, eval_rows_timed={}, dense=dense,
                        pruned=pruned, cfg=SimpleNamespace(data=SimpleNamespace(seq_len=32)),
                        eval_data=EvalData(rows, rows[:, 0], rows, rows[:, 0], unseen={"sciq": (unseen, rows[:, 0])}),
                        shared_prefix=SimpleNamespace(start=2, shares=lambda m: True,
                                                      holds=lambda ids: kept["unseen" if ids is unseen else "test"]))
    whole = per_token_macs(dense, 32)
    tail, compact = per_token_macs(pruned, 32, 2) / whole, per_token_macs(pruned, 32) / whole
    assert 0 < tail < compact < 1
    assert predict_final_eval(p) == pytest.approx(80 * tail + 20 * compact)
    kept.update(test=False, unseen=False)  # the dense figures read back (a cache, the package's entry): all run whole
    assert predict_final_eval(p) == pytest.approx(100 * compact)
    kept["test"] = True  # the unrecovered model kept the test and validation rows' states, not the unseen corpus's
    assert predict_final_eval(p) == pytest.approx(80 * (2 / 3 * tail + 1 / 3 * compact) + 20 * compact)
    # the unrecovered model's rows timed in this run at 1.5x what the dense rows' cost per token
    # (80 s for 384 tokens) priced them at: the whole prediction scales by that pace
    assert measured_pace(p) is None
    p.eval_rows_timed["pruned"] = (1.5 * 80 / 384 * tail * 128, [(128, 2)])  # (seconds, [(tokens, from block 2)])
    assert measured_pace(p) == pytest.approx(1.5)
    p.eval_rows_timed["pruned"] = (1.5 * 80 / 384 * compact * 256, [(128, 0), (128, 0)])  # rows it ran whole
    assert measured_pace(p) == pytest.approx(1.5)
    assert predict_final_eval(p) == pytest.approx(1.5 * (80 * (2 / 3 * tail + 1 / 3 * compact) + 20 * compact))
    del p.eval_rows_timed["pruned"]
    p.eval_cost["dense"] = None  # cached before its cost was kept: unknown
    assert predict_final_eval(p) is None


def _limited(p, *, limit="20m", budget="12m", elapsed=100.0, dense_rows=90.0, final=60.0, steps=None):
    """A stand-in pipeline for :func:`unrecovered_rows`: the tiny llama pruned at 3-4, the
    dense rows' cost over 4 test, 4 validation and 4 unseen rows of 32 tokens."""
    import time
    from types import SimpleNamespace

    import torch

    from overrep.eval.figures import EvalData
    from overrep.model.surgery import plan_pruning, prune
    from tiny import tiny_model

    rows = torch.zeros(4, 32, dtype=torch.long)
    p.update(dense=tiny_model("llama"), pruned=prune(tiny_model("llama"), plan_pruning(6, [3, 4], blocks=1)),
             eval_rows_cost={"dense": dense_rows}, eval_cost={"dense": None if dense_rows is None else dense_rows + final},
             eval_rows_timed={}, eval_data=EvalData(rows, rows[:, 0], rows, rows[:, 0], unseen={"sciq": (rows, rows)}),
             shared_prefix=SimpleNamespace(start=3, holds=lambda ids: True, shares=lambda m: True),
             run_started=time.perf_counter() - elapsed,
             cfg=SimpleNamespace(data=SimpleNamespace(seq_len=32), recovery=SimpleNamespace(
                 resolved_run_limit=limit, time_budget=budget)), budgeted=steps is None)
    return SimpleNamespace(**p)


def test_auto_scores_the_unrecovered_test_rows_only_where_the_budget_stays_whole():
    """eval.unrecovered: auto -- test rows (predicted from the dense rows' cost per token, by the
    pruned model's MACs after the shared prefix) where the limit still leaves the whole budget,
    else validation only and why; no limit or no known cost: test, as before."""
    from overrep.app.budgeting import unrecovered_rows, unrecovered_test_cost

    p = _limited({})
    test, validation = unrecovered_test_cost(p)
    tail = per_token_macs(p.pruned, 32, 3) / per_token_macs(p.dense, 32)
    assert test == pytest.approx(30 * tail) and validation == pytest.approx(30 * tail)
    assert unrecovered_rows(p) == ("test", None)  # 1,164 s - 100 - the final evaluation - the rows: over 720 s
    room = 1200 * (1 - RUN_LIMIT_RESERVE) - predict_final_eval(p) - 720 - 2 * 30 * tail  # seconds elapsed it affords
    scored, why = unrecovered_rows(_limited({}, elapsed=room + 5))  # 5 s short with the test rows
    assert scored == "validation" and "would have cut the 720-s time budget" in why and "eval.unrecovered=test" in why
    assert unrecovered_rows(_limited({}, elapsed=room - 5))[0] == "test"
    assert unrecovered_rows(_limited({}, limit=None, elapsed=5000)) == ("test", None)
    assert unrecovered_rows(_limited({}, elapsed=5000, dense_rows=None)) == ("test", None)
    assert unrecovered_rows(_limited({}, elapsed=5000, steps=100)) == ("test", None)  # no budget for it to cut


def test_a_tight_limit_scores_the_unrecovered_model_on_validation_and_reads_its_test_rows_back_once_cached(
        assets, tmp_path, monkeypatch):
    """The wiring: a limit that would cut the budget leaves the unrecovered model's test figure
    out (metrics, report and the recovery check on validation say so); once a run has cached
    it, the same tight run reads it back."""
    import overrep.app.budgeting as budgeting

    monkeypatch.setattr(budgeting, "cut_to_run_limit", lambda budget, limit, elapsed, final_eval: (
        2.0, {"seconds": limit, "elapsed_before_recovery": elapsed, "predicted_final_eval_seconds": final_eval,
              "budget_asked": budget, "cut_to": 2.0}))
    monkeypatch.setattr(budgeting, "MIN_BUDGET_STEPS", 1)
    kw = dict(recovery__steps=None, recovery__time_budget="1h", recovery__run_limit="20m", recovery__warm_start="none",
              eval__latency=False)
    m = Pipeline(tiny_cfg(assets, tmp_path / "tight", **kw), progress=False).run()
    assert m["pruned_ppl"] is None and m["pruned_perplexity"]["test"] is None and "pruned_ppl_domains" not in m
    assert m["pruned_perplexity"]["validation"]["value"] > 0 and m["recovery_check"]["split"] == "validation"
    assert m["unrecovered_rows"]["scored"] == "validation" and "would have cut" in m["unrecovered_rows"]["why"]
    report = (tmp_path / "tight" / "report.md").read_text()
    assert "scored on the validation rows only: its test rows (about" in report
    whole = Pipeline(tiny_cfg(assets, tmp_path / "whole", eval__latency=False, eval__unrecovered="test"),
                     progress=False).run()
    again = Pipeline(tiny_cfg(assets, tmp_path / "again", **kw), progress=False).run()
    assert again["pruned_ppl"] == whole["pruned_ppl"] is not None and "unrecovered_rows" not in again
    assert again["pruned_perplexity"]["validation"] == m["pruned_perplexity"]["validation"]
