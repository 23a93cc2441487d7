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

import datetime as _dt
import logging
import os
import time
from pathlib import Path

from ..errors import OverRepError
from ..model.placement import input_device
from .benchmarks import BENCHMARKS as TABLE
from .benchmarks import SELECTIONS, SUITES
from .harness import _command, _model_info, _run_benchmark, _quiet_libraries, library_versions, lm_eval_limit
from .harness import paper_value, parse_metrics  # noqa: F401  (re-exported)
from .results import RESULTS_FORMAT, default_output, format_table, load_results, suite_averages, write_results

logger = logging.getLogger(__name__)

BENCHMARKS: list[str] = list(TABLE)
"""Every benchmark name, in table order (:data:`overrep.eval.benchmarks.BENCHMARKS` holds the rows)."""
SUITE_OF: dict[str, str] = {b.name: b.suite for b in TABLE.values()}
PAPER_METRIC: dict[str, str] = {b.name: b.metric for b in TABLE.values()}
"""The metric the paper reports per benchmark (see :class:`overrep.eval.benchmarks.Benchmark`)."""
PAPER_FEWSHOT: dict[str, int] = {b.name: b.fewshot for b in TABLE.values()}

QUICK_LIMIT: dict[str, int] = {"reasoning": 200, "generation": 20, "extra": 200}
"""Documents per benchmark when ``limit="quick"`` (the default): a CPU-sized sample."""

DEFAULT_BATCH_SIZE = 4
"""Small batches pad less; on 2 CPU cores 4 was faster than 1, 2, 8 or 16."""
GPU_BATCH_SIZE = 32
"""On a GPU a small model's steps are latency-bound: larger batches are nearly free."""

__all__ = ["BENCHMARKS", "DEFAULT_BATCH_SIZE", "GPU_BATCH_SIZE", "PAPER_FEWSHOT", "PAPER_METRIC", "QUICK_LIMIT", "RESULTS_FORMAT",
           "SUITES", "SUITE_OF", "default_output", "evaluate_benchmarks", "format_table", "library_versions",
           "lm_eval_limit", "load_results", "paper_value", "parse_metrics", "plan_benchmarks", "resolve_limit",
           "resolve_tasks", "selection_limit", "suite_averages", "write_results"]


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
        elif key in SELECTIONS:
            chosen.update(SELECTIONS[key][0])
        elif key in BENCHMARKS:
            chosen.add(key)
        elif key.endswith("_local") and key[:-len("_local")] in BENCHMARKS:
            chosen.add(key[:-len("_local")])
        else:
            raise OverRepError(f"unknown benchmark or suite '{item}'; choose from: all, {', '.join(SUITES)}, "
                               f"{', '.join(SELECTIONS)}, "
                               f"{', '.join(BENCHMARKS)}")
    return [b for b in BENCHMARKS if b in chosen]


def selection_limit(tasks, limit):
    """``limit``, except that ``"quick"`` with a named selection among ``tasks`` (``rp``) means
    the selection's own size (the largest, if several are named)."""
    names = [t.strip().lower() for t in (tasks.split(",") if isinstance(tasks, str) else tasks or [])]
    sizes = [SELECTIONS[n][1] for n in names if n in SELECTIONS]
    return max(sizes) if sizes and isinstance(limit, str) and limit.lower() == "quick" else limit


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


# --------------------------------------------------------------------------- planning


def _stock_description(benchmark: str) -> tuple[str, str, str | None]:
    """(data description, evaluated split, few-shot split) of a stock task, read from its YAML."""
    from .tasks import lm_eval_tasks_dir, load_plain_yaml

    row = TABLE[benchmark]
    cfg = load_plain_yaml(lm_eval_tasks_dir() / row.stock_yaml)
    if row.dataset_name:
        cfg["dataset_name"] = row.dataset_name
    split = cfg.get("test_split") or cfg.get("validation_split") or "?"
    fewshot = cfg.get("fewshot_split") or cfg.get("training_split") or cfg.get("validation_split")
    name = f" {cfg['dataset_name']}" if cfg.get("dataset_name") else (f" ({row.subtasks} subjects)" if row.subtasks > 1 else "")
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
                        "data_id": TABLE[b].hub_data_id, "split": split, "fewshot_split": fewshot, "notes": [],
                        "n_subtasks": TABLE[b].subtasks}
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


# --------------------------------------------------------------------------- running


def evaluate_benchmarks(
    model,
    tokenizer=None,
    *,
    tasks="reasoning",
    limit="quick",
    batch_size: int | str | None = None,
    num_fewshot: int | None = None,
    output: str | Path | None = None,
    data: str = "auto",
    task_dir: str | Path | None = None,
    max_length: int | None = None,
    progress: bool = True,
    device: str = "auto",
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
        batch_size: lm-eval batch size (an int, or ``"auto"``); ``None``: :data:`DEFAULT_BATCH_SIZE`
            on a CPU, :data:`GPU_BATCH_SIZE` on a GPU.
        num_fewshot: overrides the paper's few-shot count (:data:`PAPER_FEWSHOT`) for every task.
        output: results JSON path (default ``overrep-eval/<model>-<time>.json``).
        data: ``"auto"``, ``"local"`` or ``"hub"`` (see :func:`plan_benchmarks`).
        task_dir: where the offline task folder is written (default in the overrep cache).
        max_length: context length lm-eval truncates to (default: the model's).
        progress: show lm-eval's progress bars.
        device: where a model given as a spec is loaded and scored (``"cpu"``, ``"cuda[:N]"``
            or ``"auto"``: the GPU where there is one); an in-memory model stays where it is.

    Returns:
        The results dict that was written: ``model``, ``versions``, ``settings``, ``tasks``
        (per benchmark: status, source, data, metric, value, stderr, all metrics, sample
        counts, seconds, an equivalent ``lm_eval`` command), ``suites`` (averages) and
        ``output``.
    """
    started = time.perf_counter()
    benchmarks = resolve_tasks(tasks)
    limit = selection_limit(tasks, limit)
    limits = {b: resolve_limit(limit, b) for b in benchmarks}
    if num_fewshot is not None and (not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise OverRepError(f"num_fewshot must be a whole number >= 0, got {num_fewshot!r}")
    if batch_size is not None and batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1):
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
        from ..model.runtime import resolve_device

        target = resolve_device(device)  # a wrong device fails before the model loads
        model, tokenizer, info = load_model(None if model is None else str(model))
        model.to(target)
    model.eval()
    if batch_size is None:
        batch_size = GPU_BATCH_SIZE if input_device(model).type == "cuda" else DEFAULT_BATCH_SIZE
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
                     "max_length": max_length, "device": str(input_device(model))},
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
