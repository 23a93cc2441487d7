"""Peak memory of the feature teacher: the whole dense model in memory against streaming it
block by block from its safetensors files (``cache.teacher: stream``), in one run.

Each way runs in a child process of its own (so that one's peak does not hide the other's)
on the same rows and the same recovery groups, and reports its peak resident memory
(``ru_maxrss``), its time, and the largest difference between its features and the other's.

Run:   .venv/bin/python benchmarks/bench_streaming.py                 (embedded SmolLM2-135M)
       .venv/bin/python benchmarks/bench_streaming.py --model DIR --rows 64 --remove 21-28
The JSON result goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1024 * 1024


def child(args) -> None:
    import torch

    from overrep.model.arch import decoder_layers
    from overrep.model.hooks import teacher_features
    from overrep.model.loading import load_model
    from overrep.model.streaming import stream_features
    from overrep.model.surgery import parse_layers, plan_pruning

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (args.rows, args.seq_len))
    t0 = time.perf_counter()
    if args.case == "whole":
        model, _, info = load_model(args.model)
        plan = plan_pruning(len(decoder_layers(model)), parse_layers(args.remove), blocks=2)
        feats = [teacher_features(model, ids[i:i + 8], plan.groups) for i in range(0, args.rows, 8)]
        feats = [{k: torch.cat([f[g][k] for f in feats]) for k in ("inputs", "targets")} for g in range(len(feats[0]))]
    else:
        from transformers import AutoConfig

        folder = Path(args.folder)
        plan = plan_pruning(AutoConfig.from_pretrained(folder).num_hidden_layers, parse_layers(args.remove), blocks=2)
        feats = stream_features(folder, ids, plan.groups, batch=8)
    seconds = time.perf_counter() - t0
    torch.save(feats, args.out)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB,
                      "seconds": seconds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="'embedded' or a local Hugging Face folder")
    ap.add_argument("--remove", default="9-19", help="blocks removed (default: the default run's cosine mask)")
    ap.add_argument("--rows", type=int, default=32, help="training rows whose features are computed")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        return child(args)
    import torch

    from overrep.model.loading import load_model

    _, _, info = load_model(args.model)  # the folder the model is read from (the embedded one is converted once)
    folder = info["source"]
    result = {"model": folder, "rows": args.rows, "seq_len": args.seq_len, "remove": args.remove}
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("whole", "stream"):
            print(f"[bench_streaming] {case} ...", file=sys.stderr)
            out = Path(tmp) / f"{case}.pt"
            done = subprocess.run([sys.executable, __file__, "--case", case, "--model", args.model, "--folder", folder,
                                   "--remove", args.remove, "--rows", str(args.rows), "--seq-len", str(args.seq_len),
                                   "--out", str(out)], capture_output=True, text=True, check=True)
            result[case] = json.loads(done.stdout.strip().splitlines()[-1])
        a, b = torch.load(Path(tmp) / "whole.pt"), torch.load(Path(tmp) / "stream.pt")
        result["max_abs_diff"] = max((x[k] - y[k]).abs().max().item() for x, y in zip(a, b) for k in x)
    result["stream_over_whole_peak_rss"] = result["stream"]["peak_rss_mb"] / result["whole"]["peak_rss_mb"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
