"""Perplexity of the training-free closed forms on the default run's model, mask and data.

Loads what ``overrep run`` would (model, cosine mask, training/validation/held-out rows),
then for each variant builds the pruned model, applies the closed form and measures
perplexity on the validation rows (for choosing) and, with ``--heldout``, on the held-out
rows (for reporting). One JSON line per variant on stdout.

Variants: ``none``, ``ls``, ``cos``, ``prunecomp``, ``patch`` (LinearPatch, evaluated through a
hook: not exportable), ``prunecomp+ls``; each takes ``:key=value`` options: ``init`` (stitched |
retained), ``tokens``, ``ridge``, ``balance`` (``tokens=balanced``: the sinks' share), ``rows``, ``steps``,
``lr``, ``sample`` (the calibration rows: the
first training rows, what the pipeline fits on, or with ``sample=K`` a draw of them from every
training row seeded by K), e.g. ``ls:init=retained:tokens=all:ridge=0``. Each line also counts the
calibration rows whose dense target carries an attention sink after the first token
(``late_sink_rows``; rows cut mid-sentence, where the removed blocks move the sink to token 1 or 2).

Run:  OMP_NUM_THREADS=1 .venv/bin/python scripts/closed_form_sweep.py none ls:tokens=all:ridge=0 --heldout
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--heldout", action="store_true", help="also the held-out rows (reporting only)")
    ap.add_argument("--no-val", action="store_true", help="skip the validation rows")
    ap.add_argument("--validation-rows", type=int, default=32)
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    from overrep.app.config import RunConfig
    from overrep.app.pipeline import Pipeline
    from overrep.model.perplexity import perplexity
    from overrep.model.surgery import contiguous_runs, prune
    from overrep.recovery.closed_form import FitOptions, fit_and_fold, gap_batches, sink_mask
    from overrep.recovery.compensation import linear_patch, prunecomp

    cfg = RunConfig.load(None, ["recovery.threads=1", "recovery.precision=fp32",
                                f"data.validation_sequences={args.validation_rows}", "output=runs/closed-sweep",
                                *args.set])
    p = Pipeline(cfg, progress=False)
    p.load(create_output=False)
    train = p.train_ids
    for spec in args.variants:
        name, *opts = spec.split(":")
        o = dict(kv.split("=", 1) for kv in opts)
        plan = copy.deepcopy(p.plan)
        if o.get("init", "stitched") == "retained":
            for g in plan.groups:
                g.stitch.clear()
        model = prune(copy.deepcopy(p.dense), plan).eval()
        fit = FitOptions(rows=int(o.get("rows", 64)), tokens=o.get("tokens", FitOptions.tokens),
                         ridge=float(o.get("ridge", FitOptions.ridge)), cos_steps=int(o.get("steps", 300)),
                         sink_balance=float(o.get("balance", FitOptions.sink_balance)),
                         cos_lr=float(o.get("lr", 1e-3)))
        rows = train
        if "sample" in o:
            rows = train[torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(int(o["sample"])))]
        rows = rows[:fit.rows]
        t0 = time.perf_counter()
        info: dict = {}
        if name.startswith("prunecomp"):
            info["prunecomp"] = prunecomp(model, p.dense, plan, rows, tokens=o.get("pctokens", "all"))
        if name.endswith("ls") or name.endswith("cos"):
            info["fit"] = fit_and_fold(model, p.dense, plan, rows, fit, kind="cosine" if name.endswith("cos")
                                       else "lstsq")
        if name == "patch":
            info["handles"] = len(linear_patch(model, p.dense, plan, rows, tokens=o.get("tokens", "all")))
        row = {"variant": spec, "fit_seconds_rough": round(time.perf_counter() - t0, 1),
               "removed": plan.removed, **{k: v for k, v in info.items() if k != "handles"}}
        if name != "none":
            late = 0
            with torch.no_grad():  # the dense targets X* at the end of the first removed run
                for _, _, x in gap_batches(model, p.dense, plan, contiguous_runs(plan.removed)[0], rows, 8):
                    late += int(sink_mask(x.pow(2).mean(-1).sqrt())[:, 1:].any(1).sum())
            row["late_sink_rows"] = late
        if not args.no_val:
            row["val_ppl"] = perplexity(model, p.val_ids, progress=False)
            row["val_rows"] = int(p.val_ids.shape[0])
        if args.heldout:
            row["heldout_ppl"] = perplexity(model, p.heldout_ids, progress=False)
            row["heldout_rows"] = int(p.heldout_ids.shape[0])
        print(json.dumps(row), flush=True)
        del model


if __name__ == "__main__":
    sys.exit(main())
