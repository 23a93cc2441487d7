"""Fixed-step sweep of the default run's settings, scored on validation (to choose) and test.

Each cell is ``NAME:STEPS[:field=value,...]``: ``overrep run`` on the embedded default with
``STEPS`` optimiser steps (no time budget, so the step count, not the machine, fixes the
training) and the given ``--set`` overrides; the unseen corpora, the generation check and the
latency are left out (``--unseen`` keeps the unseen corpora), so a cell costs its features, its
training and the validation and test perplexities. Each row has the pooled figures and the test
ratio to dense per domain. Every cell has its own cache folder under ``--work`` (cells may run side by
side, ``--parallel``), and one JSON line per finished cell goes to ``--out`` as it finishes.

Fixed steps make the sweep machine-independent, so it can run where steps are cheap (a GPU)
and still answer a question about a CPU's budget: give each cell the steps that the CPU's
measured costs (``metrics.json``'s ``time_budget``: seconds a step, seconds a row's
features) leave in its budget. docs/results-log.md ("Fixed-step sweep") lists the cells run.

Run:  .venv/bin/python scripts/step_sweep.py --out sweep.jsonl --work /tmp/sweep \\
          r768:930:recovery.eval_every=465 r1536:720:data.train_sequences=1536,recovery.eval_every=360
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

QUIET_EVAL = ["recovery.time_budget=null", "eval.domains=null", "eval.generation=false", "eval.latency=false"]


def parse_cell(text: str) -> tuple[str, int, list[str]]:
    name, steps, *rest = text.split(":", 2)
    return name, int(steps), [s for s in (rest[0].split(",") if rest else []) if s]


def run_cell(cell: tuple[str, int, list[str]], work: Path, out: Path, unseen: bool = False) -> dict:
    name, steps, sets = cell
    quiet = [s for s in QUIET_EVAL if not (unseen and s.startswith("eval.domains="))]
    folder = work / name
    cmd = [sys.executable, "-m", "overrep", "run", "--quiet", "--max-steps", str(steps), "--output",
           str(folder / "run"), "--overwrite"]
    for s in quiet + [f"cache.dir={folder / 'cache'}"] + sets:
        cmd += ["--set", s]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = {"name": name, "steps": steps, "set": sets, "rc": proc.returncode, "wall_s": round(time.time() - start, 1)}
    if proc.returncode == 0:
        m = json.loads((folder / "run" / "metrics.json").read_text())
        r = m["recovered_perplexity"]
        row.update({split: {k: r[split][k] for k in ("value", "low", "high")} for split in ("validation", "test")},
                   test_vs_dense=r["test_vs_dense"]["ratio"]["value"], train_steps=m["train_steps"],
                   warm_start=m.get("warm_start"), device=m["run"]["ranks"][0]["device"],
                   test_vs_dense_by_domain={d: round(v / m["dense_ppl_domains"][d], 4)
                                            for d, v in m["recovered_ppl_domains"].items() if d in m["dense_ppl_domains"]},
                   train_seconds=m.get("train_seconds"))
    else:
        row["error"] = proc.stderr.strip().splitlines()[-1:] or ["(no message)"]
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cells", nargs="+", help="NAME:STEPS[:field=value,...]")
    ap.add_argument("--out", required=True, help="JSON lines, one per finished cell (appended)")
    ap.add_argument("--work", required=True, help="folder for each cell's run and cache")
    ap.add_argument("--unseen", action="store_true", help="also score the unseen corpora (eval.domains)")
    ap.add_argument("--parallel", type=int, default=1, help="cells run side by side (a GPU has room for several)")
    a = ap.parse_args()
    cells = [parse_cell(c) for c in a.cells]
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    rows = [run_cell(cells[0], work, out, a.unseen)]  # alone: a fresh machine converts the embedded model once here
    with ThreadPoolExecutor(a.parallel) as pool:
        rows += list(pool.map(lambda c: run_cell(c, work, out, a.unseen), cells[1:]))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
