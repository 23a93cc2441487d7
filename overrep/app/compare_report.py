"""``results.md`` and plots of an ``overrep compare`` grid."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
        what = "matched epochs" if budget == "epochs" else f"matched wall-clock ({cfg['reference']}'s time)"
        ok = [r for r in rows if r.get("status") == "ok"]
        removed = ok[0]["removed_layers"] if ok else "?"
        lines += [f"## {criterion}, ratio {ratio:g}, {what}", "",
                  f"Removed blocks: {removed}. Pruned without recovery: perplexity "
                  f"{fmt_ppl(ok[0]['pruned_ppl']) if ok else '–'}"
                  + (f", reasoning RP {_rp(results['pruned'][f'{criterion}-{ratio:g}'])}"
                     if results.get("pruned", {}).get(f"{criterion}-{ratio:g}") else "") + ".", "",
                  "| method | held-out ppl | RP (reasoning) | trainable params | RR | steps | epochs | train s "
                  "| features s | recovery s | peak mem GB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(rows, key=lambda r: (r.get("ppl") is None, r.get("ppl") or 0)):
            if r.get("status") != "ok":
                lines.append(f"| {r['method']} | {r.get('status')} |||||||||| ")
                continue
            lines.append(
                f"| {r['method']} | {fmt_ppl(r['ppl'])} | {_rp(r)} | {r['trainable_params'] / 1e6:.2f}M | "
                f"{r['recovery_ratio']:.3f} | {r['steps']} | {r['epochs']:.2f} | {r['train_seconds']:.0f} | "
                f"{r['feature_seconds']:.0f} | {r['recovery_seconds']:.0f} | {_gb(r['peak_memory_bytes'])} |")
        lines.append("")
    lines += ["Columns: held-out perplexity of the exported compact model; RR = trainable / compact parameters; "
              "features s = building the feature cache in that cell (0 when it reused one built by an earlier "
              "cell of the same plan); recovery s = train s + features s; peak memory = the cell process's "
              "peak resident memory (CPU) or peak allocated GPU memory.", ""]
    return "\n".join(lines)


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
    markers = {"epochs": "o", "wallclock": "s"}
    for key in sorted({(r["criterion"], r["ratio"]) for r in rows}):
        sel = [r for r in rows if (r["criterion"], r["ratio"]) == key]
        for r in sel:
            ax.scatter(r["recovery_seconds"], r["ppl"], marker=markers[r["budget"]],
                       color="tab:red" if r["method"].startswith("overrep") else "tab:blue", alpha=0.8)
            ax.annotate(f"{r['method']} {r['ratio']:g}", (r["recovery_seconds"], r["ppl"]), fontsize=7,
                        xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("recovery wall-clock seconds (features + training)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("circles: matched epochs, squares: matched wall-clock; red: OverRep", fontsize=9)
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
    return write_text(out / "results.md", text, "the comparison table")
