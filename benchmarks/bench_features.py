"""Speed and accuracy of the feature teacher in each training precision, in one run.

A layer-wise method's features (the hidden state entering each recovery module and the one it
must reproduce) are computed by the dense model in the run's ``recovery.precision``
(:class:`overrep.recovery.teacher.Teacher`). This times :meth:`Teacher.batch` on the same
rows of real text in fp32 and under bf16 autocast (one warm-up pass, then ``--repeats``
timed passes each) and reports rows per second, the speed-up, and how far the bf16 features
are from the fp32 ones: the relative error ``|bf16 - fp32| / |fp32|`` per token (median and
99th percentile over tokens; the first token of each row, which carries the model's massive
activation, separately).

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
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from overrep.app.runinfo import processor
    from overrep.data.splits import split_source
    from overrep.model.arch import decoder_layers
    from overrep.model.loading import load_model
    from overrep.model.surgery import parse_layers, plan_pruning
    from overrep.recovery.teacher import Teacher

    model, tokenizer, _ = load_model(None if args.model == "embedded" else args.model)
    model.eval()
    plan = plan_pruning(len(decoder_layers(model)), parse_layers(args.remove), blocks=1)
    ids = split_source("embedded", tokenizer, seq_len=256, train_sequences=args.rows, test_sequences=1,
                       progress=False).train
    out: dict = {"cpu": processor(torch.device("cpu")), "threads": torch.get_num_threads(),
                 "rows": args.rows, "seq_len": 256, "remove": args.remove, "cases": {}}
    feats = {}
    for precision in ("fp32", "bf16"):
        teacher = Teacher(model, plan, ids, cache_root=Path(), fingerprint={}, precision=precision)
        with torch.no_grad():
            teacher.batch(ids[:8])  # warm-up
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                feats[precision] = teacher.batch(ids)
            seconds = (time.perf_counter() - t0) / args.repeats
        out["cases"][precision] = {"seconds": seconds, "rows_per_second": args.rows / seconds,
                                   "tokens_per_second": args.rows * 256 / seconds}
        print(f"{precision}: {args.rows / seconds:.1f} rows/s ({args.rows * 256 / seconds:,.0f} tokens/s)",
              file=sys.stderr)
    out["speedup_bf16"] = out["cases"]["fp32"]["seconds"] / out["cases"]["bf16"]["seconds"]
    for k in ("inputs", "targets"):
        err = relative_errors(feats["fp32"][0][k], feats["bf16"][0][k])
        rest = err[:, 1:].flatten()
        out[f"bf16_relative_error_{k}"] = {"median": rest.median().item(), "p99": rest.quantile(0.99).item(),
                                           "first_token_median": err[:, 0].median().item()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
