"""``results.md`` and plots of an ``overrep compare`` grid."""

from __future__ import annotations

import math
import re
import shutil
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from ..atomic import write_file, write_text  # noqa: E402
from ..errors import OverRepError  # noqa: E402
from .compare_config import FREE as FREE_BUDGET  # noqa: E402
from .compare_summary import (at_a_glance, cold_reason, fmt_ppl, over_budget, rp_value, started_cold,  # noqa: E402
                              warm_against_cold)


def _groups(results: dict) -> list[tuple[str, float, str, list[dict]]]:
    """(criterion, ratio, budget, rows) tables; a wall-clock table starts with the reference's
    epoch row, which defines the budget."""
    cfg = results["config"]
    rows = results["rows"]
    out = []
    for criterion in cfg["criteria"]:
        for ratio in cfg["ratios"]:
            for budget in cfg["budgets"]:
                sel = [r for r in rows if r["criterion"] == criterion and r["ratio"] == ratio
                       and r["budget"] == budget]
                if budget != FREE_BUDGET:  # the closed forms: 0 s of training, in every table (once)
                    sel += [r for r in rows if r["criterion"] == criterion and r["ratio"] == ratio
                            and r["budget"] == FREE_BUDGET]
                if budget == "wallclock":
                    ref = [r for r in rows if r["criterion"] == criterion and r["ratio"] == ratio
                           and r["budget"] == "epochs" and r["method"] == cfg["reference"]]
                    sel = ref + sel
                if sel:
                    out.append((criterion, ratio, budget, sel))
    return out


def _trained_result(row: dict) -> bool:
    """A cell of a method that trains and has run (finished or failed)."""
    return row.get("budget") != FREE_BUDGET and row.get("status") != "not run"


def _idle(groups: list) -> set[tuple[str, float, str]]:
    """The (criterion, ratio, budget) tables with nothing trained yet in a plan that trained at
    another budget: a line in the page and no plot panel, since the closed forms, which every
    table of a plan repeats, are already in its other tables."""
    trained = {(c, q) for c, q, _, rows in groups if any(_trained_result(r) for r in rows)}
    return {(c, q, b) for c, q, b, rows in groups
            if (c, q) in trained and not any(_trained_result(r) for r in rows)}


def _gb(v) -> str:
    return "–" if v is None else f"{v / 2**30:.2f}"


def _steps(row: dict) -> str:
    """Steps trained, and the one ``recovery.keep_best`` kept when it was an earlier one."""
    kept = row.get("kept_step")
    return f"{row['steps']}" if kept in (None, row["steps"]) else f"{row['steps']} (kept {kept})"


def _rp(row: dict) -> str:
    """RP over every task the grid scored (the ``rp`` selection's five), else the reasoning suite's."""
    value = rp_value(row)
    return "–" if value is None else f"{value:.1f}"


def _acc(row: dict, task: str) -> str:
    value, se = (row.get("benchmarks") or {}).get(task), (row.get("benchmark_stderr") or {}).get(task)
    return "–" if value is None else f"{100 * value:.1f}" + ("" if se is None else f" ± {100 * se:.1f}")


def benchmark_table(rows: list[dict], dense: dict, pruned: dict | None) -> list[str]:
    """Accuracy ± standard error per task and RP, for the dense, pruned and recovered models."""
    scored = [r for r in rows if r.get("status") == "ok" and r.get("benchmarks")]
    if not scored or not dense.get("benchmarks"):
        return []
    tasks = list(dense["benchmarks"])
    paired = any(r.get("rp_vs_best") for r in scored)
    extra = " RP − best (paired) |" if paired else ""
    lines = ["", "| model | seed | " + " | ".join(tasks) + " | RP |" + extra,
             "|---|---:|" + "---:|" * (len(tasks) + 1 + paired),
             "| dense | | " + " | ".join(_acc(dense, t) for t in tasks) + " | 100 |" + " |" * paired]
    if pruned and pruned.get("benchmarks"):
        lines.append("| pruned, no recovery | | " + " | ".join(_acc(pruned, t) for t in tasks) + f" | {_rp(pruned)} |"
                     + " |" * paired)
    for r in sorted(scored, key=lambda r: (r["method"], r.get("seed", 0))):
        lines.append(f"| {r['method']} | {r.get('seed', 0)} | " + " | ".join(_acc(r, t) for t in tasks)
                     + f" | {_rp(r)} |" + (f" {_vs_best(r)} |" if paired else ""))
    note = ("; RP − best: the row's RP minus the best row's, ± the standard error of that difference paired by "
            "document (the same documents for both models, so what makes a document hard cancels)") if paired else ""
    return lines + ["", "Accuracy in % ± its standard error (lm-eval's), on the same documents for every model; "
                        "RP = the model's average over these tasks / the dense average x 100" + note + "."]


def _vs_best(row: dict) -> str:
    v = row.get("rp_vs_best")
    if not v:
        return "–"
    return "best" if v.get("is_best") else f"{v['difference']:+.1f} ± {v['stderr']:.1f}"


def _ci(r: dict, key: str = "ppl") -> str:
    lo, hi = r.get(f"{key}_low"), r.get(f"{key}_high")
    return fmt_ppl(r.get(key)) + (f" [{fmt_ppl(lo)}, {fmt_ppl(hi)}]" if lo is not None and hi is not None else "")


def _used(r: dict) -> str:
    """Seconds the recovery used of its budget (features + training), flagged past +2%."""
    used, budget = r.get("used_seconds"), r.get("budget_seconds")
    if r.get("budget") == FREE_BUDGET:
        return f"{r.get('closed_form_seconds') or 0:.0f} (fit)"
    if used is None or not budget:
        return f"{r['recovery_seconds']:.0f}"
    flag = " **over**" if over_budget(r) else ""
    taken = shared_cpu(r)
    return (f"{used:.0f} / {budget:.0f}{flag}" + (" (stopped at deadline)" if r.get("stopped_at_deadline") else "")
            + (f" **(machine shared: {100 * taken:.0f}% of its CPU to others)**" if taken >= SHARED else ""))


SHARED = 0.05  # a timed cell that lost this share of the machine's CPU to other processes is flagged


def shared_cpu(r: dict) -> float:
    """The share of the machine's CPU that other processes (and the hypervisor) took while a
    cell recovered; 0 where not measured (a cell from before it was, or not on Linux)."""
    c = r.get("cpu_shared") or {}
    return float(c.get("others_share") or 0) + float(c.get("steal_share") or 0)


def _domains(r: dict) -> str:
    ratios = r.get("domain_ratios") or {}
    return " / ".join(f"{v:.2f}" for v in ratios.values()) or "–"


def _pruned(rows: list[dict]) -> str:
    """The unrecovered perplexity of a plan's cells; where their pruned models differ (a
    warm start that keeps the block before the gap as it is, where the others stitch it),
    each figure with the methods it belongs to."""
    by: dict[str, set[str]] = {}
    for r in rows:
        if r.get("pruned_ppl") is not None:
            by.setdefault(fmt_ppl(r["pruned_ppl"]), set()).add(r["method"])
    if len(by) <= 1:
        return next(iter(by), "–")
    return "; ".join(f"{v} ({', '.join(sorted(ms))})" for v, ms in by.items()) + " (the recovery layouts differ)"


def _domain_names(rows: list[dict]) -> str:
    return " / ".join(next((r["domain_ratios"] for r in rows if r.get("domain_ratios")), {})) or "per domain"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _tflops(r: dict) -> str:
    total = (r.get("train_flops") or 0) + (r.get("feature_flops") or 0)
    return f"{total / 1e12:.0f}" if total else "–"


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = ["# overrep compare", ""]
    ok_rows = [r for r in results["rows"] if r.get("status") == "ok"]
    machines = sorted({(r.get("machine") or "?", r.get("precision") or "?", r.get("scoring") or "fp32")
                       for r in ok_rows})
    if machines:
        lines.append("Machine and precision: " + "; ".join(f"{m}, {p} training, {s} scoring" for m, p, s in machines)
                     + (" -- **more than one: do not compare these rows by time**" if len(machines) > 1 else "")
                     + ".")
    codes = sorted({r.get("code") or "not recorded" for r in ok_rows})
    if codes:
        lines.append("Code: " + ", ".join(codes) + (" -- **cells from more than one version of the code**"
                                                     if len(codes) > 1 else "") + ".")
    dense = results.get("dense", {})
    if dense.get("ppl") is not None:
        d = next((r for r in ok_rows if r.get("dense_ppl_low") is not None), {})
        span = f" [{fmt_ppl(d['dense_ppl_low'])}, {fmt_ppl(d['dense_ppl_high'])}]" if d else ""
        lines.append(f"Dense model: test perplexity {fmt_ppl(dense['ppl'])}{span}.")
    if dense.get("benchmarks"):
        lines.append("Dense benchmarks: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in dense["benchmarks"].items())
                     + ".")
    bench = cfg.get("benchmarks")
    if bench:
        lines.append(f"Benchmarks: {bench.get('tasks')} at limit {bench.get('limit')} per task; RP = recovered "
                     "average / dense average x 100 over the tasks scored (each plan's second table).")
    lines.append("")
    lines += at_a_glance(results)
    groups = _groups(results)
    idle = _idle(groups)
    for criterion, ratio, budget, rows in groups:
        what = {"epochs": "matched epochs", "wallclock": f"matched wall-clock ({cfg['reference']}'s time)"}.get(
            budget, f"wall-clock budget {budget} (features + training)")
        if (criterion, ratio, budget) in idle:
            # nothing trained at this budget yet: one line, not the plan's closed forms once more
            waiting = sorted({r["method"] for r in rows if r.get("status") == "not run"})
            if not waiting:  # the closed forms' own budget (0s) beside trained ones: nothing of its own to say
                continue
            lines += [f"## {criterion}, ratio {ratio:g}, {what}", "",
                      f"Not run yet: {', '.join(waiting)} (every seed); the closed forms are in this plan's "
                      "other tables.", ""]
            continue
        ok = [r for r in rows if r.get("status") == "ok"]
        removed = ok[0]["removed_layers"] if ok else "?"
        lines += [f"## {criterion}, ratio {ratio:g}, {what}", "",
                  f"Removed blocks: {removed}. Pruned without recovery: perplexity {_pruned(ok)}"
                  + (f", RP {_rp(results['pruned'][f'{criterion}-{ratio:g}'])}"
                     if results.get("pruned", {}).get(f"{criterion}-{ratio:g}") else "") + ".", "",
                  "| method | seed | test ppl [95%] | × dense [95%] | × dense: " + _domain_names(ok) + " | val ppl "
                  "| RP | LAMBADA % | distinct-2 | steps | seconds used / budget | TFLOPs | trainable |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        waiting = [r for r in rows if r.get("status") == "not run"]
        rows = [r for r in rows if r.get("status") != "not run"]
        for r in sorted(rows, key=lambda r: (r.get("ppl") is None, r.get("ppl") or 0)):
            if r.get("status") != "ok":
                lines.append(f"| {r['method']} | {r.get('seed', 0)} | {r.get('status')} ||||||||||| ")
                continue
            ratio_ci = r.get("ratio_to_dense") or {}
            extra = (" (extra module, not exportable)" if r.get("exportable") is False  # LinearPatch
                     else f" (started cold: {cold_reason(r)})" if started_cold(r) else "")
            lines.append(
                f"| {r['method']}{extra} | {r.get('seed', 0)} | {_ci(r)} | "
                + (f"{ratio_ci['value']:.2f} [{ratio_ci['low']:.2f}, {ratio_ci['high']:.2f}]" if ratio_ci else "–")
                + f" | {_domains(r)} | {fmt_ppl(r.get('val_ppl'))} | {_rp(r)} | {_pct(r.get('lambada_last_word'))} | "
                f"{'–' if r.get('distinct_2') is None else format(r['distinct_2'], '.2f')} | {_steps(r)} | "
                f"{_used(r)} | {_tflops(r)} | {r['trainable_params'] / 1e6:.2f}M"
                + (f" + {r['extra_params'] / 1e6:.2f}M extra" if r.get("extra_params") else "") + " |")
        if waiting:
            lines += ["", "Not run yet: " + ", ".join(f"{r['method']} (seed {r['seed']})" for r in waiting) + "."]
        lines += benchmark_table(ok, dense, results.get("pruned", {}).get(f"{criterion}-{ratio:g}"))
        spread = [(m, ppl) for m, ppl in _by_method(ok).items() if len(ppl) > 1]
        if spread:
            lines += ["", "Over seeds: " + "; ".join(
                f"{m} {fmt_ppl(statistics.mean(p))} ± {fmt_ppl(statistics.stdev(p))} (n={len(p)}, "
                f"{fmt_ppl(min(p))}–{fmt_ppl(max(p))})" for m, p in sorted(spread, key=lambda x: statistics.mean(x[1])))
                      + " (mean ± sample standard deviation, range)."]
        lines.append("")
    lines += warm_against_cold(groups)
    lines += ["Columns: test perplexity of the exported compact model with its 95% bootstrap interval over "
              "documents; × dense: the paired ratio to the dense model on the same rows, and the ratio on each test domain (the "
              "pooled ratio is their geometric mean; below 1, the method overtook the dense model on that "
              "domain, which a next-token objective can do by learning a corpus's format); val ppl: the validation "
              "split (what choices read); RP: retained performance on the benchmarks; LAMBADA %: last-word "
              "accuracy of greedy decoding; distinct-2: distinct bigrams of greedy continuations (low = "
              "repetition); seconds used: features + training up to the end of training, against the cell's "
              "budget (a closed form: its fit; it trains nothing), flagged where other processes took "
              f"{100 * SHARED:.0f}% or more of the machine's CPU meanwhile (the cell trained on less); TFLOPs: training (one step's forward "
              "counted by torch's FlopCounterMode, x 3 for the backward, x steps) plus the dense forward passes that "
              "built the features; extra module: a reference whose patch the stock architecture has no place for "
              "(LinearPatch), scored in memory with its extra parameters and never exported.", ""]
    return "\n".join(lines)


def _by_method(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(r["method"], []).append(r["ppl"])
    return out


def plot_budgets(results: dict, path: Path) -> bool:
    """Held-out perplexity against the wall-clock budget, one line per method and plan
    (mean over seeds, bars: min–max), the dense model's as a dotted line; only for grids with
    duration budgets."""
    rows = [r for r in results["rows"] if r.get("status") == "ok" and r.get("budget_seconds")]
    if not rows:
        return False
    seconds = {r["budget"]: r["budget_seconds"] for r in rows}
    durations = sorted(seconds, key=seconds.get)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["criterion"], r["ratio"], r["method"]) for r in rows}):
        pts = []
        for b in durations:
            p = [r["ppl"] for r in rows if (r["criterion"], r["ratio"], r["method"]) == key and r["budget"] == b]
            if p:
                pts.append((seconds[b] / 60, statistics.mean(p), min(p), max(p)))
        x, y, lo, hi = zip(*pts)
        style = "-" if key[2].startswith("overrep") else "--"
        ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]], fmt=style + "o",
                    capsize=3, label=f"{key[2]} ({key[0]} {key[1]:g})")
    if dense := results.get("dense", {}).get("ppl"):
        ax.axhline(dense, color="k", linestyle=":", label=f"dense {fmt_ppl(dense)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    minutes = [seconds[b] / 60 for b in durations]
    ax.set_xticks(minutes, [f"{m:g}" for m in minutes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("wall-clock budget, minutes (features + training)")
    ax.set_ylabel("test perplexity")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "a plot")
    plt.close(fig)
    return True


def plot_perplexity(results: dict, path: Path) -> None:
    groups = _groups(results)
    idle = _idle(groups)
    groups = [g for g in groups if g[:3] not in idle]
    if not groups:
        return
    cols = min(len(groups), 3)
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    dense = results.get("dense", {}).get("ppl")
    for ax, (criterion, ratio, budget, rows) in zip(axes.flat, groups):
        # one bar per method: the mean over its seeds, the whisker their range
        seeds = sorted(_by_method([r for r in rows if r.get("status") == "ok"]).items(),
                       key=lambda kv: statistics.mean(kv[1]))
        means = [statistics.mean(p) for _, p in seeds]
        ax.barh([f"{m} (n={len(p)})" if len(p) > 1 else m for m, p in seeds], means,
                xerr=[[y - min(p) for y, (_, p) in zip(means, seeds)], [max(p) - y for y, (_, p) in zip(means, seeds)]],
                color=["tab:red" if m.startswith("overrep") else "tab:blue" for m, _ in seeds], capsize=2)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{criterion} {ratio:g}, {budget}", fontsize=10)
        if dense:
            ax.axvline(dense, color="k", linestyle=":", label=f"dense {fmt_ppl(dense)}")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xlabel("test perplexity, log (mean over seeds; range)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "a plot")
    plt.close(fig)


def plot_time(results: dict, path: Path) -> None:
    def seconds(r: dict) -> float:  # what a budget counted (features + training), else the recovery's own
        return r.get("used_seconds") or r.get("recovery_seconds") or 0

    # a closed form trains for no seconds: not on a log axis of time
    rows = [r for r in results["rows"] if r.get("status") == "ok" and seconds(r) > 0]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"epochs": "o", "wallclock": "s"}  # durations: "^"
    # every seed a point; each (plan, method, budget) named once, at the mean of its seeds
    for key in sorted({(r["criterion"], r["ratio"], r["method"], r["budget"]) for r in rows}):
        sel = [r for r in rows if (r["criterion"], r["ratio"], r["method"], r["budget"]) == key]
        xs, ys = [seconds(r) for r in sel], [r["ppl"] for r in sel]
        ax.scatter(xs, ys, marker=markers.get(key[3], "^"), alpha=0.8,
                   color="tab:red" if key[2].startswith("overrep") else "tab:blue")
        ax.annotate(f"{key[2]} {key[1]:g}", (statistics.mean(xs), statistics.mean(ys)), fontsize=7,
                    xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
    ax.set_xlabel("recovery wall-clock seconds (features + training)")
    ax.set_ylabel("test perplexity")
    ax.set_title("circles: matched epochs, squares: matched wall-clock, triangles: budgets; red: OverRep",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "a plot")
    plt.close(fig)


def write_compare_report(out: Path, results: dict) -> Path:
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plot_perplexity(results, plots / "perplexity.png")
    plot_time(results, plots / "perplexity_vs_time.png")
    text = markdown(results) + "\n![perplexity](plots/perplexity.png)\n\n![time](plots/perplexity_vs_time.png)\n"
    if plot_budgets(results, plots / "perplexity_vs_budget.png"):
        text += "\n![budgets](plots/perplexity_vs_budget.png)\n"
    return write_text(out / "results.md", text, "the comparison table")


END = "<!-- /compare -->"


def page_block(doc: Path, section: str = "results") -> tuple[str, str]:
    """``doc``'s text and the line that opens its ``section``'s block of grid tables (a page can
    hold several grids' blocks, each under its own name), or the error that says why the grid's
    tables cannot go there (checked before a grid runs, and again when it writes)."""
    if not re.fullmatch(r"[\w.-]+", section):
        raise OverRepError(f"--section {section!r}: letters, digits, '.', '-' and '_' only")
    begin = f"<!-- compare: {section} -->"
    text = doc.read_text() if doc.is_file() else ""
    if begin not in text or END not in text.split(begin, 1)[1]:
        raise OverRepError(f"{doc}: no '{begin}' ... '{END}' lines to write the tables between")
    return text, begin


def write_into(doc: Path, out: Path, results: dict, command: str, section: str = "results") -> Path:
    """Replace the part of ``doc`` between the ``section``'s opening line and the next
    :data:`END` by the grid's tables, headed by the command that wrote them, and copy its plots
    into ``img/`` beside ``doc`` (named after the page and the section), so that a results page
    is regenerated, never typed."""
    text, begin = page_block(doc, section)
    img = doc.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    body = markdown(results).removeprefix("# overrep compare\n").strip()
    stem = doc.stem if section == "results" else f"{doc.stem}-{section}"
    for plot in sorted((out / "plots").glob("*.png")):
        name = f"{stem}-{plot.name}"
        write_file(img / name, lambda tmp, plot=plot: shutil.copyfile(plot, tmp), "a plot")
        body += f"\n\n![{plot.stem}](img/{name})"
    head, rest = text.split(begin, 1)
    tail = rest.split(END, 1)[1]
    block = f"{begin}\nWritten by `{command}` (every figure below comes from that grid's cells).\n\n{body}\n{END}"
    return write_text(doc, head + block + tail, "the results page")
