"""``overrep`` command line: the parser; what each subcommand does is in :mod:`.commands`.

    overrep run [--config FILE] [--model M] [--ratio R | --remove 21-28] [--output DIR]
                [--max-steps N] [--seed N] [--device D] [--precision P] [--data SRC]
                [--set section.field=value ...] [--resume | --overwrite]
    overrep inspect  [same options]   plan + parameter/memory account, no training
    overrep prune    [same options]   export the pruned model without recovery (a baseline)
    overrep cache    [same options]   build (or verify) the feature cache only
    overrep recover  [same options]   prune, cache, train, merge, export (no baseline evaluation)
    overrep export   RUN_DIR          merge and export a finished training from its checkpoints
    overrep eval     MODEL            lm-eval benchmarks offline (--perplexity: held-out perplexity)
    overrep plan     --model CONFIG   from a config alone: removal, parameters, memory, cache, FLOPs, layout
    overrep presets                   list the built-in presets
    overrep methods                   list the recovery methods, losses, criteria and block parts
    overrep compare  --config FILE    a grid of methods x criteria x ratios, one table and plots

``overrep`` alone prints this help. Errors print one line (``overrep: error: ...``) and exit
with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from ..errors import OverRepError
from .commands import (cmd_benchmarks, cmd_cache, cmd_compare, cmd_eval, cmd_export, cmd_inspect, cmd_methods,
                       cmd_plan, cmd_presets, cmd_prune, cmd_run)

__all__ = ["build_parser", "main", "add_benchmark_arguments", "cmd_benchmarks"]

EXAMPLES = """examples:
  overrep run                                   prune the embedded SmolLM2-135M by 25%, recover with OverRep (15 min)
  overrep run --model ./my-llama --ratio 0.25 --max-steps 500 --output runs/llama
  overrep eval runs/llama/model --compare embedded   benchmark accuracy and retained performance
"""


class _Parser(argparse.ArgumentParser):
    """argparse with overrep's one-line errors (``overrep: error: ...``, exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"overrep: error: {message} (see `{self.prog} --help`)\n")


def _common(p: argparse.ArgumentParser) -> None:
    from ..model.presets import BUILTIN_PRESETS
    from ..pruning.registry import CRITERIA
    from ..recovery.losses import LOSSES
    from ..recovery.methods import METHODS

    p.add_argument("--config", help="YAML run configuration (any subset of fields)")
    p.add_argument("--model", help="model: 'embedded', a local HF folder, a .gguf file or a hub id")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ratio", type=float, help="fraction of parameters to remove (rounded to whole blocks)")
    g.add_argument("--remove", help="explicit blocks to remove, e.g. 21-28 or 3,5,7-9")
    p.add_argument("--method", help=f"recovery method: {METHODS.choices(' | ')} (default overrep)")
    p.add_argument("--prune", choices=("blocks", "width"),
                   help="what a ratio removes: whole decoder blocks (default) or width (attention heads and MLP "
                        "channels of every block)")
    p.add_argument("--criterion", help=f"pruning criterion for --ratio: {CRITERIA.choices(' | ')} (default cosine)")
    p.add_argument("--loss", help=f"layer-wise loss: {' | '.join(LOSSES)}, or A>B (see `overrep methods`)")
    p.add_argument("--preset", help=f"recovery preset: {' | '.join(BUILTIN_PRESETS)} or a .yaml file")
    p.add_argument("--data", help="training text: embedded, c4, ptb, lambada, several joined by +, a .txt/.jsonl "
                                  "file or folder, or hf:NAME[:CONFIG] (default embedded+c4+ptb-train)")
    p.add_argument("--output", help="output folder")
    p.add_argument("--max-steps", type=int, help="recovery optimiser steps")
    p.add_argument("--time-budget", help="recover within this wall-clock (feature cache included), e.g. 20m, "
                                         "90s, 1.5h: the step count is fixed after a few measured steps (default 12m, "
                                         "cut where the whole run would pass 18 minutes; a budget set here is not cut "
                                         "unless recovery.run_limit is set too)")
    p.add_argument("--seed", type=int, help="initialisation and batch-order seed (default 0)")
    p.add_argument("--device", help="auto (default: cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"),
                   help="training precision (default auto: bf16 where the device has bf16 instructions, else fp32)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set recovery.lr=1e-4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --output")
    p.add_argument("--overwrite", action="store_true", help="replace whatever is in --output")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_benchmark_arguments(parser) -> None:
    """The ``overrep eval`` benchmark options (see :func:`cmd_benchmarks`)."""
    from ..eval.benchmarks import BENCHMARKS
    from ..eval.lmeval import DEFAULT_BATCH_SIZE, GPU_BATCH_SIZE, QUICK_LIMIT

    parser.add_argument("--tasks",
                        help="suites (reasoning, generation, extra, all), rp (the tasks a small model is above chance "
                             "on, docs/evaluation.md) and/or benchmarks, comma-separated "
                             f"(default: reasoning; benchmarks: {BENCHMARKS.choices()})")
    parser.add_argument("--limit",
                        help=f"documents per benchmark: N, 'quick' (default: {QUICK_LIMIT['reasoning']} per reasoning, "
                             f"{QUICK_LIMIT['generation']} per generation benchmark, rp's own size with --tasks rp; "
                             "MMLU takes ceil(N/57) per subject) or 'full'")
    parser.add_argument("--batch-size", help=f"lm-eval batch size, or 'auto' (default {DEFAULT_BATCH_SIZE} on a CPU, "
                                              f"{GPU_BATCH_SIZE} on a GPU)")
    parser.add_argument("--device", default="auto", help="where the model is scored: auto (default: cuda if available, "
                                                         "else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--num-fewshot", type=int, default=None,
                        help="override the paper's few-shot counts (0 reasoning/CoQA, 8 GSM8K, 5 TriviaQA)")
    parser.add_argument("--task-source", choices=("auto", "local", "hub"), default="auto",
                        help="stock lm-eval tasks from the Hugging Face hub when it is reachable, else the offline "
                             "copies (auto, the default); offline copies only (local); the hub only (hub)")
    parser.add_argument("--output", help="results JSON (default: overrep-eval/<model>-<time>.json)")
    parser.add_argument("--compare", metavar="DENSE",
                        help="a dense model's results file (or the dense model itself, evaluated with the same "
                             "settings): also print retained performance (RP)")


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
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), help="model weights (default auto: bf16 on GPUs)")
    p.add_argument("--nodes", type=int, help="machines the --gpus are spread over (default 1)")
    p.add_argument("--data", help="the command's data.source (default the paper's FineWeb-Edu)")
    p.add_argument("--run-model", help="the model folder or hub id the printed command runs (default --model)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"),
                   help="recovery compute precision (default auto, counted as bf16: a plan targets GPUs)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def build_parser() -> argparse.ArgumentParser:
    from ..pruning.registry import CRITERIA
    from ..recovery.methods import METHODS

    parser = _Parser(prog="overrep", description="Prune decoder blocks and recover with OverRep.",
                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"overrep {__version__}")
    sub = parser.add_subparsers(dest="command", required=False, metavar="COMMAND")
    for name, help_ in (("run", "the whole job: prune, cache, recover, merge, export, evaluate, report"),
                        ("inspect", "the pruning plan and the parameter/memory account (no training)"),
                        ("prune", "remove the blocks and export the pruned model without recovery"),
                        ("cache", "build the feature cache only (--clean: remove the caches a larger one serves)"),
                        ("recover", "prune, cache, train, merge and export without baseline evaluation")):
        sp = sub.add_parser(name, help=help_, description=help_)
        _common(sp)
        if name == "cache":
            sp.add_argument("--clean", action="store_true",
                            help="build nothing: remove the feature caches (under cache.dir) whose rows a larger cache "
                                 "of the same rows holds, never one a run is using")
            sp.add_argument("--dry-run", action="store_true", help="--clean: list what it would remove")
    e = sub.add_parser("export", help="merge and export a finished training from its checkpoints")
    e.add_argument("run", nargs="?", help="the run's output folder")
    e.add_argument("--output", help=argparse.SUPPRESS)  # the old spelling of RUN (it named the input folder)
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    ev = sub.add_parser("eval", help="lm-eval benchmarks (default) or held-out perplexity of a model")
    ev.add_argument("model", help="model folder, .gguf file, hub id or 'embedded'")
    ev.add_argument("--perplexity", action="store_true", help="held-out perplexity instead of benchmarks")
    ev.add_argument("--data", help="--perplexity: text source (default: the embedded corpus)")
    ev.add_argument("--seq-len", type=int, help="--perplexity: tokens per window (default 256)")
    ev.add_argument("--stride", type=int, help="--perplexity: window stride (default: --seq-len, no overlap)")
    ev.add_argument("--sequences", type=int, help="--perplexity: windows scored (default 48)")
    ev.add_argument("--quiet", action="store_true", help="no progress bars")
    add_benchmark_arguments(ev)
    _plan_parser(sub)
    sub.add_parser("presets", help="list the built-in presets")
    sub.add_parser("methods", help="list the recovery methods, losses, pruning criteria and block parts")
    c = sub.add_parser("compare", help="a grid of recovery methods x pruning criteria x ratios: table and plots")
    c.add_argument("--config", help="compare YAML (base run config, methods, criteria, ratios, budgets, ...)")
    c.add_argument("--output", help="grid output folder")
    c.add_argument("--methods", help=f"comma-separated, overrides the file ({METHODS.choices()})")
    c.add_argument("--criteria", help=f"comma-separated pruning criteria ({CRITERIA.choices()}), overrides the file")
    c.add_argument("--ratios", help="comma-separated pruning ratios, overrides the file")
    c.add_argument("--plans", help="comma-separated criterion:ratio pairs such as cosine:0.5,block-influence:0.25: "
                                   "these plans instead of the file's (not with --criteria / --ratios)")
    c.add_argument("--budgets", help="epochs, wallclock and/or durations such as 5m,10m (features + training), "
                                     "overrides the file")
    c.add_argument("--seeds", help="comma-separated recovery seeds (every cell once per seed), overrides the file")
    c.add_argument("--no-benchmarks", action="store_true", help="held-out perplexity only (skip lm-eval RP)")
    c.add_argument("--cached-benchmarks", action="store_true", help="RP only for the models the grid has already "
                                                                     "scored; score nothing new")
    c.add_argument("--collect-only", action="store_true", help="run no cell: tables from the finished ones, the "
                                                                "others listed as not run")
    c.add_argument("--into", metavar="DOC", help="also write the tables into DOC (a markdown page), between its "
                                                 "'<!-- compare: SECTION -->' line and the next '<!-- /compare -->', "
                                                 "and the plots beside it (img/)")
    c.add_argument("--section", default="results", help="--into: the page's block to write (default: results)")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:  # `overrep` alone: what it can do, not a 15-minute job
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "urllib3", "datasets", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    handlers = {"run": cmd_run, "inspect": cmd_inspect, "prune": cmd_prune, "cache": cmd_cache,
                "recover": lambda a: cmd_run(a, evaluate=False), "export": cmd_export, "eval": cmd_eval,
                "presets": cmd_presets, "methods": cmd_methods, "plan": cmd_plan,
                "compare": cmd_compare}
    try:
        if args.command == "export":
            _export_folder(args)
        return handlers[args.command](args)
    except OverRepError as e:
        print(f"overrep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("overrep: interrupted", file=sys.stderr)
        return 130


def _export_folder(args) -> None:
    """``overrep export RUN``; the old ``--output RUN`` still works, with a note naming the new form."""
    if args.run and args.output and args.run != args.output:
        raise OverRepError("give the run folder once: `overrep export RUN_DIR`")
    if args.output and not args.run:
        logging.getLogger("overrep").warning("`overrep export --output DIR` is now `overrep export DIR`")
    args.run = args.run or args.output
    if not args.run:
        raise OverRepError("name the run folder to export: `overrep export RUN_DIR`")


if __name__ == "__main__":
    sys.exit(main())
