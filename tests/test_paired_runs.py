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
    runs = []
    for method, steps in (("overrep", 3), ("plain", 3)):
        cfg = tiny_cfg(assets, tmp_path / method, recovery__method=method, recovery__steps=steps,
                       eval__latency=False, eval__generation=False)
        Pipeline(cfg, progress=False).run()
        runs.append(tmp_path / method)
    out = tmp_path / "paired.json"
    done = paired(runs[0], runs[1], "--json", out, "--markdown", tmp_path / "paired.md")
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {"validation", "test"} <= set(rows) and any(k.startswith("unseen: ") for k in rows)
    ref, other = str(runs[0]), str(runs[1])
    for name, row in rows.items():
        mine = row[ref]["perplexity"]
        assert mine["low"] <= mine["value"] <= mine["high"], name
        # the run's own report has the same figure: the same rows, scored the same way
        if name == "test":
            m = json.loads((runs[0] / "metrics.json").read_text())
            assert abs(mine["value"] - m["recovered_ppl"]) < 1e-3 * m["recovered_ppl"]
            assert abs(row["dense"]["value"] - m["dense_ppl"]) < 1e-3 * m["dense_ppl"]
        assert row[other]["vs_reference"]["low"] <= row[other]["vs_reference"]["value"] <= \
            row[other]["vs_reference"]["high"]
    # each model's ratio to dense is its perplexity over the dense one; the table names both runs
    assert all(abs(row[ref]["vs_dense"]["value"] - row[ref]["perplexity"]["value"] / row["dense"]["value"]) < 1e-6
               for row in rows.values())
    assert "plain / overrep" in (tmp_path / "paired.md").read_text()


def test_runs_on_other_rows_or_unfinished_are_refused(assets, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    Pipeline(tiny_cfg(assets, a, recovery__steps=2, eval__latency=False, eval__generation=False),
             progress=False).run()
    Pipeline(tiny_cfg(assets, b, recovery__steps=2, eval__latency=False, eval__generation=False,
                      data__heldout_sequences=6), progress=False).run()
    done = paired(a, b)
    assert done.returncode != 0 and "differs from" in done.stderr and "'data' section" in done.stderr
    done = paired(a, tmp_path / "missing")
    assert done.returncode != 0 and "is not a finished run" in done.stderr
