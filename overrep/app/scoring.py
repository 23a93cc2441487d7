"""The figures of one model in a run: held-out perplexity with intervals (paired with the
dense model's), the generation check, latency and lm-eval benchmarks with retained
performance, each read from the run's cache where the same model was scored before.

What each model's figures cost to compute is kept (``Pipeline.eval_cost``, cached figures at
what they cost when computed): a whole-run limit (``recovery.run_limit``) predicts the final
evaluation from the dense model's.
"""

from __future__ import annotations

import logging
import time

from ..core.precision import resolve_precision
from ..eval.figures import figures_path, model_benchmarks, model_figures
from ..eval import reference
from ..eval.measure import generation_latency
from ..eval.retained import retained_performance
from ..model import onload
from ..model.wrap import count_parameters
from .budgeting import row_sets, unrecovered_rows

log = logging.getLogger("overrep.app.pipeline")


def unrecovered_data(p, model, precision: str):
    """The rows pipeline ``p``'s unrecovered ``model`` is scored on (``eval.unrecovered``;
    ``auto``: :func:`~overrep.app.budgeting.unrecovered_rows`, the test rows read back where
    they are cached); what ``auto`` left out goes to ``metrics.json`` as ``unrecovered_rows``."""
    setting, d = p.cfg.eval.unrecovered, p.eval_data
    if setting == "all":
        return d
    if setting == "test" or not d.validation.shape[0]:  # (validation without rows: refused by the config)
        return d.baseline()
    why = "eval.unrecovered: validation"
    if setting == "auto":
        if figures_path(model, d.baseline(), tag="pruned", source=p.model_info["source"], mask=p.plan.to_dict(),
                        root=p.cache_root, precision=precision).is_file():
            return d.baseline()
        scored, why = unrecovered_rows(p)
        if scored == "test":
            return d.baseline()
    log.info("unrecovered model: validation rows only: %s", why)
    p.metrics["unrecovered_rows"] = {"setting": setting, "scored": "validation", "why": why}
    return d.validation_only()


def score_model(p, model, tag: str) -> None:
    """Pipeline ``p``'s figures of ``model`` ("dense", "pruned" or "recovered") into
    ``p.metrics``, its time into ``p.timings`` and its cost into ``p.eval_cost`` (None where a
    cached part predates its cost being recorded). Rank 0 only."""
    if not p.world.is_main:
        return
    ev = p.cfg.eval
    t0, cost = time.perf_counter(), 0.0  # cost: what the figures cost to compute, cached ones included
    mask, root = tag != "dense" and p.plan.to_dict(), None if tag == "recovered" else p.cache_root
    if ev.perplexity:  # with intervals, and the pruned and recovered models paired with the dense one
        p.metrics["eval_precision"] = precision = resolve_precision(ev.precision, p.device)
        data = unrecovered_data(p, model, precision) if tag == "pruned" else p.eval_data
        # the unrecovered model's rows time this machine (budgeting.measured_pace): from which block
        # it runs each set is known before scoring, as a model scored whole then keeps their states
        sets = row_sets(p, model, data) if tag == "pruned" else None
        entries, scores, scored_here = model_figures(  # raises on a non-finite perplexity
            model, p.tokenizer, data, tag=tag, progress=p.progress, source=p.model_info["source"], mask=mask,
            root=root, dense=p.dense_scores, precision=precision, prefix=p.shared_prefix,
            shipped=(lambda: reference.shipped_scores(model, data, p.model_info, precision))
            if tag == "dense" and ev.dense_reference else None)
        p.metrics.update(entries)
        if tag == "dense":
            p.metrics["dense_reference"] = reference.describe(scores)
        p.dense_scores = scores if tag == "dense" else p.dense_scores
        cost = scores.get("seconds")  # None: cached before that was recorded
        p.eval_rows_cost[tag] = scores.get("seconds_rows")
        if sets is not None and scored_here and scores.get("seconds_rows"):
            p.eval_rows_timed[tag] = (scores["seconds_rows"], sets)
    if ev.latency and not onload.is_onloaded(model):  # generating would read every block per token
        t1 = time.perf_counter()
        lat = generation_latency(model, p.tokenizer, ev.sample_prompt, ev.latency_tokens)
        p.metrics[f"{tag}_latency_s_per_token"] = lat["seconds_per_token"]
        p.metrics.setdefault("samples", {})[tag] = lat["text"]
        cost = None if cost is None else cost + time.perf_counter() - t1
    if ev.benchmarks and not onload.is_onloaded(model):
        results = model_benchmarks(model, p.tokenizer, tasks=ev.benchmarks, limit=ev.benchmark_limit,
                                   output=p.out / "benchmarks" / f"{tag}.json", progress=p.progress,
                                   source=p.model_info["source"], mask=mask, root=root)
        p.benchmark_results[tag] = results
        cost = None if cost is None or results.get("seconds") is None else cost + results["seconds"]
        p.metrics.setdefault("benchmarks", {})[tag] = {
            b: r.get("value") for b, r in results["tasks"].items() if r.get("status") == "ok"}
        if tag != "dense" and "dense" in p.benchmark_results:
            rp = retained_performance(results, p.benchmark_results["dense"])
            p.metrics.setdefault("retained_performance", {})[tag] = {
                suite: v.get("rp") for suite, v in rp.items()}
    p.metrics[f"{tag}_params"] = count_parameters(model)
    p.timings[f"eval_{tag}"] = time.perf_counter() - t0
    p.eval_cost[tag] = cost
