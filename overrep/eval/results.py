"""Benchmark results: the JSON file (written atomically), suite averages and the printed table."""

from __future__ import annotations

import datetime as _dt
import json
import re
from pathlib import Path

from ..atomic import write_json
from ..errors import OverRepError
from .benchmarks import SUITES

RESULTS_FORMAT = "overrep-benchmarks/1"


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
