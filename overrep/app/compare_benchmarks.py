"""The comparison grid's benchmark rows: every model scored once, RP, paired differences.

With ``benchmarks:`` set, :func:`collect` scores the dense model once, each plan's unrecovered
model once and every finished cell (:func:`score`; the results files are kept in
``<output>/benchmarks/``, named by the model and the suite, so nothing is scored twice), adds
each row's accuracies, standard errors and RP, and gives every row its RP difference to the best
row of its plan and budget, paired by document (:func:`paired_to_best`): which rows the
benchmarks cannot tell apart. ``grid`` is the :class:`overrep.app.compare.Compare` that runs
the cells (its config, its output folder, its unrecovered models, whether it scores anew).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..memo import digest


def score(grid, model: str, tag: str, scorable: bool = True) -> dict | None:
    """The benchmark results of ``model`` (a spec or folder), scored once and kept; ``None``
    with no ``benchmarks:``, or when it was never scored and is not to be (``cached_benchmarks``,
    or not ``scorable``: a kept grid's cell whose model folder was left out, :mod:`.compare_folder`)."""
    spec = grid.cfg.benchmarks
    if not spec:
        return None
    folder = grid.out / "benchmarks"
    path = folder / f"{tag}-{digest([_key(grid, model), spec], 10)}.json"
    for kept in (path, folder / f"{tag}-{digest([model, spec], 10)}.json"):  # (or as kept before: by the path as given)
        if kept.is_file():
            return json.loads(kept.read_text())
    if grid.cached_benchmarks or not scorable:
        return None
    from ..eval.lmeval import evaluate_benchmarks

    path.parent.mkdir(parents=True, exist_ok=True)
    return evaluate_benchmarks(model, tasks=spec.get("tasks", "reasoning"), limit=spec.get("limit", "quick"),
                               output=path, progress=False, device=grid.base["model"].get("device", "auto"))


def _key(grid, model: str) -> str:
    """What names a model's kept results: a folder inside the grid by its path from the grid's
    folder, so that a grid cloned or moved elsewhere still finds them; anything else as given."""
    try:
        return Path(model).resolve().relative_to(grid.out.resolve()).as_posix()
    except ValueError:
        return model


def collect(grid, rows: list[dict]) -> dict:
    """The grid's results: its rows with their benchmark figures (dense once, pruned once per
    plan, every cell), the dense and unrecovered models' figures and the grid's config."""
    from ..eval.retained import retained_performance

    cfg = grid.cfg
    out = {"config": dataclasses.asdict(cfg), "rows": rows, "dense": {}, "pruned": {}}
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok:
        out["dense"]["ppl"] = ok[0]["dense_ppl"]
    if not cfg.benchmarks:
        return out
    dense = score(grid, grid.base["model"]["source"], "dense")
    if dense is None:  # cached_benchmarks, and the dense model never scored: nothing to compare with
        return out
    out["dense"].update(suite_values(dense))
    for criterion, ratio in cfg.pairs():
        pruned = grid.pruned_model(criterion, ratio, export=not grid.cached_benchmarks)
        res = pruned and score(grid, str(pruned), f"pruned-{criterion}-{ratio:g}")
        if res is None:
            continue
        rp = retained_performance(res, dense)
        out["pruned"][f"{criterion}-{ratio:g}"] = {**suite_values(res),
                                                   "rp": {s: v.get("rp") for s, v in rp.items()}}
    scored = []
    for row in ok:
        if not row.get("model_dir"):  # a reference with no exported model (LinearPatch): no lm-eval run of it
            continue
        res = score(grid, row["model_dir"], Path(row["cell"]).name, scorable=Path(row["model_dir"]).is_dir())
        if res is None:
            continue
        rp = retained_performance(res, dense)
        row.update(suite_values(res))
        row["rp"] = {s: v.get("rp") for s, v in rp.items()}
        scored.append((row, res, rp.get("rp")))
    paired_to_best(scored)
    return out


def paired_to_best(scored: list[tuple[dict, dict, dict | None]]) -> None:
    """Give each scored row ``(row, its results, its RP record)`` its RP difference to the best
    row (highest RP) of its plan and budget, paired by document (``rp_vs_best``)."""
    from ..eval.retained import paired_difference

    groups: dict[tuple, list] = {}
    for row, res, rp in scored:
        if rp and rp.get("rp") is not None:
            groups.setdefault((row["criterion"], row["ratio"], row["budget"]), []).append((row, res, rp))
    for members in groups.values():
        best_row, best_res, _ = max(members, key=lambda m: m[2]["rp"])
        best = f"{best_row['method']}, seed {best_row.get('seed', 0)}"
        for row, res, rp in members:
            if row is best_row:
                row["rp_vs_best"] = {"difference": 0.0, "stderr": 0.0, "best": best, "is_best": True}
                continue
            paired = paired_difference(res, best_res, rp["dense_average"], tasks=list(rp["tasks"]))
            if paired["rp"]:
                row["rp_vs_best"] = {**paired["rp"], "best": best}


def suite_values(results: dict) -> dict:
    """A model's benchmark scores for a row: ``benchmarks`` (task: value) and ``benchmark_stderr``."""
    ok = {b: r for b, r in results.get("tasks", {}).items() if r.get("status") == "ok"}
    return {"benchmarks": {b: r.get("value") for b, r in ok.items()},
            "benchmark_stderr": {b: r.get("stderr") for b, r in ok.items()}}
