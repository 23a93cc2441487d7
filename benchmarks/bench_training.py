"""Training-step throughput, memory and FLOP/s of OverRep recovery, measured in one run.

For one pruning of one model (default: the embedded SmolLM2-135M, RunConfig's default
pruning = 25 % of the parameters, criterion "last"; or ``--remove``) and one batch
(``--batch`` x ``--seq-len`` tokens), each case below runs ``--warmup`` untimed and
``--steps`` timed optimiser steps, each in its own child process (``--case NAME``):

  overrep_cached  hybrid preset, batches read from a feature cache built by the
                  pipeline's own code (Pipeline.features -> cache.build_or_open)
  overrep_live    hybrid preset, dense teacher's features recomputed every step
  plain_cached    "plain-full" preset (same recovery blocks, no W/D) from the cache:
                  the intrinsic overhead of the overcomplete parameterisation
  full_backprop   LM loss on the whole pruned model, every decoder block (and the final
                  norm) trainable, embeddings / LM head frozen, AdamW: forward + backward
                  through every block and the LM head, the least a LoRA-style recovery costs

  variants        one child holding both the OverRep (hybrid) and the Plain (plain-full)
                  recovery, stepping them interleaved (round-robin, rotated every round;
                  medians), so the ratios are measured side by side on a shared, noisy CPU:
                  plain / overrep in fp32 and bf16 (recovery.precision), OverRep in its
                  annealing phase (alpha > 0) and in its linear phase (alpha = 0) with the
                  exact folded forward ("fast") and without it ("ref"). Ratios: OverRep over
                  Plain at equal precision and against today's fp32 Plain, tokens/s over
                  today's fp32 OverRep step, and a schedule-weighted OverRep step (80 %
                  annealing + 20 % linear steps, the default alpha schedule).
  whole_model     the whole-model methods a budget grid compares with (lora-iso: PEFT LoRA
                  with OverRep's trainable count, language-model loss; overrep-kd: OverRep's
                  W/D trained on KL to the dense logits, teacher forward included) stepped
                  round-robin in fp32 and under bf16 autocast (recovery.precision), in one
                  child: each method's bf16 speed-up, measured side by side.

A ``cache_build`` child first builds the cache (batch x (warmup + steps) samples, in a
temporary folder) and reports its rate. The training steps are the trainer's own
(Trainer's optimiser, lr schedule, loss and grad clipping); the annealed activation is
pinned mid-schedule (alpha > 0) as during most of a real run. Cached cases drop the dense
teacher after the cache is open (training from a cache does not need it).

Per case: seconds per step (mean and best), tokens/s, peak resident memory of the child
(``ru_maxrss``, which includes loading the dense model) and the peak during training
alone (``VmHWM`` after resetting it, where Linux allows), FLOPs of one step
(FlopCounterMode, one extra step; attention counted as full, not causal; overrep_live
includes the teacher's forward) and achieved FLOP/s. The parent
also times plain fp32 ``torch.mm`` of the step's shapes ([batch*seq, hidden] x
[hidden, intermediate] and back), best of a few, and reports the ratios.

Run:   make bench            (= .venv/bin/python benchmarks/bench_training.py)
       .venv/bin/python benchmarks/bench_training.py --threads 8 --json-out bench.json
       .venv/bin/python benchmarks/bench_training.py --model DIR --data corpus.jsonl --remove 3-4 --cases overrep_cached,full_backprop
The JSON result goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from overrep.app.runinfo import processor
from overrep.core.precision import PRECISIONS, native_bf16, resolve_precision

CASES = ("overrep_cached", "overrep_live", "plain_cached", "full_backprop", "variants", "whole_model")
PRESETS = {"overrep_cached": "hybrid", "overrep_live": "hybrid", "plain_cached": "plain-full",
           "full_backprop": "hybrid", "cache_build": "hybrid", "variants": "hybrid", "whole_model": "hybrid"}
WHOLE_MODEL_METHODS = ("lora-iso", "overrep-kd")
# name: (recovery preset, precision, alpha phase, folded linear-phase forward)
VARIANTS = {
    "plain_fp32": ("plain-full", "fp32", None, True),
    "plain_bf16": ("plain-full", "bf16", None, True),
    "overrep_fp32": ("hybrid", "fp32", "annealing", True),
    "overrep_bf16": ("hybrid", "bf16", "annealing", True),
    "overrep_fp32_linear_ref": ("hybrid", "fp32", "linear", False),
    "overrep_fp32_linear": ("hybrid", "fp32", "linear", True),
    "overrep_bf16_linear": ("hybrid", "bf16", "linear", True),
    # the MLP's D on its hidden-size side: hidden^2 instead of intermediate^2 per token
    "narrow_bf16": ("hybrid-narrow", "bf16", "annealing", True),
    "narrow_bf16_linear": ("hybrid-narrow", "bf16", "linear", True),
}
LINEAR_SHARE = 0.2  # RecoveryConfig.alpha_linear_ratio: the share of steps with alpha = 0
MB = 1024 * 1024
TORCH_COMPILE_NOTE = "not used: see docs/speed.md"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- child side
def rss_hwm_reset() -> bool:
    """Reset the process's peak-RSS counter (VmHWM); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_hwm_mb() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024 / MB


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # Linux: ru_maxrss is in KiB


_PIPELINES = itertools.count()


def make_pipeline(args, case: str, preset: str | None = None, method: str = "overrep"):
    from overrep.app.config import RunConfig
    from overrep.app.pipeline import Pipeline

    work = Path(args.work_dir)
    cfg = RunConfig.load(overrides={
        "model": {"source": args.model},
        "prune": {"remove": args.remove} if args.remove else {},
        "recovery": {"method": method, "preset": preset or PRESETS[case], "batch_size": args.batch,
                     "threads": args.threads, "precision": args.precision,
                     "time_budget": None,  # no budget probe: the bench times its own steps
                     "warm_start": "none"},  # the preset as named (auto would train hybrid as hybrid-linear)
        "data": {"source": args.data, "seq_len": args.seq_len, "heldout_sequences": 1,
                 "train_sequences": args.batch * (args.warmup + args.steps)},
        "cache": {"dir": str(work / "cache"), "mode": "live" if case == "overrep_live" else "disk"},
        # a folder per pipeline: each holds its folder's lock while this process lives
        "output": str(work / f"run-{case}-{method}-{preset or PRESETS[case]}-{next(_PIPELINES)}"),
    })
    p = Pipeline(cfg, overwrite=True, progress=False)
    p.prepare_output()
    p.prepare(recovery=False)  # the cases set the recovery up themselves (some time it)
    return p


def recovery_step_fn(p):
    """One recovery step as Trainer.run takes it (same optimiser, lr, alpha, loss, clipping), at step
    indices from the middle of a default-length run."""
    from overrep.app.config import RunConfig
    from overrep.core.schedule import lr_factor
    from overrep.recovery.trainer import Trainer

    cfg = p.rcfg
    total = RunConfig().total_steps()  # a notional full run, so alpha sits inside its annealing phase
    objective = p.recovery.objective
    trainer = Trainer(objective, p.train_ids.shape[0], cfg, total, Path(p.out) / "checkpoints", progress=False)
    params = [q for g in trainer.opt.param_groups for q in g["params"]]
    objective.train(True)

    def step(i: int) -> None:
        s = total // 2 + i
        for a in objective.activations:
            a.set_step(s)
        for g in trainer.opt.param_groups:
            g["lr"] = cfg.lr * lr_factor(s, total, cfg.warmup_ratio, cfg.min_lr_ratio)
        trainer.opt.zero_grad(set_to_none=True)
        loss = objective.loss(trainer.batch_indices(s))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        trainer.opt.step()

    return step, sum(q.numel() for q in params), (objective.activations or [None])[0]


def variant_step_fn(p, precision: str, phase: str | None, fast: bool):
    """``recovery_step_fn`` at a chosen precision, alpha phase and linear-phase forward."""
    from overrep.app.config import RunConfig
    from overrep.core.projection import OvercompleteLinear

    step, n, act = recovery_step_fn(p)
    total = RunConfig().total_steps()
    modules = p.recovery.objective.modules
    # recovery_step_fn steps alpha from total // 2; the linear phase starts at 80 % of the run
    offset = 0 if phase != "linear" else math.ceil((1 - LINEAR_SHARE) * total) - total // 2

    def run(i: int) -> None:
        for m in modules:
            m.precision = precision
            for sub in m.modules():
                if isinstance(sub, OvercompleteLinear):
                    sub.fast = fast
        step(offset + i)

    return run, n, act


def run_variants(args, out: dict) -> dict:
    """Every VARIANTS entry stepped round-robin in this process; medians per variant."""
    import statistics

    pipes = {}
    for preset in sorted({v[0] for v in VARIANTS.values()}):
        pipes[preset] = make_pipeline(args, "variants", preset)
        pipes[preset].build_recovery()
        pipes[preset].dense = None
    fns, acts = {}, {}
    for name, (preset, precision, phase, fast) in VARIANTS.items():
        fns[name], out.setdefault("trainable_params", {})[name], acts[name] = \
            variant_step_fn(pipes[preset], precision, phase, fast)
    names, times, alphas = list(VARIANTS), {n: [] for n in VARIANTS}, {}
    rounds = args.warmup + args.steps
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            fns[name](r)
            dt = time.perf_counter() - t0
            alphas[name] = acts[name].alpha  # the activation is shared by a pipeline's variants
            if r >= args.warmup:
                times[name].append(dt)
            log(f"variants: round {r + 1}/{rounds} {name} {dt:.3f} s" + (" (warm-up)" if r < args.warmup else ""))
    tokens = args.batch * args.seq_len
    res = {}
    for name, (preset, precision, phase, fast) in VARIANTS.items():
        med = statistics.median(times[name])
        res[name] = {"preset": preset, "precision": precision, "alpha_phase": phase or "none",
                     "folded_linear_forward": fast if phase == "linear" else None,
                     "seconds_per_step_median": med, "seconds_per_step_min": min(times[name]),
                     "tokens_per_second": tokens / med}
        if phase == "annealing":
            res[name]["alpha"] = alphas[name]
    out["variants"] = res
    return out


def run_whole_model(args, out: dict) -> dict:
    """Each WHOLE_MODEL_METHODS method stepped in fp32 and bf16, round-robin; medians."""
    import statistics

    fns, names = {}, []
    for method in WHOLE_MODEL_METHODS:
        p = make_pipeline(args, "whole_model", method=method)
        p.build_recovery()
        step, n, _ = recovery_step_fn(p)
        out.setdefault("trainable_params", {})[method] = n
        for precision in ("fp32", "bf16"):
            def run(i, step=step, objective=p.recovery.objective, precision=precision):
                objective.precision = precision
                step(i)
            fns[f"{method}_{precision}"] = run
            names.append(f"{method}_{precision}")
    times = {n: [] for n in names}
    rounds = args.warmup + args.steps
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name](r)
            dt = time.perf_counter() - t0
            if r >= args.warmup:
                times[name].append(dt)
            log(f"whole_model: round {r + 1}/{rounds} {name} {dt:.3f} s" + (" (warm-up)" if r < args.warmup else ""))
    tokens = args.batch * args.seq_len
    res = {n: {"seconds_per_step_median": statistics.median(t), "seconds_per_step_min": min(t),
               "tokens_per_second": tokens / statistics.median(t)} for n, t in times.items()}
    for method in WHOLE_MODEL_METHODS:
        res[f"{method}_bf16_speedup"] = (res[f"{method}_fp32"]["seconds_per_step_median"]
                                         / res[f"{method}_bf16"]["seconds_per_step_median"])
    out["whole_model"] = res
    return out


def variant_ratios(v: dict) -> dict:
    """Step-time ratios and speed-ups from the ``variants`` case's medians."""
    t = {k: x["seconds_per_step_median"] for k, x in v.items()}
    out = {}
    for prec in ("fp32", "bf16"):
        t[f"overrep_{prec}_schedule"] = (1 - LINEAR_SHARE) * t[f"overrep_{prec}"] + LINEAR_SHARE * t[f"overrep_{prec}_linear"]
        out[f"overrep_{prec}_schedule_seconds_per_step"] = t[f"overrep_{prec}_schedule"]
        for phase in ("", "_linear", "_schedule"):
            out[f"overrep{phase}_vs_plain_step_time_{prec}"] = t[f"overrep_{prec}{phase}"] / t[f"plain_{prec}"]
    for phase in ("", "_linear", "_schedule"):
        out[f"overrep_bf16{phase}_vs_plain_fp32_step_time"] = t[f"overrep_bf16{phase}"] / t["plain_fp32"]
        # tokens/s against today's fp32 path: alpha > 0 and no folding, i.e. overrep_fp32 / linear_ref
    base = {"": t["overrep_fp32"], "_linear": t["overrep_fp32_linear_ref"], "_schedule": t["overrep_fp32"]}
    for phase in ("", "_linear", "_schedule"):
        out[f"overrep_bf16{phase}_tokens_per_second_vs_fp32_today"] = base[phase] / t[f"overrep_bf16{phase}"]
    out["overrep_fp32_linear_fold_speedup"] = t["overrep_fp32_linear_ref"] / t["overrep_fp32_linear"]
    if "narrow_bf16" in t:
        t["narrow_bf16_schedule"] = (1 - LINEAR_SHARE) * t["narrow_bf16"] + LINEAR_SHARE * t["narrow_bf16_linear"]
        for phase in ("", "_linear", "_schedule"):
            out[f"narrow{phase}_vs_plain_step_time_bf16"] = t[f"narrow_bf16{phase}"] / t["plain_bf16"]
    out["plain_bf16_speedup"] = t["plain_fp32"] / t["plain_bf16"]
    return out


def full_backprop_step_fn(p):
    from overrep.model.arch import decoder_layers, final_norm

    model, cfg = p.pruned, p.cfg.recovery
    model.requires_grad_(False)
    for layer in decoder_layers(model):
        layer.requires_grad_(True)
    final_norm(model).requires_grad_(True)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=p.rcfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    model.train()
    ids, b = p.train_ids, cfg.batch_size

    def step(i: int) -> None:
        rows = ids[(i * b) % ids.shape[0]:][:b]
        opt.zero_grad(set_to_none=True)
        model(input_ids=rows, labels=rows, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()

    return step, sum(q.numel() for q in params)


def run_child(args) -> dict:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    case = args.case
    p = make_pipeline(args, case)
    cfg = p.dense.config
    out = {"case": case, "removed_layers": p.plan.removed, "num_layers": p.num_layers,
           "hidden_size": cfg.hidden_size, "intermediate_size": getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
           "model": p.model_info["source"], "threads": torch.get_num_threads()}
    tokens, act = args.batch * args.seq_len, None
    if case == "variants":
        return run_variants(args, out)
    if case == "whole_model":
        return run_whole_model(args, out)
    if case == "full_backprop":
        p.dense = None  # the pruned model is a deep copy
        step, out["trainable_params"] = full_backprop_step_fn(p)
    else:
        t0 = time.perf_counter()
        p.build_recovery()  # builds (or opens) the feature cache
        if case == "cache_build":
            dt = time.perf_counter() - t0
            n = p.train_ids.shape[0]
            out.update(cache_build_seconds=dt, cache_build_tokens_per_second=n * args.seq_len / dt,
                       cache_samples=n, cache_bytes=p.teacher.cache.nbytes, peak_rss_mb=peak_rss_mb())
            return out
        if case != "overrep_live":
            p.dense = None  # training from the cache never touches the teacher
        step, out["trainable_params"], act = recovery_step_fn(p)
    peak_before = peak_rss_mb()  # the reset below also resets what ru_maxrss reports
    hwm_ok = rss_hwm_reset()
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step(i)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        log(f"{case}: step {i + 1}/{args.warmup + args.steps} {time.perf_counter() - t0:.3f} s"
            + (" (warm-up)" if i < args.warmup else ""))
    if act is not None and act.enabled and any(b.w or b.d for b in p.recovery.preset.blocks):
        out["alpha"] = act.alpha
    if hwm_ok:
        out["train_peak_rss_mb"] = rss_hwm_mb()
    out["peak_rss_mb"] = max(peak_before, peak_rss_mb(), out.get("train_peak_rss_mb", 0.0))
    from overrep.model.flops import flop_counter

    with flop_counter(cpu_attention=True) as fc:  # one more step, after the memory readings (CPU attention counted)
        step(args.warmup + args.steps)
    mean = sum(times) / len(times)
    out.update(seconds_per_step=mean, seconds_per_step_min=min(times), tokens_per_second=tokens / mean,
               flops_per_step=fc.get_total_flops())
    out["achieved_flops_per_second"] = out["flops_per_step"] / mean
    return out


# --------------------------------------------------------------------------- parent side
def matmul_flops(m: int, hidden: int, inter: int, repeats: int = 5) -> dict:
    """Best-of-``repeats`` fp32 torch.mm FLOP/s for the step's two typical MLP shapes."""
    out = {}
    for a, b, c in ((m, hidden, inter), (m, inter, hidden)):
        x, w = torch.randn(a, b), torch.randn(b, c)
        torch.mm(x, w)  # warm-up
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(x, w)
            best = min(best, time.perf_counter() - t0)
        out[f"{a}x{b}x{c}"] = 2 * a * b * c / best
    return out


def run_case(args, case: str, work: str) -> dict:
    result = Path(work) / f"{case}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--work-dir", work,
           "--json-out", str(result), "--model", args.model, "--data", args.data, "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--precision", args.precision]
    cmd += ["--remove", args.remove] if args.remove else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    log(f"running case {case}")
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, stdout=sys.stderr).returncode  # children's output must not reach our stdout
    if rc:
        sys.exit(f"bench: case {case} failed (exit status {rc}); its output is above")
    log(f"case {case} done in {time.perf_counter() - t0:.1f} s")
    return json.loads(result.read_text())


def run_parent(args) -> dict:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        sys.exit(f"unknown case(s) {bad}; choose from {', '.join(CASES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="overrep-bench-") as work:
        if any(c.endswith("_cached") or c == "variants" for c in cases):
            res["cache_build"] = run_case(args, "cache_build", work)
        for c in cases:
            res[c] = run_case(args, c, work)
    info = next(iter(res.values()))
    m = args.batch * args.seq_len
    log(f"timing torch.mm for [{m}, {info['hidden_size']}] x [{info['hidden_size']}, {info['intermediate_size']}]")
    mm = matmul_flops(m, info["hidden_size"], info["intermediate_size"])
    report = {
        "settings": {"model": info["model"], "precision": args.precision, "removed_layers": info["removed_layers"],
                     "num_layers": info["num_layers"], "data": args.data, "batch": args.batch,
                     "seq_len": args.seq_len, "tokens_per_step": m, "steps": args.steps, "warmup": args.warmup,
                     "threads": info["threads"], "torch": torch.__version__, "python": platform.python_version(),
                     "cpu": processor(torch.device("cpu")), "cpu_count": _cpu_count(), "cases": cases,
                     # AVX512-BF16 or AMX: without them bf16 is emulated (recovery.precision: auto is fp32)
                     "cpu_native_bf16": native_bf16("cpu")},
        "cases": {},
        "matmul_flops_per_second": max(mm.values()),
        "matmul_flops_per_second_by_shape": mm,
    }
    keep = ("seconds_per_step", "seconds_per_step_min", "tokens_per_second", "peak_rss_mb", "train_peak_rss_mb",
            "flops_per_step", "achieved_flops_per_second", "trainable_params", "alpha")
    for c in cases:
        if c == "whole_model":
            report["whole_model"] = res[c]["whole_model"]
            continue
        if c == "variants":
            report["variants"] = res[c]["variants"]
            report["variant_ratios"] = variant_ratios(res[c]["variants"])
            report["torch_compile"] = TORCH_COMPILE_NOTE
            continue
        report["cases"][c] = {k: res[c][k] for k in keep if k in res[c]}
    if "cache_build" in res:
        cb = res["cache_build"]
        for k in ("cache_build_seconds", "cache_build_tokens_per_second", "cache_samples", "cache_bytes"):
            report[k] = cb[k]
        report["cache_build_peak_rss_mb"] = cb["peak_rss_mb"]
    step = {c: res[c]["seconds_per_step"] for c in cases if c not in ("variants", "whole_model")}
    if "overrep_cached" in step:
        report["overrep_flops_fraction_of_matmul"] = (res["overrep_cached"]["achieved_flops_per_second"]
                                                      / report["matmul_flops_per_second"])
    for key, num, den in (("overrep_vs_plain_step_time", "overrep_cached", "plain_cached"),
                          ("full_backprop_vs_overrep_step_time", "full_backprop", "overrep_cached"),
                          ("live_vs_cached_step_time", "overrep_live", "overrep_cached")):
        if num in step and den in step:
            report[key] = step[num] / step[den]
    return report


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="'embedded' (SmolLM2-135M), a HF folder, .gguf or hub id")
    ap.add_argument("--data", default="embedded", help="data source as in data.source (a .txt/.jsonl file ...)")
    ap.add_argument("--remove", default=None, help="blocks to remove, e.g. '21-28' (default: RunConfig's 25%% ratio)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per case (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--precision", default="auto", choices=PRECISIONS,
                    help="recovery.precision of the per-case children, auto as in a run: bf16 where the "
                         "CPU has bf16 instructions, else fp32 (the variants case runs both)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        ap.error("--steps must be >= 1, --warmup >= 0, --batch >= 1")
    args.precision = resolve_precision(args.precision, "cpu")
    report = run_child(args) if args.case else run_parent(args)
    text = json.dumps(report, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if not args.case:
        print(text)


if __name__ == "__main__":
    main()
