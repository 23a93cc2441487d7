"""What each ``overrep`` subcommand does, given its parsed arguments (the parser: :mod:`.cli`).

Each ``cmd_*`` function returns the exit status; user errors raise :class:`OverRepError`,
which :func:`overrep.app.cli.main` prints as one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import OverRepError
from ..paths import cache_root

#: ``overrep run`` flag -> the config field it sets (every flag is also reachable with --set)
FLAG_FIELDS = (("model", "model.source"), ("preset", "recovery.preset"), ("output", "output"),
               ("max_steps", "recovery.steps"), ("time_budget", "recovery.time_budget"),
               ("method", "recovery.method"), ("loss", "recovery.loss"), ("criterion", "prune.criterion"),
               ("prune", "prune.granularity"), ("seed", "recovery.seed"), ("device", "model.device"),
               ("precision", "recovery.precision"), ("data", "data.source"))


def _refuse_contradictions(args) -> None:
    """Flags that ask for two incompatible things are refused, never silently resolved."""
    pairs = (("resume", "overwrite", "--resume continues the run in --output, --overwrite replaces it"),
             ("max_steps", "time_budget", "--max-steps and --time-budget both fix the step count"),
             ("criterion", "remove", "--criterion chooses the blocks a --ratio removes, --remove names them"))
    for a, b, why in pairs:
        if getattr(args, a, None) not in (None, False) and getattr(args, b, None) not in (None, False):
            raise OverRepError(f"{why}; give one")


def _config(args):
    from .config import RunConfig

    _refuse_contradictions(args)
    overrides = list(args.set)
    given = {item.split("=", 1)[0].strip() for item in overrides}
    for flag, key in FLAG_FIELDS:
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
    r = cfg.recovery
    # the account of what trains: from the plan, or from the method built (on a width plan: no
    # config-only path yet; a method that trains something other than recovery modules)
    built = p.width or not r.method_entry.planned_account
    if built:
        p.prepare(with_data=False, create_output=False)
    else:
        p.load(create_output=False)
    if p.width:
        m = p.metrics
        print(json.dumps({"model": p.model_info["source"], "method": p.method.name, "granularity": "width",
                          "criterion": cfg.prune.width_criterion, "widths": m["widths"],
                          "dense_params": m["dense_params"], "compact_params": m["pruned_params"],
                          "param_fraction_removed_head_counted": m["param_fraction_removed_head_counted"],
                          "trainable_params": p.recovery.trainable_params, "total_steps": p.total_steps}, indent=2))
        return 0
    r = p.rcfg  # as the run trains it (the auto warm start's layout resolved)
    acc = recovery_account(p.dense.config, p.selection.removed, r.preset_name, blocks=r.blocks_per_run,
                           block1_init=r.block1_layout, final_block=r.final_block)
    acc.update(model=p.model_info["source"], method=p.method.name, criterion=cfg.prune.criterion,
               criterion_scores=p.selection.scores, total_steps=p.total_steps)
    if built:
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
    if args.clean:
        return _clean_caches(Path(cfg.cache.dir) if cfg.cache.dir else cache_root(), args.dry_run)
    if args.dry_run:
        raise OverRepError("--dry-run goes with --clean")
    cfg.cache.mode = "disk"
    p = Pipeline(cfg, reuse=True, overwrite=args.overwrite, progress=not args.quiet)
    p.prepare_output()
    with p.output_guard():
        p.load()
        p.prune()
        p.features()
    print(json.dumps(p.metrics["cache"], indent=2))
    return 0


def _clean_caches(root: Path, dry_run: bool) -> int:
    """``overrep cache --clean``: the feature caches a larger one of the same rows serves."""
    from ..data.cache.prefix import clean
    from ..recovery.teacher import ROWS_KEY

    done = clean(root / "features", ROWS_KEY, dry_run=dry_run)
    for d in done:
        print(f"{d['action']:>12}  {d['bytes'] / 2**30:6.2f} GiB  {d['folder']}: {d['why']}")
    freed = sum(d["bytes"] for d in done if d["action"] in ("removed", "would remove"))
    kept = sum(d["action"] == "kept" for d in done)
    print(f"{'would free' if dry_run else 'freed'} {freed / 2**30:.2f} GiB in {root / 'features'}"
          + (f"; {kept} kept (listed above)" if kept else "") if done else f"nothing to remove in {root / 'features'}")
    return 0


def cmd_export(args) -> int:
    from .config import RunConfig
    from .pipeline import Pipeline

    out = Path(args.run)
    if not (out / "config.yaml").is_file():
        raise OverRepError(f"'{out}' is not an overrep output folder (no config.yaml)")
    cfg = RunConfig.load(out / "config.yaml")
    cfg.output = str(out)  # the folder as it is named now, wherever the run wrote it
    p = Pipeline(cfg, resume=True, progress=not args.quiet)
    p.prepare_output()
    with p.output_guard():  # the folder is this command's until it ends
        p.prepare(with_data=False)  # a budgeted run's step count: read from its checkpoints
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
    ppl_only = [f for f in ("data", "seq_len", "stride", "sequences") if getattr(args, f) is not None]
    bench_only = [f for f in ("tasks", "limit", "num_fewshot", "compare") if getattr(args, f) is not None]
    if args.perplexity and bench_only:
        raise OverRepError(f"--{bench_only[0].replace('_', '-')} is a benchmark option; --perplexity measures "
                           "perplexity only")
    if not args.perplexity and ppl_only:
        raise OverRepError(f"--{ppl_only[0].replace('_', '-')} is a perplexity option; add --perplexity")
    if not args.perplexity:
        return cmd_benchmarks(args)
    args.seq_len = args.seq_len or 256
    args.sequences = args.sequences or 48
    from ..model.loading import load_model
    from ..eval.retained import heldout_perplexity

    model, tok, info = load_model(args.model)
    out = heldout_perplexity(model, tok, source=args.data, seq_len=args.seq_len, stride=args.stride,
                             tokens=args.seq_len * args.sequences, progress=not args.quiet)
    print(json.dumps({"model": info["source"], **out}, indent=2))
    return 0


def cmd_benchmarks(args) -> int:
    """``overrep eval MODEL --tasks ... [--limit N] ...``: evaluate, print the table (and RP).

    ``--compare`` takes a dense model's results file, or a dense model spec, which is then
    evaluated with the same settings (its results go next to ``--output``, suffixed ``.dense``).
    """
    from ..eval.lmeval import evaluate_benchmarks, format_table, load_results
    from ..eval.retained import format_paired, format_retained, paired_difference, retained_performance

    args.tasks, args.limit = args.tasks or "reasoning", args.limit or "quick"
    batch = args.batch_size
    if isinstance(batch, str):
        batch = batch if batch == "auto" else _int_arg(batch, "--batch-size")
    compare = getattr(args, "compare", None)
    dense = None
    if compare and (Path(compare).suffix == ".json" or Path(compare).is_file()):
        dense = load_results(compare)  # fail before the (long) evaluation
    settings = dict(tasks=args.tasks, limit=args.limit, batch_size=batch, num_fewshot=args.num_fewshot,
                    data=getattr(args, "task_source", "auto"), progress=not getattr(args, "quiet", False),
                    device=getattr(args, "device", None) or "auto")
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
        paired = paired_difference(results, dense)
        if paired["tasks"]:
            print()
            print(format_paired(paired))
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
              "epochs", "cache_dtype", "dtype", "precision", "nodes", "data", "run_model")
    if args.run_model is None and not str(args.model).endswith(".json"):
        args.run_model = args.model  # the command runs the model the plan read
    plan = make_plan(config, PlanOptions(**{k: getattr(args, k) for k in fields if getattr(args, k) is not None}),
                     source=source)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


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


def _plans(value: str | None) -> list[list] | None:
    """``--plans cosine:0.5,block-influence:0.25`` as ``[["cosine", 0.5], ["block-influence", 0.25]]``."""
    if not value:
        return None
    plans = []
    for item in (x.strip() for x in value.split(",") if x.strip()):
        criterion, _, ratio = item.rpartition(":")
        try:
            plans.append([criterion, float(ratio)])
        except ValueError:
            criterion = ""
        if not criterion:
            raise OverRepError(f"--plans takes criterion:ratio pairs such as cosine:0.5, got '{item}'")
    return plans


def cmd_compare(args) -> int:
    from .compare import NOT_RUN, Compare, CompareConfig

    split = (lambda v: [x.strip() for x in v.split(",") if x.strip()] if v else None)
    cfg = CompareConfig.load(args.config, {"output": args.output, "methods": split(args.methods),
                                           "criteria": split(args.criteria), "ratios": split(args.ratios),
                                           "budgets": split(args.budgets), "seeds": _ints(split(args.seeds)),
                                           "plans": _plans(args.plans)})
    if args.no_benchmarks:
        cfg.benchmarks = None
    if args.no_benchmarks and args.cached_benchmarks:
        raise OverRepError("--no-benchmarks and --cached-benchmarks exclude each other")
    if args.cached_benchmarks and not cfg.benchmarks:
        raise OverRepError("--cached-benchmarks needs the grid's `benchmarks:` setting (the results it names)")
    if args.into:  # a page without the block fails now, not after the grid
        from .compare_report import page_block

        page_block(Path(args.into), args.section)
    results = Compare(cfg, progress=not args.quiet, collect_only=args.collect_only,
                      cached_benchmarks=args.cached_benchmarks).run()
    failed = [r for r in results["rows"] if r.get("status") not in ("ok", NOT_RUN)]
    waiting = sum(r.get("status") == NOT_RUN for r in results["rows"])
    print(f"{len(results['rows']) - len(failed) - waiting} cells ok, {len(failed)} failed"
          + (f", {waiting} not run (--collect-only)" if waiting else ""))
    print(f"table: {cfg.output}/results.md   numbers: {cfg.output}/results.json")
    if args.into:
        from .compare_report import write_into

        page = write_into(Path(args.into), Path(cfg.output), results, _compare_command(args), args.section)
        print(f"tables and plots written into {page}")
    return 1 if failed else 0


def _compare_command(args) -> str:
    """The ``overrep compare`` command line that wrote a page's tables (for the page)."""
    parts = ["overrep compare"] + [f"--{k.replace('_', '-')} {v}" for k in ("config", "methods", "criteria", "ratios",
                                                                          "plans", "budgets", "seeds", "output", "into")
                                   if (v := getattr(args, k))]
    if args.into and args.section != "results":
        parts.append(f"--section {args.section}")
    return " ".join(parts + (["--no-benchmarks"] if args.no_benchmarks else [])
                    + (["--cached-benchmarks"] if args.cached_benchmarks else [])
                    + (["--collect-only"] if args.collect_only else []))


def cmd_methods(args) -> int:
    from ..pruning.registry import CRITERIA
    from ..recovery.methods import METHODS

    print("recovery methods (recovery.method):")
    for name, m in METHODS.items():
        print(f"  {name:12s} {m.description} [lr {m.default_lr:g}]")
    from ..recovery.losses import LOSSES

    layerwise = ", ".join(n for n, m in METHODS.items() if m.objective == "layerwise")
    print(f"layer-wise losses (recovery.loss; {layerwise}; A>B: A, then B from recovery.loss_switch):")
    for name, loss in LOSSES.items():
        print(f"  {name:12s} {loss.description}")
    from ..recovery.methods.closed_form import AUTO, COMPENSATE, WARM_STARTS

    auto = ", ".join(n + (f" up to {m.auto_warm_max_steps} steps" if m.auto_warm_max_steps else "")
                     for n, m in METHODS.items() if m.auto_warm_start)
    print(f"before a method starts: recovery.compensate {' | '.join(COMPENSATE)} (prunecomp: Prune&Comp's scale at "
          f"each gap, folded exactly); recovery.warm_start {' | '.join(WARM_STARTS)} (any method that trains) | {AUTO} "
          f"(replaceme for {auto} where the fit applies and a time budget leaves it 20 steps, else none; overrep "
          "then trains hybrid-linear and, on a mask of one run with two blocks after it, block 1 retained with three "
          "blocks)")
    print("pruning criteria (prune.criterion):")
    for name, c in CRITERIA.items():
        print(f"  {name:16s} {c.description}")
    from ..model.arch import PART_ADAPTERS

    print("block parts overrep finds (architecture adapters, tried in order):")
    for name, a in PART_ADAPTERS.items():
        print(f"  {name:16s} {a.role}: {a.description}")
    return 0
