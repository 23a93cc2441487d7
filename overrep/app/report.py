"""``report.md`` and its plots: what a run did, in a form a person reads."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..atomic import make_dirs, write_file, write_text  # noqa: E402
from .runinfo import describe  # noqa: E402
from ..eval.intervals import format_interval  # noqa: E402

log = logging.getLogger(__name__)


LOSS_NAMES = {"mse": "layer-wise MSE", "lm": "cross-entropy", "kd": "KL to dense logits"}


def plot_training(history: list[dict], path: Path, loss: str = "layer-wise MSE", selected: int | None = None) -> None:
    """Training loss, validation loss, validation perplexity and alpha against the step, one
    figure; ``selected``: the step ``recovery.keep_best`` ended at, when not the last."""
    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax1.plot(steps, [h["loss"] for h in history], lw=0.8, alpha=0.6, label=f"train {loss}")
    val = [(h["step"], h["val_loss"]) for h in history if h.get("val_loss") is not None]
    if val:
        ax1.plot(*zip(*val), "o-", ms=3, label=f"held-out {loss}")
    for prev, h in zip(history, history[1:]):
        if h.get("phase") != prev.get("phase"):  # an A>B loss: where B takes over
            ax1.axvline(h["step"] - 0.5, color="tab:purple", ls="--", lw=1, label=f"{h.get('phase')} from here")
    ax1.set_yscale("log")
    ax1.set_ylabel(loss)
    ppl = [(h["step"], h["val_ppl"]) for h in history if h.get("val_ppl") is not None]
    if ppl:  # the perplexity of the pruned model as it trains (validation rows): what the loss is for
        ax3 = ax1.twinx()
        ax3.plot(*zip(*ppl), "s-", ms=3, color="tab:green", label="validation perplexity")
        if selected is not None:
            ax3.axvline(selected, color="tab:green", ls=":", lw=1, label=f"kept: step {selected}")
        ax3.set_yscale("log")
        ax3.set_ylabel("validation perplexity", color="tab:green")
        ax3.legend(loc="upper center")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(steps, [h["alpha"] for h in history], color="tab:red", label="alpha (annealed activation)")
    ax2.plot(steps, [h["lr"] / max(h2["lr"] for h2 in history) for h in history], color="tab:gray", ls="--",
             label="lr / peak lr")
    ax2.set_xlabel("step")
    ax2.set_ylim(-0.05, 1.05)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "a plot")
    plt.close(fig)


def _fmt(v, digits=4):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _warm_start_line(w: dict | None) -> list[str]:
    """How training started (``recovery.warm_start``), one line."""
    if not w:
        return []
    if w["used"] == "none":
        why = f"`recovery.warm_start: auto` did not apply ({w['why']})" if w.get("why") else "`recovery.warm_start: none`"
        return [f"- started cold: {why}"]
    layout = (f"; trained as `{w['preset']}`, block 1 {w['block1_init']}, {w['blocks']} block(s) a module"
              if "block1_init" in w else "")
    return [f"- started from ReplaceMe's closed-form map, folded into the block before each gap "
            f"(`recovery.warm_start: {w['setting']}`){layout}"]


def _budget_line(b: dict | None) -> list[str]:
    """The time budget, one line, saying where ``recovery.run_limit`` cut it."""
    if not b:
        return []

    def sec(v: float) -> str:
        return f"{v:,.0f}" if v >= 10 else _fmt(v, 3)

    used = f", {sec(b['used_seconds'])} s used" if b.get("used_seconds") is not None else ""
    limit = b.get("run_limit") or {}
    if limit.get("cut_to") is None:
        return [f"- time budget {sec(b['seconds'])} s (features and training){used}"]
    return [f"- time budget {sec(b['seconds'])} s (features and training){used}: cut from "
            f"{sec(limit['budget_asked'])} s so that the whole run ends within `recovery.run_limit` "
            f"({sec(limit['seconds'])} s): {sec(limit['elapsed_before_recovery'])} s spent before recovery, the "
            f"final evaluation predicted at {sec(limit['predicted_final_eval_seconds'])} s"]


def _cpu_line(c: dict | None) -> list[str]:
    """What the rest of the machine took of its CPUs while the run recovered (runinfo.CpuMeter)."""
    if not c:
        return []
    taken = c["others_share"] + c["steal_share"]
    what = (f"other processes {100 * c['others_share']:.0f}%, the hypervisor {100 * c['steal_share']:.0f}% of its "
            f"{c['cpus']} CPU(s) over {c['seconds']:,.0f} s")
    if taken < 0.05:
        return [f"- the machine was otherwise idle while the run recovered ({what})"]
    return [f"- **the machine was shared while the run recovered** ({what}): its training had that much less CPU, "
            "and a time budget bought fewer steps than on an idle machine"]


def _selection_line(sel: dict | None) -> list[str]:
    if not sel:
        return []
    if sel["step"] == sel["last_step"] and sel.get("val_ppl") is None:
        return [f"- the last step was not validated (no room before the deadline); the last validation, at step "
                f"{sel.get('validated_step')}, scored {_fmt(sel.get('validated_ppl'))} (the report's validation "
                "column scores the model exported)"]
    start = ""
    if "start_val_ppl" in sel:
        cost = f", scored in {sel['start_val_seconds']:.1f} s of the budget" if "start_val_seconds" in sel else ""
        start = f"; the closed form it started from: {_fmt(sel['start_val_ppl'])}{cost}"
    if sel["step"] == sel["last_step"]:
        return [f"- validation perplexity {_fmt(sel['val_ppl'])} at the last step (the best foldable one{start})"]
    if sel["step"] == 0:
        return [f"- kept the closed form it started from (validation perplexity {_fmt(sel['val_ppl'])}): training's "
                f"last step {sel['last_step']} scored {_fmt(sel['last_val_ppl'])}, worse (`recovery.keep_best`; "
                "a longer time budget lets training pass it)"]
    return [f"- kept step {sel['step']} (validation perplexity {_fmt(sel['val_ppl'])}), not the last step "
            f"{sel['last_step']} ({_fmt(sel['last_val_ppl'])}{start}): `recovery.keep_best`"]


def _fig(m: dict, tag: str, *path) -> dict | None:
    node = m.get(f"{tag}_perplexity")
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _domain_table(m: dict) -> list[str]:
    """Test perplexity per domain (training sources and unseen corpora) with 95% intervals,
    and the ratio to dense."""
    tags = [t for t in ("dense", "pruned", "recovered") if m.get(f"{t}_ppl_domains")]
    if not tags:
        return []
    names = list(m[f"{tags[0]}_ppl_domains"])
    lines = ["| domain (test) | " + " | ".join(tags) + " | recovered / dense |", "|---" * (len(tags) + 2) + "|"]
    for n in names:
        where = "domains" if n in (_fig(m, tags[0], "domains") or {}) else "unseen"
        vals = [_fig(m, t, where, n) or {"value": m[f"{t}_ppl_domains"].get(n)} for t in tags]
        d, r = m.get("dense_ppl_domains", {}).get(n), m.get("recovered_ppl_domains", {}).get(n)
        paired = _fig(m, "recovered", f"{where}_vs_dense", n)
        ratio = format_interval(paired, 2) if paired else f"{r / d:.2f}" if d and r else "–"  # 2.00, not 2
        lines.append(f"| {n} | " + " | ".join(format_interval(v) for v in vals) + f" | {ratio} |")
    return lines + ["", "Unseen domains (`eval.domains`) are corpora the recovery never trained on (test-only). "
                    "Brackets: 95% bootstrap intervals over documents; recovered / dense is paired, the same "
                    "documents drawn for both models (docs/evaluation.md).", ""]


def _generation_table(m: dict) -> list[str]:
    tags = [t for t in ("dense", "pruned", "recovered") if m.get(f"{t}_generation")]
    if not tags:
        return []
    g = {t: m[f"{t}_generation"] for t in tags}
    lam = g[tags[0]]["lambada_last_word"]
    lines = ["## Generation check", "", "| | " + " | ".join(tags) + " |", "|---" * (len(tags) + 1) + "|",
             f"| LAMBADA last-word accuracy (%, {lam['n']} passages, ± stderr) | " + " | ".join(
                 f"{100 * g[t]['lambada_last_word']['value']:.1f} ± {100 * g[t]['lambada_last_word']['stderr']:.1f}"
                 for t in tags) + " |"]
    for n in (2, 3):
        lines.append(f"| distinct-{n} of greedy continuations ({g[tags[0]]['prompts']} test prompts, "
                     f"{g[tags[0]]['new_tokens']} tokens) | " + " | ".join(_fmt(g[t][f"distinct_{n}"], 3)
                                                                          for t in tags) + " |")
    return lines + ["", "distinct-n: share of distinct n-grams in each continuation (1: no repetition).", ""]


def recovery_check(m: dict) -> dict:
    """Whether the recovered model is worse than the pruned model without recovery, on
    validation (test where a run has no validation rows): such a run still exports its model,
    and ``metrics.json``, the report and the log say loudly that the recovery failed, instead of
    letting it pass for a success. Empty where either figure is missing."""
    for split in ("validation", "test"):
        rec, base = _fig(m, "recovered", split), _fig(m, "pruned", split)
        if rec and base and rec.get("value") is not None and base.get("value") is not None:
            worse = bool(rec["value"] > base["value"])
            if worse:
                log.warning("the recovery failed: the recovered model's %s perplexity %.4g is worse than the "
                            "pruned model's without recovery (%.4g)", split, rec["value"], base["value"])
            return {"split": split, "recovered": rec["value"], "unrecovered": base["value"],
                    "worse_than_unrecovered": worse}
    return {}


def _unrecovered_lines(rows: dict | None) -> list[str]:
    """Why the unrecovered model has no test figure (``eval.unrecovered``), where it has none."""
    if not rows or rows.get("scored") != "validation":
        return []
    return [f"The pruned model without recovery was scored on the validation rows only: {rows['why']}.", ""]


def _dense_source_lines(ref: dict | None) -> list[str]:
    """Where the dense figures came from, where not from scoring every row in this run or its cache."""
    if not ref:
        return []
    return [f"The dense model's figures are the package's, written on {ref['machine']} ({ref['precision']}, torch "
            f"{ref['torch']}, {ref['written']}); this machine scored {ref['checked_rows']} of the test rows and "
            f"matched them within {ref['gap_nats']:.1e} nats a token (`eval.dense_reference`).", ""]


def _check_lines(check: dict | None) -> list[str]:
    if not check or not check.get("worse_than_unrecovered"):
        return []
    return [f"**The recovery failed: the recovered model is worse than no recovery** ({check['split']} perplexity "
            f"{_fmt(check['recovered'])} against {_fmt(check['unrecovered'])}). The model folder holds it as "
            "trained; do not use it (docs/losses.md, \"Attention sinks\", describes one such failure).", ""]


def _export_text(m: dict) -> str:
    if m.get("exportable") is False:  # a reference method (LinearPatch)
        return (f"**not exported**: the method adds {_fmt(m.get('extra_params'))} parameters in a module the stock "
                "architecture has no place for (a d x d patch at each gap, run as a forward hook), so the figures "
                "above are of the patched model in memory and no `model/` folder is written")
    return f"exported model reloads with max logit difference {_fmt(m.get('export_reload_max_abs_diff'), 3)}"


def write_report(out: Path, m: dict, history: list[dict], cfg) -> Path:
    plots = out / "plots"
    make_dirs(plots)
    loss = LOSS_NAMES.get(m.get("objective"), "loss")
    if m.get("objective") == "mse" and getattr(cfg.recovery, "loss", "mse") != "mse":
        loss = f"layer-wise {cfg.recovery.loss} loss"
    if history:
        sel = m.get("keep_best") or {}
        plot_training(history, plots / "training.png", loss,
                      selected=sel["step"] if sel and sel["step"] != sel["last_step"] else None)
    rows = [("dense", m.get("dense_ppl"), m.get("dense_params"), m.get("num_layers_before"),
             m.get("dense_latency_s_per_token")),
            ("pruned, no recovery", m.get("pruned_ppl"), m.get("pruned_params"), m.get("num_layers_after"),
             m.get("pruned_latency_s_per_token")),
            (f"recovered ({m.get('method')}{', ' + m['preset'] if m.get('preset') else ''})", m.get("recovered_ppl"), m.get("recovered_params"),
             m.get("num_layers_after"), m.get("recovered_latency_s_per_token"))]
    lines = [
        "# overrep run report", "",
        f"Model: `{m.get('model')}`. Removed blocks {m['removed_layers']} "
        f"({m['num_layers_before']} -> {m['num_layers_after']} blocks: "
        f"{100 * m['layer_fraction_removed']:.1f}% of the blocks, {100 * m['param_fraction_removed']:.1f}% "
        f"of the parameters).", "",
        *([f"Ran as: {describe(m['run'])}.", ""] if m.get("run") else []),
        "| model | test perplexity [95%] | validation perplexity [95%] | / dense (paired 95%) | parameters "
        "| blocks | latency (ms/token) |",
        "|---|---|---|---|---|---|---|",
        *[f"| {n} | {format_interval(_fig(m, tag, 'test') or {'value': p})} | "
          f"{format_interval(_fig(m, tag, 'validation'))} | "
          f"{format_interval(_fig(m, tag, 'test_vs_dense', 'ratio'), 3)} "
          f"| {_fmt(c)} | {l} | {_fmt(None if t is None else 1000 * t, 3)} |"
          for (n, p, c, l, t), tag in zip(rows, ("dense", "pruned", "recovered"))],
        "", *_dense_source_lines(m.get("dense_reference")), *_unrecovered_lines(m.get("unrecovered_rows")),
        *_check_lines(m.get("recovery_check")),
        f"Test text: {cfg.data.heldout_sequences} sequences of {cfg.data.seq_len} tokens from `{cfg.data.source}` "
        f"({_fmt((m.get('data') or {}).get('test_tokens'))} tokens); validation: {cfg.data.validation_sequences} "
        "sequences; train, validation and test share no document, and nothing that trains or chooses reads "
        "the test rows." + (f" Scored with the forward in {m['eval_precision']} (logits in fp32)."
                            if m.get("eval_precision") else ""), "",
        *_domain_table(m),
        *_generation_table(m),
        "## Recovery", "",
        f"- method `{m.get('method')}`" + (f", preset `{m['preset']}`" if m.get("preset") else "")
        + f", learning rate {_fmt(m.get('lr'), 3)}, {_fmt(m.get('trainable_params'))} trainable parameters "
        f"(recovery ratio {100 * m.get('recovery_ratio', 0):.1f}% of the compact model)",
        *_warm_start_line(m.get("warm_start")),
        f"- {m.get('train_steps')} steps, {_fmt(m.get('train_seconds'), 3)} s, "
        f"{_fmt(m.get('train_tokens_per_second'), 4)} tokens/s",
        *_budget_line(m.get("time_budget")),
        *_cpu_line(m.get("cpu_shared")),
        f"- final training {loss} {_fmt(m.get('final_train_loss'))}, validation {_fmt(m.get('final_val_loss'))}",
        *_selection_line(m.get("keep_best")),
        (f"- fold: {m.get('merged_wrappers') or 'adapter'} modules folded, max abs difference "
         f"{_fmt(m.get('merge_max_abs_diff'), 3)} (relative {_fmt(m.get('merge_max_rel_diff'), 3)}); "
         if m.get("merge_max_abs_diff") is not None else "- nothing to fold (the compact model's own weights "
         "trained); ")
        + _export_text(m),
        "", "![training](plots/training.png)", "",
    ]
    if m.get("benchmarks"):
        tags = [t for t in ("dense", "pruned", "recovered") if t in m["benchmarks"]]
        names = sorted({b for t in tags for b in m["benchmarks"][t]})
        lines += ["## Benchmarks (lm-eval, offline copies; results files in `benchmarks/`)", "",
                  "| benchmark | " + " | ".join(tags) + " |", "|---|" + "---|" * len(tags)]
        for b in names:
            lines.append(f"| {b} | " + " | ".join(_fmt(None if m['benchmarks'][t].get(b) is None
                                                       else 100 * m['benchmarks'][t][b], 3) for t in tags) + " |")
        for tag, rp in (m.get("retained_performance") or {}).items():
            lines.append(f"| RP {tag} (% of dense) | " + ", ".join(f"{s}: {_fmt(v, 3)}" for s, v in rp.items())
                         + " |" + " |" * (len(tags) - 1))
        lines.append("")
    if m.get("samples"):
        lines += ["## Samples (greedy)", ""]
        for tag, text in m["samples"].items():
            lines += [f"**{tag}**:", "", "> " + text.replace("\n", " "), ""]
    lines += ["## Reproduce", "", "```", f"overrep run --config {out / 'config.yaml'} --output NEW_FOLDER", "```", ""]
    return write_text(out / "report.md", "\n".join(lines), "the report")
