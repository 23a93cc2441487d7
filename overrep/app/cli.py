"""``overrep`` command line: one subcommand per stage, ``run`` for all of them.

    overrep run [--config FILE] [--model M] [--ratio R | --remove 21-28] [--output DIR]
                [--max-steps N] [--set section.field=value ...] [--resume | --overwrite]
    overrep inspect  [same options]   plan + parameter/memory account, no training
    overrep prune    [same options]   export the pruned model without recovery (a baseline)
    overrep cache    [same options]   build (or verify) the feature cache only
    overrep recover  [same options]   prune, cache, train, merge, export (no baseline evaluation)
    overrep export   --output DIR     merge and export a finished training from its checkpoints
    overrep eval     MODEL            lm-eval benchmarks offline (--perplexity: held-out perplexity)
    overrep plan     --model CONFIG   from a config alone: removal, parameters, memory, cache, FLOPs, layout
    overrep presets                   list the built-in presets
    overrep methods                   list the recovery methods and pruning criteria
    overrep compare  --config FILE    a grid of methods x criteria x ratios, one table and plots

Errors print one line (``overrep: error: ...``) and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..errors import OverRepError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run configuration (any subset of fields)")
    p.add_argument("--model", help="model: 'embedded', a local HF folder, a .gguf file or a hub id")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ratio", type=float, help="fraction of parameters to remove (rounded to whole blocks)")
    g.add_argument("--remove", help="explicit blocks to remove, e.g. 21-28 or 3,5,7-9")
    p.add_argument("--method", help="recovery method (see `overrep methods`; default overrep)")
    p.add_argument("--prune", choices=("blocks", "width"),
                   help="what a ratio removes: whole decoder blocks (default) or width (attention heads and MLP "
                        "channels of every block)")
    p.add_argument("--criterion", help="pruning criterion: last | block-influence | cosine | laco")
    from ..recovery.losses import LOSSES

    p.add_argument("--loss", help=f"layer-wise loss: {' | '.join(LOSSES)}, or A>B (see `overrep methods`)")
    p.add_argument("--preset", help="recovery preset name or .yaml file")
    p.add_argument("--output", help="output folder")
    p.add_argument("--max-steps", type=int, help="recovery optimiser steps")
    p.add_argument("--time-budget", help="recover within this wall-clock (feature cache included), e.g. 20m, "
                                         "90s, 1.5h: the step count is fixed after a few measured steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set recovery.lr=1e-4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --output")
    p.add_argument("--overwrite", action="store_true", help="replace whatever is in --output")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _config(args):
    from .config import RunConfig

    overrides = list(args.set)
    given = {item.split("=", 1)[0].strip() for item in overrides}
    if getattr(args, "max_steps", None) is not None and getattr(args, "time_budget", None) is not None:
        raise OverRepError("--max-steps and --time-budget both fix the step count; give one")
    for flag, key in (("model", "model.source"), ("preset", "recovery.preset"), ("output", "output"),
                      ("max_steps", "recovery.steps"), ("time_budget", "recovery.time_budget"), ("method", "recovery.method"), ("loss", "recovery.loss"),
                      ("criterion", "prune.criterion"), ("prune", "prune.granularity")):
        if getattr(args, flag, None) is not None:
            if key in given:
                raise OverRepError(f"--{flag.replace('_', '-')} and --set {key}=... both set {key}; give one")
            overrides.append(f"{key}={getattr(args, flag)}")
    if getattr(args, "ratio", None) is not None:
        overrides += [f"prune.ratio={args.ratio}", "prune.remove=null"]
    if getattr(args, "remove", None) is not None:
        overrides.append(f"prune.remove='{args.remove}'")
    return RunConfig.load(args.config, overrides)


def cmd_run(args, *, evaluate: bool = True) -> int:
    from .pipeline import Pipeline

    cfg = _config(args)
    if not evaluate:
        cfg.eval.perplexity = cfg.eval.latency = False
    pipeline = Pipeline(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet)
    if not pipeline.world.is_main:  # torchrun: rank 0 speaks for the run
        logging.getLogger("overrep").setLevel(logging.WARNING)
    metrics = pipeline.run()
    if not pipeline.world.is_main:
        return 0
    keys = ("dense_ppl", "pruned_ppl", "recovered_ppl", "merge_max_abs_diff", "removed_layers",
            "trainable_params", "train_seconds", "model_dir")
    print(json.dumps({k: metrics.get(k) for k in keys}, indent=2))
    print(f"report: {cfg.output}/report.md")
    return 0


def cmd_inspect(args) -> int:
    from ..model.accounting import recovery_account
    from .pipeline import Pipeline

    cfg = _config(args)
    p = Pipeline(cfg, progress=not args.quiet)
    p.load(create_output=False)
    r = cfg.recovery
    if p.width:  # the account is the real wrapped model's (no config-only path for width plans yet)
        p.prune()
        p.build_recovery(with_data=False)
        m = p.metrics
        print(json.dumps({"model": p.model_info["source"], "method": p.method.name, "granularity": "width",
                          "criterion": cfg.prune.width_criterion, "widths": m["widths"],
                          "dense_params": m["dense_params"], "compact_params": m["pruned_params"],
                          "param_fraction_removed_head_counted": m["param_fraction_removed_head_counted"],
                          "trainable_params": p.recovery.trainable_params, "total_steps": p.total_steps}, indent=2))
        return 0
    preset = p.method.preset or r.preset
    acc = recovery_account(p.dense.config, p.selection.removed, preset, blocks=p.method.blocks or r.blocks,
                           block1_init=r.block1_init, final_block=r.final_block)
    acc.update(model=p.model_info["source"], method=p.method.name, criterion=cfg.prune.criterion,
               criterion_scores=p.selection.scores, total_steps=p.total_steps)
    if p.method.family in ("adapter", "full", "closed-form"):  # what trains is not the recovery module
        p.prune()
        p.build_recovery(with_data=False)
        acc["trainable_params"] = p.recovery.trainable_params
        acc["recovery_ratio"] = acc["trainable_params"] / acc["compact_params"]
        acc.pop("train_state_bytes", None)
    print(json.dumps(acc, indent=2))
    return 0


def cmd_prune(args) -> int:
    from .pipeline import Pipeline

    p = Pipeline(_config(args), reuse=True, overwrite=args.overwrite, progress=not args.quiet)
    p.prepare_output()
    with p.output_guard():
        p.load()
        p.prune()
        path = p.export_pruned()
    print(json.dumps({k: p.metrics[k] for k in ("removed_layers", "num_layers_before", "num_layers_after",
                                                 "layer_fraction_removed", "param_fraction_removed")}, indent=2))
    print(path)
    return 0


def cmd_cache(args) -> int:
    from .pipeline import Pipeline

    cfg = _config(args)
    cfg.cache.mode = "disk"
    p = Pipeline(cfg, reuse=True, overwrite=args.overwrite, progress=not args.quiet)
    p.prepare_output()
    with p.output_guard():
        p.load()
        p.prune()
        p.features()
    print(json.dumps(p.metrics["cache"], indent=2))
    return 0


def cmd_export(args) -> int:
    from .config import RunConfig
    from .pipeline import Pipeline

    out = Path(args.output)
    if not (out / "config.yaml").is_file():
        raise OverRepError(f"'{out}' is not an overrep output folder (no config.yaml)")
    p = Pipeline(RunConfig.load(out / "config.yaml"), resume=True, progress=not args.quiet)
    p.prepare_output()
    p.load()
    p.prune()
    p.build_recovery(with_data=False)
    if p.cfg.recovery.time_budget is not None and p.cfg.recovery.steps is None:  # measured, in the checkpoints
        p.total_steps = p.checkpointed_total() or p.total_steps
        p.build_recovery(with_data=False)
    trainer = p.make_trainer()
    if trainer.step < trainer.total:
        raise OverRepError(f"training in '{out}' stopped at step {trainer.step} of {trainer.total}; "
                           "finish it with `overrep recover --resume` first")
    trainer.restore_best()  # recovery.keep_best: the step the run chose, as the run itself did
    for a in p.recovery.objective.activations:
        a.set_step(trainer.total)
    p.merge()
    print(p.export())
    return 0


def cmd_eval(args) -> int:
    if not args.perplexity:
        return cmd_benchmarks(args)
    from ..model.loading import load_model
    from ..eval.retained import heldout_perplexity

    model, tok, info = load_model(args.model)
    out = heldout_perplexity(model, tok, source=args.data, seq_len=args.seq_len, stride=args.stride,
                             tokens=args.seq_len * args.sequences, progress=not args.quiet)
    print(json.dumps({"model": info["source"], **out}, indent=2))
    return 0


# --------------------------------------------------------------------------- overrep eval: benchmarks


def add_benchmark_arguments(parser) -> None:
    """The ``overrep eval`` benchmark options (see :func:`cmd_benchmarks`)."""
    from ..eval.benchmarks import BENCHMARKS
    from ..eval.lmeval import DEFAULT_BATCH_SIZE, QUICK_LIMIT

    parser.add_argument("--tasks", default="reasoning",
                        help="suites (reasoning, generation, all) and/or benchmarks, comma-separated "
                             f"(default: reasoning; benchmarks: {BENCHMARKS.choices()})")
    parser.add_argument("--limit", default="quick",
                        help=f"documents per benchmark: N, 'quick' (default: {QUICK_LIMIT['reasoning']} per reasoning, "
                             f"{QUICK_LIMIT['generation']} per generation benchmark; MMLU takes ceil(N/57) per "
                             "subject) or 'full'")
    parser.add_argument("--batch-size", default=str(DEFAULT_BATCH_SIZE), help="lm-eval batch size, or 'auto'")
    parser.add_argument("--num-fewshot", type=int, default=None,
                        help="override the paper's few-shot counts (0 reasoning/CoQA, 8 GSM8K, 5 TriviaQA)")
    parser.add_argument("--task-source", choices=("auto", "local", "hub"), default="auto",
                        help="stock lm-eval tasks from the Hugging Face hub when it is reachable, else the offline "
                             "copies (auto, the default); offline copies only (local); the hub only (hub)")
    parser.add_argument("--output", help="results JSON (default: overrep-eval/<model>-<time>.json)")
    parser.add_argument("--compare", metavar="DENSE",
                        help="a dense model's results file (or the dense model itself, evaluated with the same "
                             "settings): also print retained performance (RP)")


def cmd_benchmarks(args) -> int:
    """``overrep eval MODEL --tasks ... [--limit N] ...``: evaluate, print the table (and RP).

    ``--compare`` takes a dense model's results file, or a dense model spec, which is then
    evaluated with the same settings (its results go next to ``--output``, suffixed ``.dense``).
    """
    from ..eval.lmeval import evaluate_benchmarks, format_table, load_results
    from ..eval.retained import format_retained, retained_performance

    batch = args.batch_size
    if isinstance(batch, str):
        batch = batch if batch == "auto" else _int_arg(batch, "--batch-size")
    compare = getattr(args, "compare", None)
    dense = None
    if compare and (Path(compare).suffix == ".json" or Path(compare).is_file()):
        dense = load_results(compare)  # fail before the (long) evaluation
    settings = dict(tasks=args.tasks, limit=args.limit, batch_size=batch, num_fewshot=args.num_fewshot,
                    data=getattr(args, "task_source", "auto"), progress=not getattr(args, "quiet", False))
    results = evaluate_benchmarks(args.model, output=args.output, **settings)
    print(format_table(results))
    if compare and dense is None:
        out = Path(results["output"])
        dense = evaluate_benchmarks(compare, output=out.with_name(out.stem + ".dense.json"), **settings)
        print()
        print(format_table(dense))
    if dense is not None:
        print()
        print(format_retained(retained_performance(results, dense)))
    return 0


def _int_arg(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise OverRepError(f"{flag} must be a whole number, got '{text}'") from None


def cmd_plan(args) -> int:
    from ..model.loading import load_config
    from .plan_report import format_plan
    from .planner import PlanOptions, make_plan

    logging.getLogger("overrep.model.surgery").setLevel(logging.WARNING)  # one line per preset otherwise
    config, source = load_config(args.model)
    if args.prune == "width":
        from ..pruning.width import width_account

        if args.remove:
            raise OverRepError("--remove names blocks; width pruning takes --ratio")
        print(json.dumps({"source": source, **width_account(config, args.ratio or 0.25)}, indent=2))
        return 0
    fields = ("ratio", "remove", "preset", "blocks", "gpus", "gpu_mem", "disk", "sequences", "seq_len", "batch",
              "epochs", "cache_dtype", "dtype", "precision")
    plan = make_plan(config, PlanOptions(**{k: getattr(args, k) for k in fields if getattr(args, k) is not None}),
                     source=source)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan a run from a model config alone: removal, parameters per preset, "
                                    "memory, cache size, FLOPs and the GPU layout (no weights)")
    p.add_argument("--model", default="embedded", help="config.json file, model folder, .gguf file, 'embedded' or hub id")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ratio", type=float, help="fraction of parameters to remove (default 0.25; criterion 'last')")
    g.add_argument("--remove", help="explicit blocks to remove, e.g. 21-28")
    p.add_argument("--preset", help="built-in preset the layout is planned for (default hybrid)")
    p.add_argument("--prune", choices=("blocks", "width"), default="blocks",
                   help="width: the widths, parameters and the width preset's training state for --ratio")
    for flag, kind, text in (("blocks", int, "recovery blocks per removed run (default 2)"),
                             ("gpus", int, "GPUs (default 1)"), ("gpu-mem", str, "memory of one GPU (default 80GB)"),
                             ("disk", str, "disk the feature cache may take (default 2TB)"),
                             ("sequences", int, "training sequences (default 120000, the paper's)"),
                             ("seq-len", int, "tokens per sequence (default 1024)"),
                             ("batch", int, "sequences per optimiser step (default 8)"),
                             ("epochs", float, "passes over the data (default 20, the paper's OverRep)")):
        p.add_argument(f"--{flag}", type=kind, help=text)
    p.add_argument("--cache-dtype", choices=("float32", "bfloat16"), help="stored feature dtype (default float32)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="model weights (default float32)")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="recovery compute precision (default bf16)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def cmd_presets(args) -> int:
    from ..model.presets import BUILTIN_PRESETS

    for name, p in BUILTIN_PRESETS.items():
        print(f"{name:14s} {p.description}")
    return 0


def _ints(values: list[str] | None) -> list[int] | None:
    try:
        return None if values is None else [int(v) for v in values]
    except ValueError:
        raise OverRepError(f"--seeds must be comma-separated integers, got {','.join(values)}") from None


def cmd_compare(args) -> int:
    from .compare import Compare, CompareConfig

    split = (lambda v: [x.strip() for x in v.split(",") if x.strip()] if v else None)
    cfg = CompareConfig.load(args.config, {"output": args.output, "methods": split(args.methods),
                                           "criteria": split(args.criteria), "ratios": split(args.ratios),
                                           "budgets": split(args.budgets), "seeds": _ints(split(args.seeds))})
    if args.no_benchmarks:
        cfg.benchmarks = None
    results = Compare(cfg, progress=not args.quiet).run()
    failed = [r for r in results["rows"] if r.get("status") != "ok"]
    print(f"{len(results['rows']) - len(failed)} cells ok, {len(failed)} failed")
    print(f"table: {cfg.output}/results.md   numbers: {cfg.output}/results.json")
    return 1 if failed else 0


def cmd_methods(args) -> int:
    from ..pruning.registry import CRITERIA
    from ..recovery.methods import METHODS

    print("recovery methods (recovery.method):")
    for name, m in METHODS.items():
        print(f"  {name:12s} {m.description} [lr {m.default_lr:g}]")
    from ..recovery.losses import LOSSES

    print("layer-wise losses (recovery.loss; overrep, plain, streamline; A>B: A, then B from recovery.loss_switch):")
    for name, text in LOSSES.items():
        print(f"  {name:12s} {text}")
    from ..recovery.methods.closed_form import COMPENSATE, WARM_STARTS

    print(f"before a method starts: recovery.compensate {' | '.join(COMPENSATE)} (prunecomp: Prune&Comp's scale at "
          f"each gap, folded exactly); recovery.warm_start {' | '.join(WARM_STARTS)} (overrep, plain, streamline)")
    print("pruning criteria (prune.criterion):")
    for name, c in CRITERIA.items():
        print(f"  {name:16s} {c.description}")
    from ..model.arch import PART_ADAPTERS

    print("block parts overrep finds (architecture adapters, tried in order):")
    for name, a in PART_ADAPTERS.items():
        print(f"  {name:16s} {a.role}: {a.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ..pruning.registry import CRITERIA

    parser = argparse.ArgumentParser(prog="overrep", description="Prune decoder blocks and recover with OverRep.")
    sub = parser.add_subparsers(dest="command", required=False)
    for name, help_ in (("run", "the whole job: prune, cache, recover, merge, export, evaluate, report"),
                        ("inspect", "the pruning plan and the parameter/memory account (no training)"),
                        ("prune", "remove the blocks and export the pruned model without recovery"),
                        ("cache", "build the feature cache only"),
                        ("recover", "prune, cache, train, merge and export without baseline evaluation")):
        _common(sub.add_parser(name, help=help_))
    e = sub.add_parser("export", help="merge and export a finished training from its checkpoints")
    e.add_argument("--output", required=True)
    e.add_argument("--quiet", action="store_true")
    ev = sub.add_parser("eval", help="lm-eval benchmarks (default) or held-out perplexity of a model")
    ev.add_argument("model", help="model folder, .gguf file, hub id or 'embedded'")
    ev.add_argument("--perplexity", action="store_true", help="held-out perplexity instead of benchmarks")
    ev.add_argument("--data", help="text source for --perplexity (default: the embedded corpus)")
    ev.add_argument("--seq-len", type=int, default=256)
    ev.add_argument("--stride", type=int, default=None, help="window stride (default: --seq-len, no overlap)")
    ev.add_argument("--sequences", type=int, default=48)
    ev.add_argument("--quiet", action="store_true")
    add_benchmark_arguments(ev)
    _plan_parser(sub)
    sub.add_parser("presets", help="list the built-in presets")
    sub.add_parser("methods", help="list the recovery methods and pruning criteria")
    c = sub.add_parser("compare", help="a grid of recovery methods x pruning criteria x ratios: table and plots")
    c.add_argument("--config", help="compare YAML (base run config, methods, criteria, ratios, budgets, ...)")
    c.add_argument("--output", help="grid output folder")
    c.add_argument("--methods", help="comma-separated, overrides the file (see `overrep methods`)")
    c.add_argument("--criteria", help=f"comma-separated pruning criteria ({CRITERIA.choices()}), overrides the file")
    c.add_argument("--ratios", help="comma-separated pruning ratios, overrides the file")
    c.add_argument("--budgets", help="epochs, wallclock and/or durations such as 5m,10m (features + training), overrides the file")
    c.add_argument("--seeds", help="comma-separated recovery seeds (every cell once per seed), overrides the file")
    c.add_argument("--no-benchmarks", action="store_true", help="held-out perplexity only (skip lm-eval RP)")
    c.add_argument("--quiet", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "urllib3", "datasets", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    command = args.command or "run"
    if args.command is None:  # `overrep` alone runs the default job
        args = build_parser().parse_args(["run", *(argv or sys.argv[1:])])
    handlers = {"run": cmd_run, "inspect": cmd_inspect, "prune": cmd_prune, "cache": cmd_cache,
                "recover": lambda a: cmd_run(a, evaluate=False), "export": cmd_export, "eval": cmd_eval,
                "presets": cmd_presets, "methods": cmd_methods, "plan": cmd_plan,
                "compare": cmd_compare}
    try:
        return handlers[command](args)
    except OverRepError as e:
        print(f"overrep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("overrep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

