"""Paired comparison of finished runs, per split and per domain (validation rows to choose,
test rows to report).

A run's report pairs its recovered model with the dense one; two recovered models (two
methods, two budgets, two seeds) are compared here. The exported models of the given run
folders are scored on the same rows their runs were evaluated on (validation, test per
domain, unseen corpora; the first run's configuration rebuilds them, and every run must share
its model, mask and evaluation sections and its validation and test rows, by fingerprint: the
training rows may differ), and each is set against the first run with a paired
bootstrap over documents (:func:`overrep.eval.intervals.paired_ratio`): a ratio whose interval
excludes 1 is a difference these rows can tell. The dense model's scores come from the cache
the runs filled.

Pooled perplexity over several domains is the geometric mean of the per-domain ratios, so a
method that overtakes the dense model on one domain (a next-token objective can learn a
corpus's own format) can lead the pooled figure while losing the others; the per-domain rows
show it.

Run:  .venv/bin/python scripts/paired_runs.py runs/overrep runs/overrep-lm runs/lora-iso \
          --markdown paired.md --json paired.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="finished run folders; the first is the reference")
    ap.add_argument("--markdown", help="write the table here as well")
    ap.add_argument("--json", help="every figure as JSON")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from transformers import AutoModelForCausalLM

    from overrep.app.config import RunConfig
    from overrep.app.pipeline import Pipeline
    from overrep.errors import OverRepError
    from overrep.eval.figures import model_figures, score
    from overrep.eval.heldout import row_strata
    from overrep.eval.intervals import Scored, format_interval, paired_ratio, perplexity_interval

    runs = [Path(r) for r in args.runs]
    for run in runs:
        if not (run / "metrics.json").is_file() or not (run / "model" / "config.json").is_file():
            raise SystemExit(f"error: {run} is not a finished run (no metrics.json or model/)")
    configs = [RunConfig.load(run / "config.yaml") for run in runs]
    # the rows scored: the validation and test rows' fingerprints (a run's training rows, e.g.
    # data.train_sequences, may differ: that is a setting to compare), the unseen corpora (eval)
    rows = [{k: json.loads((run / "metrics.json").read_text()).get("data", {}).get(k)
             for k in ("validation_fingerprint", "test_fingerprint")} for run in runs]
    for run, cfg, mine in zip(runs[1:], configs[1:], rows[1:]):
        for section in ("model", "prune", "eval"):
            if getattr(cfg, section) != getattr(configs[0], section):
                raise SystemExit(f"error: {run} differs from {runs[0]} in its '{section}' section: "
                                 "its rows are not the same")
        if mine != rows[0] or None in mine.values():
            raise SystemExit(f"error: {run} was scored on other validation or test rows than {runs[0]} (the "
                             "'data' section's fingerprints differ, or a metrics.json predates them)")
    with tempfile.TemporaryDirectory() as scratch:
        cfg = RunConfig.load(runs[0] / "config.yaml", {"output": scratch})
        p = Pipeline(cfg, progress=False)
        p.load(create_output=False)
    # the dense scores as the runs cached them; the runs' models on perplexity only (the
    # generation check is in each run's report)
    precisions = {json.loads((run / "metrics.json").read_text()).get("eval_precision", "fp32") for run in runs}
    if len(precisions) > 1:
        raise SystemExit(f"error: the runs were scored in different precisions ({', '.join(sorted(precisions))})")
    precision = precisions.pop()  # the runs' own scoring precision
    _, dense_scores = model_figures(p.dense, p.tokenizer, p.eval_data, tag="dense", source=p.model_info["source"],
                                    mask=False, root=p.cache_root, precision=precision)
    data = replace(p.eval_data, lambada=0)
    _, names = row_strata(data.components, "test_rows", data.test.shape[0])
    _, val_names = row_strata(data.components, "validation_rows", data.validation.shape[0])

    def splits(scores: dict) -> dict[str, Scored]:
        test, validation = Scored.from_state(scores["test"]), Scored.from_state(scores["validation"])
        out = {"validation": validation}
        out.update({f"validation: {n}": validation.select(i) for i, n in enumerate(val_names)})
        out["test"] = test
        out.update({f"test: {n}": test.select(i) for i, n in enumerate(names)})
        out.update({f"unseen: {n}": Scored.from_state(s) for n, s in scores["unseen"].items()})
        return out

    dense = splits(dense_scores)
    scored = {}
    for run in runs:
        model = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32).eval()
        scored[run] = splits(score(model, p.tokenizer, data, desc=run.name, precision=precision))
        del model
        print(f"scored {run}", file=sys.stderr, flush=True)

    ref = runs[0]
    figures: dict = {"runs": [str(r) for r in runs], "rows": {}}
    header = ["| rows | dense | " + " | ".join(f"{r.name}: perplexity [95%] | {r.name} / {ref.name} [paired 95%]"
                                              if r != ref else f"{r.name}: perplexity [95%]" for r in runs) + " |",
              "|---|---:|" + "---:|" * (2 * len(runs) - 1)]
    lines = [f"Paired against `{ref}` on the same documents (`scripts/paired_runs.py "
             + " ".join(args.runs) + "`).", "", *header]
    for name in dense:
        row = {"dense": perplexity_interval(dense[name])}
        cells = [format_interval(row["dense"])]
        for run in runs:
            try:
                fig = {"perplexity": perplexity_interval(scored[run][name]),
                       "vs_dense": paired_ratio(scored[run][name], dense[name])["ratio"]}
                if run != ref:
                    fig["vs_reference"] = paired_ratio(scored[run][name], scored[ref][name])["ratio"]
            except OverRepError as e:
                raise SystemExit(f"error: {run}, {name}: {e}") from None
            row[str(run)] = fig
            cells.append(format_interval(fig["perplexity"]))
            if run != ref:
                cells.append(format_interval(fig["vs_reference"], digits=3))
        figures["rows"][name] = row
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    sys.exit(main())
