"""Held-out perplexity of the layer-wise losses: one process, many cells, one JSON line each.

    python scripts/loss_sweep.py OUT.jsonl CELL [CELL ...]
    CELL = criterion:ratio:method:loss[:steps[:seed[:seq_len:train_sequences[:field=value,...]]]]
    (the last part: extra recovery.* fields, e.g. loss_topk_rest=true)

Each cell is the pipeline's own stages (load, prune, recover, merge, held-out perplexity)
without export, latency or report, so a grid of them stays cheap. The default scale is the
compare grid's: 256 sequences of 128 tokens, batch 8, 32 steps (one epoch), lr = the
method's default. Cells already in OUT.jsonl are skipped (the sweep resumes).
"""

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from overrep.app.config import RunConfig
from overrep.app.pipeline import Pipeline


def run_cell(spec: str) -> dict:
    parts = spec.split(":")
    crit, ratio, method, loss = parts[:4]
    steps = int(parts[4]) if len(parts) > 4 else 32
    seed = int(parts[5]) if len(parts) > 5 else 0
    seq_len = int(parts[6]) if len(parts) > 6 else 128
    train_seqs = int(parts[7]) if len(parts) > 7 else 256
    extra = dict(kv.split("=", 1) for kv in parts[8].split(",")) if len(parts) > 8 and parts[8] else {}
    out = Path(tempfile.mkdtemp()) / "run"
    cfg = RunConfig.load(overrides={
        "model": {"source": "embedded"},
        "prune": {"ratio": float(ratio), "criterion": crit},
        "recovery": {"method": method, "loss": loss, "steps": steps, "seed": seed, "batch_size": 8,
                     "eval_every": max(1, steps // 4), "checkpoint_every": 10 ** 6, **extra},
        "data": {"seq_len": seq_len, "train_sequences": train_seqs, "heldout_sequences": 48},
        "eval": {"latency": False},
        "output": str(out),
    })
    t0 = time.perf_counter()
    p = Pipeline(cfg, progress=False)
    p.prepare_output()
    with p.output_guard():  # the cell's folder is this pipeline's until the cell ends
        p.prepare(evaluate=("pruned",))
        p.recover()
        p.evaluate_model(p.pruned, "recovered")
    shutil.rmtree(out.parent, ignore_errors=True)
    return {"cell": spec, "criterion": crit, "ratio": float(ratio), "method": method, "loss": loss,
            "steps": steps, "seed": seed, "extra": extra, "seq_len": seq_len, "train_sequences": train_seqs,
            "removed": p.plan.removed, "pruned_ppl": p.metrics["pruned_ppl"],
            "recovered_ppl": p.metrics["recovered_ppl"], "train_seconds": p.metrics["train_seconds"],
            "val_ppl": [(h["step"], h.get("val_ppl")) for h in p.history if "val_ppl" in h],
            "final_val_loss": p.metrics.get("final_val_loss"), "seconds": time.perf_counter() - t0,
            "device": str(p.device)}


def main():
    path = Path(sys.argv[1])
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {r["cell"] for r in rows if "error" not in r}
    errors = 0
    for spec in sys.argv[2:]:
        if spec in done:
            continue
        try:
            row = run_cell(spec)
        except Exception as e:  # record and go on; stop when every cell fails
            import traceback
            traceback.print_exc()
            row = {"cell": spec, "error": f"{type(e).__name__}: {e}"}
            errors += 1
            if errors >= 3:
                raise SystemExit("three cells failed; stopping")
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("cell", "pruned_ppl", "recovered_ppl", "seconds", "error")}),
              flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
