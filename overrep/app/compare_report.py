"""``results.md`` and plots of an ``overrep compare`` grid."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from ..atomic import write_file, write_text  # noqa: E402


def fmt_ppl(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.3g}" if v < 1e4 else f"{v:.2e}"


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
                if budget == "wallclock":
                    ref = [r for r in rows if r["criterion"] == criterion and r["ratio"] == ratio
                           and r["budget"] == "epochs" and r["method"] == cfg["reference"]]
                    sel = ref + sel
                if sel:
                    out.append((criterion, ratio, budget, sel))
    return out


def _gb(v) -> str:
    return "–" if v is None else f"{v / 2**30:.2f}"


def _steps(row: dict) -> str:
    """Steps trained, and the one ``recovery.keep_best`` kept when it was an earlier one."""
    kept = row.get("kept_step")
    return f"{row['steps']}" if kept in (None, row["steps"]) else f"{row['steps']} (kept {kept})"


def _rp(row: dict) -> str:
    rp = (row.get("rp") or {}).get("reasoning")
    return "–" if rp is None else f"{rp:.1f}"


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = ["# overrep compare", ""]
    dense = results.get("dense", {})
    if dense.get("ppl") is not None:
        lines.append(f"Dense model: held-out perplexity {fmt_ppl(dense['ppl'])}.")
    if dense.get("benchmarks"):
        lines.append("Dense benchmarks: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in dense["benchmarks"].items())
                     + ".")
    bench = cfg.get("benchmarks")
    if bench:
        lines.append(f"Benchmarks: {bench.get('tasks')} at limit {bench.get('limit')} per task; RP = recovered "
                     "reasoning average / dense average x 100.")
    lines.append("")
    for criterion, ratio, budget, rows in _groups(results):
        what = {"epochs": "matched epochs", "wallclock": f"matched wall-clock ({cfg['reference']}'s time)"}.get(
            budget, f"wall-clock budget {budget} (features + training)")
        ok = [r for r in rows if r.get("status") == "ok"]
        removed = ok[0]["removed_layers"] if ok else "?"
        lines += [f"## {criterion}, ratio {ratio:g}, {what}", "",
                  f"Removed blocks: {removed}. Pruned without recovery: perplexity "
                  f"{fmt_ppl(ok[0]['pruned_ppl']) if ok else '–'}"
                  + (f", reasoning RP {_rp(results['pruned'][f'{criterion}-{ratio:g}'])}"
                     if results.get("pruned", {}).get(f"{criterion}-{ratio:g}") else "") + ".", "",
                  "| method | seed | held-out ppl | RP (reasoning) | trainable params | RR | steps | epochs "
                  "| train s | features s | recovery s | peak mem GB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(rows, key=lambda r: (r.get("ppl") is None, r.get("ppl") or 0)):
            if r.get("status") != "ok":
                lines.append(f"| {r['method']} | {r.get('seed', 0)} | {r.get('status')} |||||||||| ")
                continue
            lines.append(
                f"| {r['method']} | {r.get('seed', 0)} | {fmt_ppl(r['ppl'])} | {_rp(r)} | "
                f"{r['trainable_params'] / 1e6:.2f}M | {r['recovery_ratio']:.3f} | {_steps(r)} | {r['epochs']:.2f} | "
                f"{r['train_seconds']:.0f} | {r['feature_seconds']:.0f} | {r['recovery_seconds']:.0f} | "
                f"{_gb(r['peak_memory_bytes'])} |")
        spread = [(m, ppl) for m, ppl in _by_method(ok).items() if len(ppl) > 1]
        if spread:
            lines += ["", "Over seeds: " + "; ".join(
                f"{m} {fmt_ppl(statistics.mean(p))} ± {fmt_ppl(statistics.stdev(p))} (n={len(p)}, "
                f"{fmt_ppl(min(p))}–{fmt_ppl(max(p))})" for m, p in sorted(spread, key=lambda x: statistics.mean(x[1])))
                      + " (mean ± sample standard deviation, range)."]
        lines.append("")
    lines += ["Columns: held-out perplexity of the exported compact model; RR = trainable / compact parameters; "
              "features s = building the feature cache in that cell (0 when it reused one built by an earlier "
              "cell of the same plan); recovery s = train s + features s + a method's own search or probe "
              "(rankadaptor, restorelcc); peak memory = the cell process's "
              "peak resident memory (CPU) or peak allocated GPU memory.", ""]
    return "\n".join(lines)


def _by_method(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(r["method"], []).append(r["ppl"])
    return out


def plot_budgets(results: dict, path: Path) -> bool:
    """Held-out perplexity against the wall-clock budget, one line per method and plan
    (mean over seeds, bars: min–max); only for grids with duration budgets."""
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
    ax.set_xscale("log")
    ax.set_yscale("log")
    minutes = [seconds[b] / 60 for b in durations]
    ax.set_xticks(minutes, [f"{m:g}" for m in minutes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("wall-clock budget, minutes (features + training)")
    ax.set_ylabel("held-out perplexity")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "a plot")
    plt.close(fig)
    return True


def plot_perplexity(results: dict, path: Path) -> None:
    groups = _groups(results)
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.2), squeeze=False)
    for ax, (criterion, ratio, budget, rows) in zip(axes[0], groups):
        ok = sorted([r for r in rows if r.get("status") == "ok"], key=lambda r: r["ppl"])
        colors = ["tab:red" if r["method"].startswith("overrep") else "tab:blue" for r in ok]
        ax.barh([r["method"] for r in ok], [r["ppl"] for r in ok], color=colors)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{criterion} {ratio:g}, {budget}", fontsize=10)
        ax.set_xlabel("held-out perplexity (log)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "a plot")
    plt.close(fig)


def plot_time(results: dict, path: Path) -> None:
    rows = [r for r in results["rows"] if r.get("status") == "ok"]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"epochs": "o", "wallclock": "s"}  # durations: "^"
    for key in sorted({(r["criterion"], r["ratio"]) for r in rows}):
        sel = [r for r in rows if (r["criterion"], r["ratio"]) == key]
        for r in sel:
            ax.scatter(r["recovery_seconds"], r["ppl"], marker=markers.get(r["budget"], "^"),
                       color="tab:red" if r["method"].startswith("overrep") else "tab:blue", alpha=0.8)
            ax.annotate(f"{r['method']} {r['ratio']:g}", (r["recovery_seconds"], r["ppl"]), fontsize=7,
                        xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("recovery wall-clock seconds (features + training)")
    ax.set_ylabel("held-out perplexity")
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
