"""eval.dense_reference: the dense figures shipped with the package, checked on the machine
that reads them, and the default run's shipped entries kept current."""

from __future__ import annotations

import pytest
import torch

from overrep.app.pipeline import Pipeline
from overrep.core.precision import resolve_precision
from overrep.eval import reference

from tiny import tiny_cfg


@pytest.fixture
def shipped(assets, tmp_path, monkeypatch):
    """A package reference folder holding the tiny run's dense entry (its path)."""
    folder = tmp_path / "reference"
    folder.mkdir()
    monkeypatch.setattr(reference, "REFERENCE_DIR", folder)
    p = Pipeline(tiny_cfg(assets, tmp_path / "writer", eval__latency=False), progress=False)
    p.load(create_output=False)
    return reference.write(p.dense, p.tokenizer, p.eval_data, source=reference.shipped_source(p.model_info),
                           precision=resolve_precision("auto", "cpu"), machine="the writer", directory=folder)


def _run(assets, tmp_path, name: str, cache: str | None = None, **over):
    p = Pipeline(tiny_cfg(assets, tmp_path / name, eval__latency=False,
                          cache__dir=str(tmp_path / f"cache-{cache or name}"), **over), progress=False)
    return p, p.run()


def test_a_run_reads_the_shipped_dense_figures_after_checking_its_rows(assets, tmp_path, shipped, caplog):
    measured_p, measured = _run(assets, tmp_path, "measured", eval__dense_reference=False)
    assert measured["dense_reference"] is None
    caplog.set_level("INFO", logger="overrep.eval.reference")
    p, m = _run(assets, tmp_path, "read")
    ref = m["dense_reference"]
    assert ref["machine"] == "the writer" and ref["checked_rows"] == 4 and ref["gap_nats"] <= reference.TOLERANCE
    assert any("the package's, written on the writer" in r.getMessage() for r in caplog.records)
    assert m["dense_perplexity"] == measured["dense_perplexity"]  # the same figures as scoring every row here
    entry = torch.load(shipped, weights_only=True)  # the cost is this machine's: the entry's, times the checked rows'
    assert p.dense_scores["seconds"] == pytest.approx(entry["seconds"] * ref["speed_here"], rel=1e-5)  # (rounded in metrics)
    assert "The dense model's figures are the package's, written on the writer" in (tmp_path / "read" / "report.md").read_text()
    # the run's cache keeps what it read, with where it came from: a second run does not check again
    caplog.clear()
    _, again = _run(assets, tmp_path, "again", cache="read")
    assert again["dense_reference"] == ref and not any("rows checked" in r.getMessage() for r in caplog.records)


def test_an_entry_whose_rows_score_differently_here_is_set_aside(assets, tmp_path, shipped, caplog):
    entry = torch.load(shipped, weights_only=True)
    entry["reference"]["check"]["nll"][0] += 1.0  # another kernel, another library: a row off by 1/31 nats a token
    torch.save(entry, shipped)
    caplog.set_level("WARNING", logger="overrep.eval.reference")
    _, m = _run(assets, tmp_path, "set-aside")
    assert m["dense_reference"] is None
    assert any("score differently here" in r.getMessage() for r in caplog.records)
    shipped.write_bytes(b"torn")
    _, m = _run(assets, tmp_path, "torn")
    assert m["dense_reference"] is None and any("unreadable" in r.getMessage() for r in caplog.records)


def test_the_prediction_of_the_final_evaluation_knows_no_model_was_scored_whole(assets, tmp_path, shipped):
    """With the dense figures read, no hidden states of the test rows are kept: a later model
    runs them whole, and the whole-run limit predicts that cost."""
    from overrep.app.budgeting import row_sets

    for name, reads in (("read", True), ("measured", False)):
        p = Pipeline(tiny_cfg(assets, tmp_path / name, eval__latency=False, eval__dense_reference=reads,
                              cache__dir=str(tmp_path / f"cache-{name}")), progress=False)
        p.prepare(evaluate=("dense",), recovery=False, create_output=False)
        assert (p.metrics["dense_reference"] is not None) == reads
        assert p.shared_prefix.start > 0 and p.shared_prefix.holds(p.eval_data.test) != reads
        assert {start for _, start in row_sets(p, p.pruned, p.eval_data)} == {0 if reads else p.shared_prefix.start}


@pytest.mark.slow
def test_the_shipped_entries_are_the_default_runs_and_pass_their_check_here():
    """``make reference`` wrote them for today's default model, data and protocol: a first
    ``overrep run`` finds them by its cache key, and this machine's scores of the checked rows
    agree (in the precision it scores in)."""
    from overrep.app.config import RunConfig

    files = sorted(reference.REFERENCE_DIR.glob("dense-*.pt"))
    assert files, "no dense reference shipped: run `make reference`"
    p = Pipeline(RunConfig.load(), progress=False)
    p.load(create_output=False)
    assert reference.shipped_source(p.model_info) == "embedded"  # wherever this installation keeps the model
    names = {precision: reference.entry_name(p.dense, p.eval_data, "embedded", precision)
             for precision in ("fp32", "bf16")}
    assert {f.name for f in files} == set(names.values()), "stale: run `make reference`"
    here = resolve_precision(RunConfig().eval.precision, p.device)
    assert reference.read(names[here], p.dense, p.eval_data.test, here) is not None
