"""``make gpu-check``: on a CUDA machine, the GPU-marked tests and a short bf16 recovery of the
embedded model, with what it achieved.

1. ``pytest -m gpu tests/test_gpu.py`` (the onloaded model on the GPU, ``model.dtype: auto``,
   a bf16 run with the whole and the onloaded teacher);
2. ``overrep run`` on the embedded model (SmolLM2-135M) in bf16 (``model.dtype: auto``,
   ``recovery.precision: auto``), ``--steps`` OverRep steps, no time budget, its default mask;
3. prints one JSON object: the device, tokens/s of the training steps, peak GPU memory, and
   achieved FLOP/s -- the recovery module's training FLOPs per token (the planner's count:
   forward + backward = 3 x forward, :mod:`overrep.model.flops`) times tokens/s -- against
   the device's dense bf16 peak (:data:`PEAK_BF16`, from the vendors' data sheets).

Without a CUDA device it says so in one line and exits 2. Results belong in docs/speed.md.

Run:   .venv/bin/python benchmarks/gpu_check.py [--steps 200] [--batch 8] [--seq-len 256] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PEAK_BF16 = {  # dense bf16 tensor-core FLOP/s (no sparsity), by device-name fragment
    # "H100 80GB HBM3" is the SXM board (the PCIe card's memory is HBM2e)
    "H200": 989e12, "H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12,
    "H100": 756e12,
    "A100": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10": 125e12, "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def peak_flops(name: str) -> float | None:
    for key, value in PEAK_BF16.items():  # the longest names first in each family above
        if key in name:
            return value
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--output", default=None, help="folder for the run and its cache (default: a new temporary folder)")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing was run", file=sys.stderr)
        return 2
    root = Path(__file__).parents[1]
    tests = None
    if not a.skip_tests:
        # only the GPU tests' file: collecting the whole suite would import what only the CPU tests need
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                                str(root / "tests" / "test_gpu.py")]).returncode
    out = Path(a.output) if a.output else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    cmd = [sys.executable, "-m", "overrep", "run", "--max-steps", str(a.steps), "--output", str(out / "run"),
           "--quiet", "--set", "model.dtype=auto", "--set", "recovery.precision=auto", "--set", "model.device=cuda",
           "--set", "recovery.time_budget=null", "--set", f"recovery.batch_size={a.batch}",
           "--set", f"data.seq_len={a.seq_len}", "--set", f"cache.dir={out / 'cache'}", "--set", "eval.latency=false"]
    run = subprocess.run(cmd)
    if run.returncode:
        print(json.dumps({"tests_exit": tests, "run_exit": run.returncode}))
        return 1
    from overrep.model.accounting import recovery_account
    from overrep.model.loading import load_config

    m = json.loads((out / "run" / "metrics.json").read_text())
    config, _ = load_config("embedded")
    acc = recovery_account(config, m["removed_layers"], m.get("preset") or "hybrid", seq_len=a.seq_len,
                           final_block=False)
    flops_token = 3 * 2 * acc["module_macs_per_token"]
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name)
    achieved = flops_token * m["train_tokens_per_second"]
    print(json.dumps({
        "device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "tests_exit": tests,
        "steps": m["train_steps"], "batch": a.batch, "seq_len": a.seq_len, "precision": m["precision"],
        "model_dtype": m["run"]["model_dtype"], "train_tokens_per_second": m["train_tokens_per_second"],
        "peak_memory_bytes": m["peak_memory_bytes"], "train_flops_per_token": flops_token,
        "achieved_flops_per_second": achieved, "device_peak_bf16_flops": peak,
        "fraction_of_peak": achieved / peak if peak else None, "output": str(out / "run"),
    }, indent=2))
    return 0 if not tests else 1


if __name__ == "__main__":
    sys.exit(main())
