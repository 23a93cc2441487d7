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

Runs trained on other data (another mix of sources, whose own validation rows differ) are
compared on one run's rows with ``--rows-of RUN``: every model is scored on RUN's validation
and test rows and unseen corpora, and each run must have held out every document behind them
(:func:`overrep.data.splits.check_held_out_by`: a source split by shuffle needs at least
RUN's test + validation documents of it held out, e.g. ``data.heldout_sequences = 64 ×
sources`` against the default's 192 over three; the runs share RUN's ``eval`` section, so
each refused an unseen corpus's domain for its training text itself).

Below the paired table, a second one gives each run's own figures from its ``metrics.json``
and training log (:func:`run_facts`): the seconds it used of its budget, its steps and their
median cost per loss phase, its trainable parameters, its unseen corpora against dense and its
generation check; the JSON holds them under ``facts``.

Pooled perplexity over several domains is the geometric mean of the per-domain ratios, so a
method that overtakes the dense model on one domain (a next-token objective can learn a
corpus's own format) can lead the pooled figure while losing the others; the per-domain rows
show it.

Run:  .venv/bin/python scripts/paired_runs.py runs/overrep runs/overrep-lm runs/lora-iso \
          --markdown paired.md --json paired.json
      .venv/bin/python scripts/paired_runs.py runs/overrep runs/mix-no-ptb --rows-of runs/overrep
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
    ap.add_argument("--rows-of", metavar="RUN", help="score every model on RUN's rows (default: the first run's, "
                    "which every run must share); runs trained on other data must have held out RUN's documents")
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
    rows_of = Path(args.rows_of) if args.rows_of else runs[0]
    if not (rows_of / "metrics.json").is_file() or not (rows_of / "config.yaml").is_file():
        raise SystemExit(f"error: --rows-of {rows_of} is not a finished run (no metrics.json or config.yaml)")
    configs = [RunConfig.load(run / "config.yaml") for run in runs]
    base = RunConfig.load(rows_of / "config.yaml")
    # the rows scored: the validation and test rows' fingerprints (a run's training rows, e.g.
    # data.train_sequences, may differ: that is a setting to compare), the unseen corpora (eval)
    rows = [{k: json.loads((run / "metrics.json").read_text()).get("data", {}).get(k)
             for k in ("validation_fingerprint", "test_fingerprint")} for run in [rows_of, *runs]]
    for run, cfg, mine in zip(runs, configs, rows[1:]):
        for section in ("model", "prune", "eval"):
            if getattr(cfg, section) != getattr(base, section):
                raise SystemExit(f"error: {run} differs from {rows_of} in its '{section}' section: "
                                 "its rows are not the same")
        if not args.rows_of and (mine != rows[0] or None in mine.values()):
            raise SystemExit(f"error: {run} was scored on other validation or test rows than {rows_of} (the "
                             "'data' section's fingerprints differ, or a metrics.json predates them); compare "
                             "them on one run's rows with --rows-of")
    with tempfile.TemporaryDirectory() as scratch:
        cfg = RunConfig.load(rows_of / "config.yaml", {"output": scratch})
        p = Pipeline(cfg, progress=False)
        p.load(create_output=False)
    if {k: p.data_info.get(k) for k in rows[0]} != rows[0]:
        raise SystemExit(f"error: the rows rebuilt from {rows_of}/config.yaml are not the ones it recorded (another "
                         "tokenizer, data or package version)")
    if args.rows_of:
        try:
            for run, cfg in zip(runs, configs):
                held_out_by(p, cfg, str(run))
        except OverRepError as e:
            raise SystemExit(f"error: {e}") from None
    # the dense scores as the runs cached them; the runs' models on perplexity only (the
    # generation check is in each run's report)
    precisions = {json.loads((run / "metrics.json").read_text()).get("eval_precision", "fp32") for run in runs}
    if len(precisions) > 1:
        raise SystemExit(f"error: the runs were scored in different precisions ({', '.join(sorted(precisions))})")
    precision = precisions.pop()  # the runs' own scoring precision
    _, dense_scores, _ = model_figures(p.dense, p.tokenizer, p.eval_data, tag="dense", source=p.model_info["source"],
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
    figures["facts"] = {str(run): run_facts(run) for run in runs}
    lines += ["", *facts_table(runs, figures["facts"])]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def run_facts(run: Path) -> dict:
    """What a run spent and how its model generates, from its own ``metrics.json`` and training
    log: the columns a table of paired runs needs beside their perplexities."""
    import statistics

    m = json.loads((run / "metrics.json").read_text())
    budget, gen = m.get("time_budget") or {}, m.get("recovered_generation") or {}
    seconds: dict[str, list[float]] = {}
    log = run / "train_log.jsonl"
    for line in log.read_text().splitlines() if log.is_file() else []:
        rec = json.loads(line)
        if "step" in rec and "seconds" in rec:  # a training step's record (validations ride on it)
            seconds.setdefault(rec.get("phase") or "all", []).append(rec["seconds"])
    unseen = (m.get("recovered_perplexity") or {}).get("unseen_vs_dense") or {}
    return {"machine": (m.get("environment") or {}).get("machine"), "code": (m.get("environment") or {}).get("code"),
            "precision": m.get("precision"), "used_seconds": budget.get("used_seconds"),
            "budget_seconds": budget.get("seconds"), "steps": m.get("train_steps"),
            "phase_steps": {ph: len(v) for ph, v in seconds.items()},
            "median_step_seconds": {ph: statistics.median(v) for ph, v in seconds.items()},
            "trainable_params": m.get("trainable_params"),
            "unseen_vs_dense": {n: r.get("value") for n, r in unseen.items()},
            "lambada_last_word": (gen.get("lambada_last_word") or {}).get("value"), "distinct_2": gen.get("distinct_2")}


def facts_table(runs: list[Path], facts: dict) -> list[str]:
    """The runs' own columns (:func:`run_facts`) as markdown, one row a run; the machine and the
    precision once above it where all the runs share them (else per row)."""
    def num(v, fmt):
        return "–" if v is None else format(v, fmt)

    shared = {(f["machine"], f["precision"]) for f in facts.values()}
    unseen = sorted({n for f in facts.values() for n in f["unseen_vs_dense"]})
    lines = [f"Machine and precision: {facts[str(runs[0])]['machine']}, {facts[str(runs[0])]['precision']} "
             "training." if len(shared) == 1 else "Machines: per row (**more than one: do not compare their "
             "seconds**).", "",
             "| run | seconds used / budget | steps (per phase) | median s a step (per phase) | trainable | "
             + "".join(f"{n} × dense | " for n in unseen) + "LAMBADA last word % | distinct-2 |"
             + ("" if len(shared) == 1 else " machine |"),
             "|---|---:|---:|---:|---:|" + "---:|" * (len(unseen) + 2) + ("" if len(shared) == 1 else "---|")]
    for run in runs:
        f = facts[str(run)]
        phases = f["phase_steps"]
        steps = f"{f['steps']}" + (" (" + ", ".join(f"{ph} {n}" for ph, n in phases.items()) + ")" if len(phases) > 1
                                   else "")
        costs = ", ".join(f"{ph} {v:.2f}" if len(phases) > 1 else f"{v:.2f}" for ph, v in f["median_step_seconds"].items())
        used = f"{num(f['used_seconds'], '.0f')} / {num(f['budget_seconds'], '.0f')}"
        lam = None if f["lambada_last_word"] is None else 100 * f["lambada_last_word"]
        lines.append(f"| {run.name} | {used} | {steps} | {costs or '–'} | "
                     + ("–" if f["trainable_params"] is None else f"{f['trainable_params'] / 1e6:.1f}M") + " | "
                     + "".join(f"{num(f['unseen_vs_dense'].get(n), '.2f')} | " for n in unseen)
                     + f"{num(lam, '.1f')} | {num(f['distinct_2'], '.2f')} |"
                     + ("" if len(shared) == 1 else f" {f['machine']} / {f['precision']} |"))
    return lines


def held_out_by(p, cfg, name: str) -> None:
    """Refuse unless run ``name`` (its config ``cfg``) trained on no document behind pipeline
    ``p``'s validation and test rows."""
    from overrep.data.splits import check_held_out_by
    from overrep.data.text import mixture_parts, token_splits
    from overrep.errors import OverRepError

    d = cfg.data
    if d.seq_len != p.cfg.data.seq_len:
        raise OverRepError(f"{name} trained on rows of {d.seq_len} tokens, the rows scored have {p.cfg.data.seq_len}")
    parts = mixture_parts(d.source)  # (its unseen corpora are the scored run's: it refused their domains itself)
    theirs = token_splits(d.source, p.tokenizer, seq_len=d.seq_len, train_sequences=len(parts),
                          test_sequences=d.heldout_sequences, validation_sequences=d.validation_sequences,
                          seed=d.seed, text_field=d.text_field, progress=False)
    check_held_out_by(p.data_info, theirs.info, name)


if __name__ == "__main__":
    sys.exit(main())
