"""Speed and accuracy of the feature teacher in each training precision, in one run.

A layer-wise method's features (the hidden state entering each recovery module and the one it
must reproduce) are computed by the dense model in the run's ``recovery.precision``
(:class:`overrep.recovery.teacher.Teacher`). This times :meth:`Teacher.batch` on the same
rows of real text in fp32 and under bf16 autocast (one warm-up pass, then ``--repeats``
timed passes each) and reports rows per second, the speed-up, and how far the bf16 features
are from the fp32 ones: the relative error ``|bf16 - fp32| / |fp32|`` per token (median and
99th percentile over tokens; the first token of each row, which carries the model's massive
activation, separately).

The same for the warm start's closed-form fit (ReplaceMe's map,
:func:`overrep.recovery.closed_form.fit_and_fold`, on ``--fit-rows`` rows: the default run's
``recovery.closed_rows``): seconds per fit in each precision (fp32 and bf16 alternating,
``--repeats`` each, on fresh pruned copies) and how far the bf16 map is from the fp32 one.

Run:   .venv/bin/python benchmarks/bench_features.py                 (embedded SmolLM2-135M)
       .venv/bin/python benchmarks/bench_features.py --rows 32 --remove 9-19
The JSON result goes to stdout, progress to stderr. On a CPU without bf16 instructions the
bf16 pass is emulated (slow): that is what ``recovery.precision: auto`` avoids.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def relative_errors(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """``[rows, tokens]``: per-token ``|got - ref| / |ref|``."""
    return (got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="'embedded' or a local Hugging Face folder")
    ap.add_argument("--remove", default="9-19", help="blocks removed (default: the default run's cosine mask)")
    ap.add_argument("--rows", type=int, default=32, help="rows of 256 tokens of the default training text")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fit-rows", type=int, default=64, help="calibration rows of the closed-form fit (0: skip it)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from overrep.app.runinfo import processor
    from overrep.data.splits import split_source
    from overrep.model.arch import decoder_layers
    from overrep.model.loading import load_model
    from overrep.model.surgery import parse_layers, plan_pruning, prune
    from overrep.recovery.closed_form import FitOptions, down_projection, fit_and_fold
    from overrep.recovery.teacher import Teacher

    model, tokenizer, _ = load_model(None if args.model == "embedded" else args.model)
    model.eval()
    plan = plan_pruning(len(decoder_layers(model)), parse_layers(args.remove), blocks=1)
    ids = split_source("embedded", tokenizer, seq_len=256, train_sequences=max(args.rows, args.fit_rows),
                       test_sequences=1, progress=False).train
    out: dict = {"cpu": processor(torch.device("cpu")), "threads": torch.get_num_threads(),
                 "rows": args.rows, "seq_len": 256, "remove": args.remove, "cases": {}}
    feats = {}
    for precision in ("fp32", "bf16"):
        teacher = Teacher(model, plan, ids, cache_root=Path(), fingerprint={}, precision=precision)
        with torch.no_grad():
            teacher.batch(ids[:8])  # warm-up
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                feats[precision] = teacher.batch(ids[:args.rows])
            seconds = (time.perf_counter() - t0) / args.repeats
        out["cases"][precision] = {"seconds": seconds, "rows_per_second": args.rows / seconds,
                                   "tokens_per_second": args.rows * 256 / seconds}
        print(f"{precision}: {args.rows / seconds:.1f} rows/s ({args.rows * 256 / seconds:,.0f} tokens/s)",
              file=sys.stderr)
    out["speedup_bf16"] = out["cases"]["fp32"]["seconds"] / out["cases"]["bf16"]["seconds"]
    if args.fit_rows:
        import copy

        fits: dict = {"fp32": [], "bf16": []}
        maps = {}
        for _ in range(args.repeats):
            for precision in fits:  # alternating, so a drift of the machine hits both
                pruned = prune(copy.deepcopy(model), plan)
                info = fit_and_fold(pruned, model, plan, ids, FitOptions(rows=args.fit_rows, precision=precision))
                fits[precision].append(sum(r["seconds"] for r in info["runs"]))
                maps[precision] = down_projection(decoder_layers(pruned)[plan.removed[0] - 1],
                                                  plan.removed[0] - 1).weight.detach().clone()
                print(f"fit {precision}: {fits[precision][-1]:.1f} s", file=sys.stderr)
        out["fit"] = {"rows": args.fit_rows, "seconds": {k: min(v) for k, v in fits.items()},
                      "speedup_bf16": min(fits["fp32"]) / min(fits["bf16"]),
                      "bf16_map_relative_difference": ((maps["bf16"] - maps["fp32"]).norm()
                                                       / maps["fp32"].norm()).item()}
    for k in ("inputs", "targets"):
        err = relative_errors(feats["fp32"][0][k], feats["bf16"][0][k])
        rest = err[:, 1:].flatten()
        out[f"bf16_relative_error_{k}"] = {"median": rest.median().item(), "p99": rest.quantile(0.99).item(),
                                           "first_token_median": err[:, 0].median().item()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
