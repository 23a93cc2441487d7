"""scripts/paired_runs.py: two finished runs paired per split and per domain."""

import json
import subprocess
import sys
from pathlib import Path

from tiny import tiny_cfg

from overrep.app.pipeline import Pipeline

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "paired_runs.py"


def paired(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_two_runs_are_paired_on_the_rows_they_were_evaluated_on(assets, tmp_path):
    # two training sources, so that the validation and test rows have domains
    lines = (assets / "corpus.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "first.jsonl").write_text("".join(lines[::2]))
    (tmp_path / "second.jsonl").write_text("".join(lines[1::2]))
    source = f"{tmp_path / 'first.jsonl'}+{tmp_path / 'second.jsonl'}"
    runs = []
    for method, steps, rows in (("overrep", 3, 24), ("plain", 3, 20)):  # other training rows, the same scored ones
        cfg = tiny_cfg(assets, tmp_path / method, recovery__method=method, recovery__steps=steps,
                       eval__latency=False, eval__generation=False, data__source=source,
                       data__heldout_sequences=8, data__validation_sequences=8, data__train_sequences=rows)
        Pipeline(cfg, progress=False).run()
        runs.append(tmp_path / method)
    out = tmp_path / "paired.json"
    done = paired(runs[0], runs[1], "--json", out, "--markdown", tmp_path / "paired.md")
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {"validation", "test"} <= set(rows) and any(k.startswith("unseen: ") for k in rows)
    assert sum(k.startswith("test: ") for k in rows) == 2 and sum(k.startswith("validation: ") for k in rows) == 2
    ref, other = str(runs[0]), str(runs[1])
    for name, row in rows.items():
        mine = row[ref]["perplexity"]
        assert mine["low"] <= mine["value"] <= mine["high"], name
        assert row[other]["vs_reference"]["low"] <= row[other]["vs_reference"]["value"] <= \
            row[other]["vs_reference"]["high"]
    # the runs' own reports have the same figures: the same rows and documents, scored the same
    # way, the same paired bootstrap against dense
    for run in runs:
        m = json.loads((run / "metrics.json").read_text())
        own, here = m["recovered_perplexity"], rows["test"][str(run)]
        for key in ("value", "low", "high"):
            assert abs(here["perplexity"][key] - own["test"][key]) < 1e-3 * own["test"][key]
            assert abs(here["vs_dense"][key] - own["test_vs_dense"]["ratio"][key]) < 1e-3
        for domain, fig in own["domains"].items():
            assert abs(rows[f"test: {domain}"][str(run)]["perplexity"]["value"] - fig["value"]) < 1e-3 * fig["value"]
    text = (tmp_path / "paired.md").read_text()
    assert "plain / overrep" in text
    # each run's own figures, from its metrics.json and training log
    facts = json.loads(out.read_text())["facts"]
    for run in runs:
        f, m = facts[str(run)], json.loads((run / "metrics.json").read_text())
        assert f["steps"] == m["train_steps"] == 3 and sum(f["phase_steps"].values()) == 3  # normed>ce: per phase
        assert set(f["phase_steps"]) == set(f["median_step_seconds"]) == {"normed", "ce"}
        assert min(f["median_step_seconds"].values()) > 0 and f["trainable_params"] == m["trainable_params"] > 0
        assert f["machine"] == m["environment"]["machine"] and f["unseen_vs_dense"]
    assert "| seconds used / budget | steps (per phase) |" in text and f"| {runs[1].name} | – / – | 3 (normed 2, ce 1) |" in text


def test_runs_on_other_rows_or_unfinished_are_refused(assets, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    Pipeline(tiny_cfg(assets, a, recovery__steps=2, eval__latency=False, eval__generation=False),
             progress=False).run()
    Pipeline(tiny_cfg(assets, b, recovery__steps=2, eval__latency=False, eval__generation=False,
                      data__heldout_sequences=6), progress=False).run()
    done = paired(a, b)
    assert done.returncode != 0 and "other validation or test rows" in done.stderr and "'data' section" in done.stderr
    done = paired(a, tmp_path / "missing")
    assert done.returncode != 0 and "is not a finished run" in done.stderr


def test_runs_on_other_data_are_paired_on_one_runs_rows_where_they_held_them_out(assets, tmp_path):
    """--rows-of: a run trained on one source of a mixture, holding out as many of its
    documents, is scored on the mixture run's rows; one that may have trained on some of them
    (another shuffle) is refused (the count of documents held out: tests/test_data.py)."""
    lines = (assets / "corpus.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "first.jsonl").write_text("".join(lines[::2]))
    (tmp_path / "second.jsonl").write_text("".join(lines[1::2]))
    first = str(tmp_path / "first.jsonl")
    runs = {}
    for name, source, held, seed in (("mix", f"{first}+{tmp_path / 'second.jsonl'}", 8, 42), ("one", first, 4, 42),
                                     ("reshuffled", first, 4, 7)):
        runs[name] = tmp_path / name
        Pipeline(tiny_cfg(assets, runs[name], recovery__steps=2, eval__latency=False, eval__generation=False,
                          data__source=source, data__heldout_sequences=held, data__validation_sequences=held,
                          data__train_sequences=16, data__seed=seed), progress=False).run()
    done = paired(runs["mix"], runs["one"])
    assert done.returncode != 0 and "--rows-of" in done.stderr
    out = tmp_path / "paired.json"
    done = paired(runs["mix"], runs["one"], "--rows-of", runs["mix"], "--json", out)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert sum(k.startswith("validation: ") for k in rows) == 2  # both domains of the mixture's rows
    mix_own = json.loads((runs["mix"] / "metrics.json").read_text())["recovered_perplexity"]["validation"]
    assert abs(rows["validation"][str(runs["mix"])]["perplexity"]["value"] - mix_own["value"]) < 1e-3 * mix_own["value"]
    ratio = rows["validation"][str(runs["one"])]["vs_reference"]
    assert ratio["low"] <= ratio["value"] <= ratio["high"]
    done = paired(runs["mix"], runs["reshuffled"], "--rows-of", runs["mix"])
    assert done.returncode != 0 and "another seed" in done.stderr
