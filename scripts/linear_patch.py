"""LinearPatch's reference rows: scored exactly like a run's models, never exported.

LinearPatch (Chen et al., NeurIPS 2025) multiplies the residual stream at each gap by a d x d
patch ``P = H diag(d) H^T``; the stock architecture has no place for it, so it is evaluated
through a forward pre-hook on the pruned model (overrep/recovery/compensation.py) and this
script is its only way in: it is not a method of ``overrep run`` and nothing here writes a
model folder.

For the default run's model, mask, data and evaluation rows (or those a ``--config`` /
``--set`` gives) it loads the run's models, applies the patch and prints one JSON object:
test and validation perplexity with 95% intervals, the paired ratio to the dense model, the
generation check, and how the patch was made. Variants:

* ``--kd``: then LinearPatch's offline distillation: only the patch trains, one pass over the
  run's training rows, AdamW lr 1e-4 with a cosine to a tenth, KL on the dense model's top-50
  next tokens (renormalised there, as the reference does).
* ``--init stitched``: block 8 starts as the stitched copy the trained methods start from;
  the default keeps it as is (``retained``), which measured better for the patch on
  validation rows (docs/closed-forms.md).

Run:  .venv/bin/python scripts/linear_patch.py [--kd] [--output runs/linear-patch.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="YAML run configuration (default: the default run)")
    ap.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (repeatable)")
    ap.add_argument("--init", choices=["retained", "stitched"], default="retained")
    ap.add_argument("--kd", action="store_true", help="tune the patch by distillation (one pass)")
    ap.add_argument("--kd-lr", type=float, default=1e-4)
    ap.add_argument("--kd-topk", type=int, default=50)
    ap.add_argument("--output", default=None, help="also write the JSON here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from overrep.app.config import RunConfig
    from overrep.app.pipeline import Pipeline
    from overrep.core.precision import resolve_precision
    from overrep.eval.figures import model_figures
    from overrep.recovery.compensation import linear_patch, tune_patches

    cfg = RunConfig.load(args.config, ["eval.latency=false", f"recovery.block1_init={args.init}", *args.set])
    p = Pipeline(cfg, progress=True)
    p.prepare(evaluate=("dense",), recovery=False, create_output=False)  # dense figures: the run's cache
    t0 = time.perf_counter()
    hooks = linear_patch(p.pruned, p.dense, p.plan, p.train_ids[:cfg.recovery.closed_rows], trainable=args.kd)
    made = {"patches": len(hooks), "calibration_rows": cfg.recovery.closed_rows, "init": args.init,
            "fit_seconds": round(time.perf_counter() - t0, 1)}
    if args.kd:
        made["kd"] = tune_patches(p.pruned, hooks, p.dense, p.train_ids, k=args.kd_topk, lr=args.kd_lr,
                                  precision=p.rcfg.precision, progress=True)
        for h in hooks:
            h.matrix.requires_grad_(False)
    precision = resolve_precision(cfg.eval.precision, p.device)
    tag = "linearpatch_kd" if args.kd else "linearpatch"
    found, _ = model_figures(p.pruned, p.tokenizer, p.eval_data, tag=tag, source=p.model_info["source"],
                             mask=None, root=None, dense=p.dense_scores, progress=True, precision=precision)
    out = {"variant": tag, "exportable": False, "made": made, "eval_precision": precision,
           "train_precision": p.rcfg.precision, "removed_layers": list(p.plan.removed),
           "dense": p.metrics["dense_perplexity"]["test"], "perplexity": found[f"{tag}_perplexity"],
           "generation": found.get(f"{tag}_generation")}
    text = json.dumps(out, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
