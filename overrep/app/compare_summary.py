"""Summaries across the cells of an ``overrep compare`` grid: the whole grid at a glance (each
method's mean over its seeds at every budget), and the warm start against the cold one."""

from __future__ import annotations

import math
import statistics

from ..recovery.methods.closed_form import COLD_STARTS
from .compare_config import FREE as FREE_BUDGET


def fmt_ppl(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.3g}" if v < 1e4 else f"{v:.2e}"


def over_budget(row: dict) -> bool:
    """A cell that used more than its budget's +2% (the protocol's tolerance)."""
    used, budget = row.get("used_seconds"), row.get("budget_seconds")
    return bool(used and budget and used > 1.02 * budget)


#: a grid variant started from the closed form is named after its cold method with this suffix
WARM_SUFFIX = "-warm"


def _started(row: dict, warm: bool) -> bool:
    """The cell started as its name says (a cell from before runs recorded it: trusted)."""
    used = row.get("warm_start")
    return used is None or (used != "none") == warm


def started_cold(row: dict) -> bool:
    """A ``-warm`` cell that ``recovery.warm_start: auto`` started cold (its budget left the warm start
    too few steps, or its mask is one where the warm start measured worse): a cold start under the
    warm start's name."""
    return row["method"].endswith(WARM_SUFFIX) and not _started(row, True)


def cold_reason(row: dict) -> str:
    """Why ``auto`` started a :func:`started_cold` cell cold, in a few words: from the code its
    run recorded (``metrics.json``'s ``warm_start.cold``; the run's own sentence is ``warm_start.why``)."""
    if row.get("cold_code") in COLD_STARTS:
        return COLD_STARTS[row["cold_code"]]
    # a cell whose run recorded no code (older code): from its sentence
    why = row.get("cold_because") or ""
    if "separate runs" in why:
        return "a mask of several runs"
    if "time budget" in why:
        return "too short for the warm start"
    return "auto's choice"


def _perplexities(rows: list[dict]) -> list[float]:
    """The test perplexities of the seeds that finished."""
    return [r["ppl"] for r in rows if r.get("status") == "ok" and r.get("ppl") is not None]


def rp_value(row: dict) -> float | None:
    """A scored cell's RP over every task the grid scored (the ``rp`` selection), else the reasoning suite's."""
    rp = row.get("rp") or {}
    return rp.get("rp", rp.get("reasoning"))


def _glance_cell(rows: list[dict], best: bool) -> str:
    """Mean test perplexity over the cells' seeds, their range and number; refused or failed
    seeds counted, a cell over its budget flagged, a ``-warm`` cell that ``warm_start: auto``
    started cold said so, and the mean RP of the seeds scored on the benchmarks."""
    ok = _perplexities(rows)
    failed = len(rows) - len(ok)
    if not ok:
        return f"failed ({failed} of {len(rows)})"
    mean = fmt_ppl(statistics.mean(ok))
    text = f"**{mean}**" if best else mean
    text += f" ({fmt_ppl(min(ok))}–{fmt_ppl(max(ok))}, n={len(ok)})" if len(ok) > 1 else " (n=1)"
    if failed:
        text += f", {failed} failed"
    cold = [r for r in rows if r.get("status") == "ok" and started_cold(r)]
    if cold:
        why = "; ".join(dict.fromkeys(cold_reason(r) for r in cold))
        text += f", started cold: {why} ({len(cold)} of {len(ok)})"
    rp = [v for r in rows if r.get("status") == "ok" and (v := rp_value(r)) is not None]
    if rp:
        text += f"; RP {statistics.mean(rp):.1f}" + (f" (n={len(rp)})" if len(rp) < len(ok) else "")
    return text + (" **over budget**" if any(over_budget(r) for r in rows) else "")


def at_a_glance(results: dict) -> list[str]:
    """The grid in one table: a row per plan and method, a column per budget (the closed forms,
    which train nothing, in a column of their own), each entry the mean test perplexity over the
    seeds that ran with their range and number; the lowest mean of each column in bold. Lines
    of markdown, none for a grid of one entry."""
    cfg = results["config"]
    done = [r for r in results["rows"] if r.get("status") != "not run"]
    columns = [b for b in cfg["budgets"] if b != FREE_BUDGET and any(r["budget"] == b for r in done)]
    columns += [FREE_BUDGET] if any(r["budget"] == FREE_BUDGET for r in done) else []  # once, last
    order = {m: i for i, m in enumerate(cfg.get("methods") or [])}
    plans = sorted({(r["criterion"], r["ratio"]) for r in done},
                   key=lambda p: (cfg["criteria"].index(p[0]) if p[0] in cfg["criteria"] else len(cfg["criteria"]), p[1]))
    cells: dict[tuple, list[dict]] = {}
    for r in done:
        cells.setdefault((r["criterion"], r["ratio"], r["method"], r["budget"]), []).append(r)
    if len(cells) < 2:
        return []

    def mean(key):
        ok = _perplexities(cells.get(key, []))
        return statistics.mean(ok) if ok else math.inf

    names = {FREE_BUDGET: "no training (fit)"}
    lines = ["## The grid at a glance", "",
             "Test perplexity, the mean over the seeds each cell ran (their range, and how many); the lowest "
             "mean of each plan's column in bold; RP: the mean retained performance of the seeds scored on the "
             "benchmarks (how many, where not all were); started cold: seeds of a `-warm` method that "
             "`recovery.warm_start: auto` started cold, and why (its budget left the warm start too few steps, "
             "or its mask removes several separate runs, where the warm start measured worse). "
             "The tables that follow give every seed with its interval, its paired ratio to the dense model, "
             "each domain, the seconds it used and the validation figure that choices read.", "",
             "| plan | method | " + " | ".join(names.get(b, b) for b in columns) + " |",
             "|---|---|" + "---:|" * len(columns)]
    for criterion, ratio in plans:
        methods = sorted({m for c, q, m, _ in cells if (c, q) == (criterion, ratio)},
                         key=lambda m: (order.get(m, len(order)), m))
        best = {b: min((mean((criterion, ratio, m, b)) for m in methods), default=math.inf) for b in columns}
        for m in methods:
            entries = []
            for b in columns:
                key = (criterion, ratio, m, b)
                entries.append(_glance_cell(cells[key], mean(key) == best[b] < math.inf) if key in cells else "")
            lines.append(f"| {criterion} {ratio:g} | {m} | " + " | ".join(entries) + " |")
    return lines + [""]


def warm_against_cold(groups: list) -> list[str]:
    """Each method run both cold and warm (``X`` and ``X-warm``) on the same seeds of a table:
    mean validation and test perplexity of each, and on how many seeds the warm start was the
    better on validation (what a choice reads); lines of markdown, none where no pair ran. A
    ``-warm`` cell that started cold (``warm_start: auto`` decided so) is not a pair."""
    table = []
    for criterion, ratio, budget, rows in groups:
        ok = {(r["method"], r.get("seed", 0)): r for r in rows if r.get("status") == "ok" and r.get("val_ppl")}
        for warm in sorted({m for m, _ in ok if m.endswith(WARM_SUFFIX)}):
            cold = warm[:-len(WARM_SUFFIX)]
            seeds = sorted(s for m, s in ok if m == warm and (cold, s) in ok and _started(ok[(warm, s)], True)
                           and _started(ok[(cold, s)], False))
            if not seeds:
                continue
            pair = [(ok[(cold, s)], ok[(warm, s)]) for s in seeds]
            val = [statistics.mean(x[k]["val_ppl"] for x in pair) for k in (0, 1)]
            test = [statistics.mean(x[k]["ppl"] for x in pair) for k in (0, 1)]
            wins = sum(w["val_ppl"] < c["val_ppl"] for c, w in pair)
            table.append(f"| {criterion} {ratio:g} | {budget} | {cold} | {', '.join(map(str, seeds))} | "
                         f"{fmt_ppl(val[0])} → {fmt_ppl(val[1])} | {100 * (val[1] / val[0] - 1):+.0f}% | "
                         f"{wins} of {len(seeds)} | {fmt_ppl(test[0])} → {fmt_ppl(test[1])} |")
    if not table:
        return []
    return ["## The warm start against the cold one", "",
            "Each method the grid ran both cold and from the closed form (`X` and `X-warm`), on the seeds both "
            "ran: mean perplexity over those seeds, cold → warm; the change and the seeds on which the warm start "
            "was better are read on validation, which is what a choice of start may read.", "",
            "| plan | budget | method | seeds | validation, cold → warm | change | warm better (validation) "
            "| test, cold → warm |", "|---|---|---|---|---:|---:|---:|---:|", *table, ""]
