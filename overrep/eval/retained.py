"""Retained performance (RP), recovery ratio (RR) and strided perplexity.

* **RP** (paper): per suite, the pruned model's average of the paper's metric divided by
  the dense model's, times 100. :func:`retained_performance` takes two benchmark results
  (dicts or files from :func:`overrep.eval.lmeval.evaluate_benchmarks`), averages only over
  benchmarks that both evaluated *on the same footing* -- same documents (``data_id``),
  same few-shot count and source, same number of documents -- and lists every benchmark
  it leaves out, with the reason.
* **Paired difference** of two models on the same documents
  (:func:`paired_difference`): per benchmark the mean and standard error of the per-document
  difference of the paper's metric, and of their average (RP's numerator). Most of what makes a
  document hard is shared by two models, so the paired standard error is smaller than the two
  unpaired ones combined; it needs per-document scores (results files from this version on).
* **RR** = trainable recovery parameters / parameters of the pruned model x 100, from a
  pipeline output's ``metrics.json`` (:func:`recovery_ratio`).
* **Perplexity** with a sliding window (:func:`overrep.model.perplexity.perplexity_windows`,
  re-exported as ``perplexity``): windows of ``seq_len`` tokens advance by ``stride``; each
  token is scored once, by the first window that holds it as a prediction target, with the
  rest of that window as context. The project's row perplexity is its ``stride == seq_len``
  case.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import OverRepError
from ..model.perplexity import perplexity_windows as perplexity, sliding_windows  # noqa: F401  (one definition)
from .benchmarks import BENCHMARKS, SELECTIONS, SUITES
from .results import load_results


# --------------------------------------------------------------------------- RP


def _footing(record: dict) -> tuple:
    """What must match for two results of one benchmark to be comparable."""
    shots = record.get("num_fewshot") or 0
    return (record.get("data_id"), shots, record.get("fewshot_split") if shots else None, record.get("n_samples"))


def _describe_mismatch(p: dict, d: dict) -> str:
    names = ("documents (data_id)", "few-shot count", "few-shot source", "number of documents")
    diffs = [f"{n}: {a!r} vs {b!r}" for n, a, b in zip(names, _footing(p), _footing(d)) if a != b]
    return "not comparable (pruned vs dense " + "; ".join(diffs) + ")"


def _points(stderr) -> float | None:
    return None if stderr is None else 100 * float(stderr)


def retained_performance(pruned_results, dense_results) -> dict:
    """RP per suite: pruned average / dense average x 100 over the benchmarks both evaluated.

    Each benchmark contributes the paper's metric (:attr:`overrep.eval.benchmarks.Benchmark.metric`; the
    value stored in the results). Averages are in points (0-100).

    Returns ``{suite: {"rp", "pruned_average", "dense_average", "tasks": {benchmark:
    {"pruned", "dense", "retained", "metric"}}, "excluded": {benchmark: reason}}}`` for each
    suite with at least one benchmark in either file; ``rp`` is ``None`` when no benchmark
    is comparable (or the dense average is 0).
    """
    pruned, dense = load_results(pruned_results), load_results(dense_results)
    out = {}
    for suite, names in {**SUITES, **{k: v[0] for k, v in SELECTIONS.items()}}.items():
        present = [b for b in names if b in pruned["tasks"] or b in dense["tasks"]]
        if not present:
            continue
        used, excluded = {}, {}
        for b in present:
            p, d = pruned["tasks"].get(b), dense["tasks"].get(b)
            if p is None or d is None:
                excluded[b] = f"evaluated only for the {'dense' if p is None else 'pruned'} model"
            elif p.get("status") != "ok" or d.get("status") != "ok":
                which = "pruned" if p.get("status") != "ok" else "dense"
                rec = p if which == "pruned" else d
                excluded[b] = f"{rec.get('status')} for the {which} model: {rec.get('reason', '')}".rstrip(": ")
            elif p.get("value") is None or d.get("value") is None:
                excluded[b] = f"no {BENCHMARKS[b].metric} value"
            elif _footing(p) != _footing(d):
                excluded[b] = _describe_mismatch(p, d)
            else:
                pv, dv = 100 * float(p["value"]), 100 * float(d["value"])
                used[b] = {"pruned": pv, "dense": dv, "retained": (100 * pv / dv) if dv else None,
                           "metric": p.get("metric") or BENCHMARKS[b].metric,
                           "pruned_stderr": _points(p.get("stderr")), "dense_stderr": _points(d.get("stderr"))}
        pa = sum(v["pruned"] for v in used.values()) / len(used) if used else None
        da = sum(v["dense"] for v in used.values()) / len(used) if used else None
        out[suite] = {"rp": (100 * pa / da) if used and da else None, "pruned_average": pa, "dense_average": da,
                      "tasks": used, "excluded": excluded}
    return out


def _documents(record: dict) -> dict[str, float] | None:
    per = record.get("per_document")
    return dict(zip(per["ids"], per["values"])) if per else None


def paired_difference(a_results, b_results, dense_average: float | None = None,
                      tasks: list[str] | None = None) -> dict:
    """``a - b`` per benchmark, paired by document: both models must have scored the same
    documents (their per-document scores, :func:`overrep.eval.harness.per_document`).

    Returns ``{"tasks": {benchmark: {"difference", "stderr", "documents"}}, "average":
    {"difference", "stderr"} | None, "rp": {"difference", "stderr"} | None, "excluded":
    {benchmark: reason}}`` in points (0-100). ``average`` is over the benchmarks compared (the
    benchmarks are scored on independent documents, so their variances add); ``rp`` is that
    difference in RP points, given the dense model's average over the same ``tasks``.
    """
    a, b = load_results(a_results), load_results(b_results)
    names = tasks or [t for t in a["tasks"] if t in b["tasks"]]
    used, excluded = {}, {}
    for t in names:
        ra, rb = a["tasks"].get(t) or {}, b["tasks"].get(t) or {}
        da, db = _documents(ra), _documents(rb)
        if ra.get("status") != "ok" or rb.get("status") != "ok":
            excluded[t] = "not scored for both models"
        elif da is None or db is None:
            excluded[t] = "no per-document scores (a results file from before they were kept)"
        elif _footing(ra)[:3] != _footing(rb)[:3] or set(da) != set(db):
            excluded[t] = "the two models scored different documents"
        else:
            diff = [da[k] - db[k] for k in da]
            n = len(diff)
            mean = sum(diff) / n
            var = sum((x - mean) ** 2 for x in diff) / (n - 1) if n > 1 else float("nan")
            used[t] = {"difference": 100 * mean, "stderr": 100 * math.sqrt(var / n), "documents": n}
    average = rp = None
    if used and (tasks is None or len(used) == len(names)):
        k = len(used)
        average = {"difference": sum(v["difference"] for v in used.values()) / k,
                   "stderr": math.sqrt(sum(v["stderr"] ** 2 for v in used.values())) / k}
        if dense_average:
            rp = {key: 100 * value / dense_average for key, value in average.items()}
    return {"tasks": used, "average": average, "rp": rp, "excluded": excluded}


def format_paired(paired: dict, a: str = "model", b: str = "dense") -> str:
    """Lines: each benchmark's paired difference ``a - b`` ± its standard error."""
    lines = [f"paired by document, {a} - {b} (points ± standard error):"]
    for t, v in paired["tasks"].items():
        lines.append(f"  {t:14s} {v['difference']:+6.1f} ± {v['stderr']:.1f}   ({v['documents']} documents)")
    if paired["average"]:
        av = paired["average"]
        lines.append(f"  {'average':14s} {av['difference']:+6.1f} ± {av['stderr']:.1f}")
    for t, why in paired["excluded"].items():
        lines.append(f"  left out {t}: {why}")
    return "\n".join(lines)


def format_retained(rp: dict) -> str:
    def pm(value, se) -> str:
        return f"{value:.1f}" + ("" if se is None else f" ± {se:.1f}")

    lines = [f"{'benchmark':14s} {'metric':24s} {'pruned ± se':>12s} {'dense ± se':>12s} {'RP %':>7s}"]
    for suite, s in rp.items():
        for b, v in s["tasks"].items():
            ret = "-" if v["retained"] is None else f"{v['retained']:.1f}"
            lines.append(f"{b:14s} {v['metric']:24s} {pm(v['pruned'], v.get('pruned_stderr')):>12s} "
                         f"{pm(v['dense'], v.get('dense_stderr')):>12s} {ret:>7s}")
        if s["rp"] is None:
            lines.append(f"{suite}: RP undefined (no comparable benchmark)")
        else:
            lines.append(f"{suite}: pruned {s['pruned_average']:.1f} / dense {s['dense_average']:.1f} -> "
                         f"RP {s['rp']:.1f}% over {len(s['tasks'])} benchmark(s)")
        for b, why in s["excluded"].items():
            lines.append(f"  left out {b}: {why}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- RR


def recovery_ratio(metrics) -> dict:
    """RR = trainable recovery parameters / pruned-model parameters x 100.

    ``metrics``: a pipeline ``metrics.json`` (path), its output folder, or the dict itself;
    it must hold ``trainable_params`` and ``pruned_params``.
    """
    if not isinstance(metrics, dict):
        path = Path(metrics)
        if path.is_dir():
            path = path / "metrics.json"
        if not path.is_file():
            raise OverRepError(f"no metrics.json at '{path}' (is the pipeline run finished?)")
        try:
            metrics = json.loads(path.read_text())
        except ValueError as error:
            raise OverRepError(f"'{path}' is not valid JSON ({error})") from error
    missing = [k for k in ("trainable_params", "pruned_params") if metrics.get(k) is None]
    if missing:
        raise OverRepError(f"metrics lack {' and '.join(missing)}; RR needs a pipeline run's metrics.json")
    trainable, pruned = int(metrics["trainable_params"]), int(metrics["pruned_params"])
    if pruned <= 0:
        raise OverRepError(f"pruned_params must be positive, got {pruned}")
    return {"trainable_params": trainable, "pruned_params": pruned, "rr": 100.0 * trainable / pruned}


# --------------------------------------------------------------------------- perplexity


def heldout_perplexity(model, tokenizer, *, source: str | None = None, seq_len: int = 256,
                       stride: int | None = None, tokens: int = 256 * 48, seed: int = 42,
                       progress: bool = False) -> dict:
    """Perplexity on held-out text: ``tokens`` tokens of the test split of ``source``
    (default: the embedded corpus) as one stream, scored with windows of ``seq_len``
    advancing by ``stride`` (see :func:`perplexity`)."""
    from ..data.text import EMBEDDED, token_splits

    rows = max(1, math.ceil(tokens / seq_len))
    _, held, _, info, _ = token_splits(source or EMBEDDED, tokenizer, seq_len=seq_len, train_sequences=1,
                                       test_sequences=rows, seed=seed, progress=progress)
    stream = held.reshape(-1)[:tokens]
    out = perplexity(model, stream, seq_len, stride, progress=progress)
    out.update({"source": source or EMBEDDED, "test_fingerprint": info.get("test_fingerprint")})
    return out
