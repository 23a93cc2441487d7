"""What ``eval.precision`` changes: the dense and the unrecovered model of one run's
configuration, each scored in bf16 and in fp32 in one process, with the seconds each took.

    python scripts/scoring_precision.py [--set key=value ...] > scoring.jsonl

One JSON line per (model, precision): seconds, test and validation perplexity with their
intervals, per domain and unseen corpus, the paired ratio to the dense model of the same
precision, and the generation check (the dense model only; the unrecovered one is scored on
its default rows, ``eval.unrecovered: test``). Nothing is cached or written besides stdout.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from overrep.app.config import RunConfig
from overrep.app.pipeline import Pipeline
from overrep.eval.figures import model_figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="a run configuration (default: the default run's)")
    ap.add_argument("--set", action="append", default=[], help="a config override, key=value")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        cfg = RunConfig.load(args.config, [*args.set, f"output={scratch}"])
        p = Pipeline(cfg, progress=False)
        p.load(create_output=False)
        p.prune()
    dense = {}
    for tag, model, data in [("dense", p.dense, p.eval_data), ("pruned", p.pruned, p.eval_data.baseline())]:
        for precision in ("bf16", "fp32"):
            t0 = time.perf_counter()
            found, scores, _ = model_figures(model, p.tokenizer, data, tag=tag, source=p.model_info["source"], mask=None,
                                             root=None, dense=dense.get(precision), precision=precision)
            seconds = time.perf_counter() - t0
            if tag == "dense":
                dense[precision] = scores
            fig = found[f"{tag}_perplexity"]
            print(json.dumps({"model": tag, "precision": precision, "seconds": round(seconds, 1),
                              "test": fig["test"], "validation": fig["validation"],
                              "domains": {k: v["value"] for k, v in {**fig["domains"], **fig["unseen"]}.items()},
                              "vs_dense": fig.get("test_vs_dense"), "generation": found.get(f"{tag}_generation")}),
                  flush=True)


if __name__ == "__main__":
    main()
