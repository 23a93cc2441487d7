"""``overrep compare``: recovery methods x pruning criteria x ratios on one model.

One YAML file describes the grid::

    base:                     # a run configuration (any subset), shared by every cell
      model: {source: embedded}
      data: {seq_len: 128, train_sequences: 256}
      recovery: {epochs: 1}
    methods: [overrep, plain, streamline, lora, adalora, lora-iso, full-ft, logit-kd, overrep-kd]
    criteria: [last]
    ratios: [0.25, 0.5]
    plans: [[cosine, 0.25], [last, 0.5]]   # optional: these (criterion, ratio) pairs, not criteria x ratios
    budgets: [epochs, wallclock, 5m, 10m]
    seeds: [0, 1, 2]          # optional (default [0]): every cell once per recovery seed
    variants:                 # optional: a method with settings of its own, listed in methods by name
      overrep-warm: {method: overrep, recovery: {warm_start: replaceme}}
    benchmarks: {tasks: [arc_easy, piqa], limit: 100}     # optional (null: perplexity only)
    output: runs/compare

Budgets:

* ``epochs`` -- every method sees the same training sequences for the same number of
  epochs (``base.recovery.epochs`` or ``steps``).
* ``wallclock`` -- every method gets the time the reference method (OverRep) needed in
  its ``epochs`` cell, feature caching included, as ``recovery.time_budget``: the cell
  measures its own step time and fixes its step count to fit (so ``wallclock`` also runs
  ``epochs``).
* a duration (``2.5m``, ``10m``, ``600s``, ``1h``) -- every method gets that much wall-clock,
  feature caching included, as ``recovery.time_budget``: quality per unit of compute.

A wall-clock cell (both kinds) builds its features in a cache of its own, out of its own
budget (a layer-wise method caches only the rows its budget lets it train on, see
:mod:`overrep.recovery.budget`); methods on the whole model run the dense teacher (or
nothing) live instead.

Each cell is a normal ``overrep run`` in its own folder under ``cells/`` (named by its
configuration's hash), run as a subprocess so its peak memory is its own. A finished cell
is never recomputed: extending the grid (more methods, criteria, ratios) only runs the
new cells, and an interrupted grid resumes the unfinished cell from its checkpoint.
The grid gets its own feature cache (``<output>/cache``) so feature-building time is
measured, not inherited from an earlier run.

Outputs: ``results.json`` (every cell's numbers), ``results.md`` (tables) and
``plots/`` (perplexity per method; perplexity against wall-clock time).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import compare_folder
from .compare_benchmarks import collect
from .compare_config import FREE, CompareConfig, deep_update, budget_seconds
from .config import RunConfig
from .runlock import RunLock
from ..errors import OverRepError
from ..memo import digest
from ..atomic import write_json

log = logging.getLogger(__name__)
NOT_RUN = "not run"  # a cell ``--collect-only`` found unfinished


@dataclass
class Cell:
    criterion: str
    ratio: float
    method: str
    budget: str
    config: dict  # the cell's full RunConfig dict (output filled in)
    dir: Path
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.criterion} {self.ratio:g} {self.method} ({self.budget}{f', seed {self.seed}' if self.seed else ''})"

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.json"

    @property
    def done(self) -> bool:
        return self.metrics_path.is_file()

    def metrics(self) -> dict:
        return json.loads(self.metrics_path.read_text())


#: the folder this process's ``overrep`` was imported from
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def overrep_command(*args: str) -> tuple[list[str], dict]:
    """``python -m overrep ARGS`` and its environment, so that a cell runs the code of the grid that
    planned it: ``-m`` would put the working directory first on the path, and a checkout there
    (another version of overrep) would be imported instead (PYTHONSAFEPATH, Python 3.11+, leaves it
    out; PYTHONPATH puts this process's package first)."""
    path = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", "overrep", *args], {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": path}


def _hash(obj) -> str:
    return digest(obj, 10)


class Compare:
    def __init__(self, cfg: CompareConfig, *, progress: bool = True, collect_only: bool = False,
                 cached_benchmarks: bool = False):
        self.cfg, self.progress = cfg, progress
        self.collect_only = collect_only  # tables from the finished cells; run nothing
        self.cached_benchmarks = cached_benchmarks  # benchmark rows only for models already scored
        self.out = Path(cfg.output)
        base = RunConfig.from_dict(cfg.base).to_dict()
        if not cfg.base.get("cache", {}).get("dir"):
            base["cache"]["dir"] = str(self.out / "cache")
        # the dense model scored on the grid's own machine, never from the package's entry: one table, one machine
        base["eval"].update(latency=False, benchmarks=None, perplexity=True, dense_reference=False)
        base["prune"]["remove"] = None
        base["recovery"]["run_limit"] = None  # a cell trains for its budget, never cut to fit a whole-run limit
        self.base = base
        self.machine_checked = False  # compare_folder.check_machine: once, before the first cell that runs

    # ---- cells ---------------------------------------------------------------------
    def cell(self, criterion: str, ratio: float, method: str, budget: str, seconds: float | None = None,
             seed: int = 0) -> Cell:
        extra = deep_update(self.cfg.variant(method), {"prune": {"ratio": ratio, "criterion": criterion},
                                                        "recovery": {"seed": seed}})
        if seconds is not None:  # a wall-clock cell: the run fixes its own step count and pays for
            # its own features, in a cache of its own (deleted when the cell is done)
            extra["recovery"].update(steps=None, time_budget=f"{seconds:.3f}s")
            extra["cache"] = {"dir": str(self.out / "cache" / "cells" / f"{criterion}-{ratio:g}-{method}-{budget}-"
                                                                          f"seed{seed}")}
        else:  # a matched-epoch cell: the step count comes from the data, never from the clock
            extra["recovery"]["time_budget"] = None
        config = deep_update(self.base, extra)
        config.pop("output", None)
        prefix = f"{criterion}-{ratio:g}-{method}-{budget}-"
        settings = self.settings(config)
        d = self.out / "cells" / f"{prefix}{_hash(settings)}"
        if not d.is_dir():
            d = self.found_cell(prefix, settings) or d
        return Cell(criterion, ratio, method, budget, {**config, "output": str(d)}, d, seed)

    def settings(self, config: dict) -> dict:
        """What identifies a cell: its run settings without where this grid folder lies (its
        own output folder, and a cache folder inside the grid as a path relative to it), so
        a grid reached by a relative or an absolute path, or moved, finds its cells."""
        out = copy.deepcopy(config)
        out.get("recovery", {}).pop("run_limit", None)  # never set in a cell (and absent from cells written before it)
        out.get("eval", {}).pop("dense_reference", None)  # always off in a cell (and absent from cells written before it)
        own = out.pop("output", None)  # a written cell's: <grid>/cells/<name>
        root = Path(own).resolve().parents[1] if own else self.out.resolve()
        cache = out.get("cache", {}).get("dir")
        if cache and Path(cache).resolve().is_relative_to(root):
            out["cache"]["dir"] = "<grid>/" + Path(cache).resolve().relative_to(root).as_posix()
        return out

    def found_cell(self, prefix: str, settings: dict) -> Path | None:
        """A cell folder of the same settings under another name: written with the grid's path in
        its name's hash, as earlier versions did, or before a setting existed (its request is read
        through today's configuration, so a field it lacks takes its default)."""
        key = _hash(settings)
        for request in sorted((self.out / "cells").glob(f"{prefix}*.yaml")):
            d = request.with_suffix("")
            try:
                old = RunConfig.from_dict(yaml.safe_load(request.read_text())).to_dict()
                ran = d.is_dir() or d.with_name(f"{d.name}.error").is_file()  # (a refused run leaves no folder)
                same = ran and _hash(self.settings(old)) == key
            except (OSError, yaml.YAMLError, AttributeError, OverRepError):
                continue
            if same:
                return d
        return None

    def epoch_cells(self, criterion: str, ratio: float, seed: int = 0) -> list[Cell]:
        ref = self.cfg.reference
        trained = list(filter(self.cfg.trains, self.cfg.methods))
        order = [ref] + [m for m in trained if m != ref] if ref in trained else trained
        return [self.cell(criterion, ratio, m, "epochs", seed=seed) for m in order]

    def wallclock_cell(self, criterion: str, ratio: float, method: str, seed: int = 0) -> Cell | None:
        """The matched-time cell of ``method`` (None for the reference itself, whose epoch
        cell defines the budget); needs the finished epoch cells."""
        if method == self.cfg.reference:
            return None
        ref = self.cell(criterion, ratio, self.cfg.reference, "epochs", seed=seed).metrics()
        # the reference's features count at what building them cost, also when its cell found
        # them already cached (an earlier grid on the same plan built them)
        features = max(ref.get("timings_seconds", {}).get("cache", 0.0),
                       (ref.get("cache") or {}).get("build_seconds", 0.0))
        budget = ref["train_seconds"] + features
        return self.cell(criterion, ratio, method, "wallclock", seconds=budget, seed=seed)

    def duration_cell(self, criterion: str, ratio: float, method: str, budget: str, seed: int = 0) -> Cell:
        """``method`` with ``budget`` of wall-clock, feature caching included."""
        return self.cell(criterion, ratio, method, budget, seconds=budget_seconds(budget), seed=seed)

    def run_cell(self, cell: Cell) -> dict | None:
        if cell.done:
            return cell.metrics()
        if not self.machine_checked:
            from ..model.runtime import resolve_device
            from .runinfo import processor

            compare_folder.check_machine(self.out, processor(resolve_device(self.base["model"]["device"])))
            self.machine_checked = True
        cell.dir.parent.mkdir(parents=True, exist_ok=True)
        request = cell.dir.parent / f"{cell.dir.name}.yaml"
        request.write_text(yaml.safe_dump(cell.config, sort_keys=False))
        log_path = cell.dir.parent / f"{cell.dir.name}.log"
        error_path = cell.dir.parent / f"{cell.dir.name}.error"
        error_path.unlink(missing_ok=True)
        resume = ["--resume"] if (cell.dir / "config.yaml").is_file() else []  # an interrupted cell
        self.share_caches(Path(cell.config["cache"]["dir"] or ""))
        cmd, env = overrep_command("run", "--config", str(request), *resume, "--quiet")
        with open(log_path, "a") as logf:
            logf.write(f"$ {' '.join(cmd)}\n")
            logf.flush()
            proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        if proc.returncode == 130 or proc.returncode < 0:
            raise KeyboardInterrupt
        own = Path(cell.config["cache"]["dir"] or "")
        if cell.done and own.is_relative_to(self.out / "cache" / "cells"):
            shutil.rmtree(own / "features", ignore_errors=True)  # a wall-clock cell's own features
        if cell.done:  # resuming is all a cell's checkpoints are for (a model's worth each); its model folder stays
            shutil.rmtree(cell.dir / "checkpoints", ignore_errors=True)
        if proc.returncode != 0 or not cell.done:
            lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith("overrep: error:")]
            message = lines[-1] if lines else f"exit status {proc.returncode} (see {log_path})"
            error_path.write_text(message + "\n")
            log.error("%s failed: %s", cell.label, message)
            return None
        return cell.metrics()

    def share_caches(self, own: Path) -> None:
        """A wall-clock cell builds its features in a cache of its own, but reads the grid's
        criterion scores and the dense and unrecovered evaluation figures (cached by model,
        mask and rows) from the grid's cache: they are no part of any cell's recovery budget."""
        if not own.is_relative_to(self.out / "cache" / "cells"):
            return
        own.mkdir(parents=True, exist_ok=True)
        for sub in ("eval", "criteria"):
            shared, link = self.out / "cache" / sub, own / sub
            shared.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(shared.resolve(), target_is_directory=True)

    # ---- benchmarks (scored in compare_benchmarks.py) --------------------------------
    def pruned_model(self, criterion: str, ratio: float, export: bool = True) -> Path | None:
        """The pruned model without recovery (for its benchmark row), exported once (``None``
        when it was not and ``export`` is false)."""
        cell = self.cell(criterion, ratio, "none", "none")
        model = cell.dir / "pruned-model"
        if not (model / "overrep.json").is_file():
            if not export:
                return None
            request = cell.dir.parent / f"{cell.dir.name}.yaml"
            request.parent.mkdir(parents=True, exist_ok=True)
            cfg = copy.deepcopy(cell.config)
            cfg["recovery"]["method"] = "overrep"
            request.write_text(yaml.safe_dump(cfg, sort_keys=False))
            cmd, env = overrep_command("prune", "--config", str(request), "--overwrite", "--quiet")
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        return model

    # ---- the grid ------------------------------------------------------------------
    def plan_cells(self) -> int:
        cfg = self.cfg
        trained = [m for m in cfg.methods if cfg.trains(m)]
        per_seed = len(trained) * len([b for b in cfg.budgets if b != FREE])  # 0s: the closed forms' column
        if "wallclock" in cfg.budgets and cfg.reference in cfg.methods:
            per_seed -= 1  # the reference's epoch cell serves both
        return len(cfg.pairs()) * (len(cfg.seeds) * per_seed + len(cfg.methods) - len(trained))

    def grid_cells(self, criterion: str, ratio: float, seed: int, bar) -> list[dict]:
        """Every cell of one plan and seed, in order: epochs, matched wall-clock, durations."""
        cfg, rows, epoch = self.cfg, [], {}

        def run(cell: Cell) -> dict | None:
            bar.set_postfix_str(cell.label)
            if self.collect_only and not cell.done:
                failed = cell.dir.parent / f"{cell.dir.name}.error"  # a cell that ran and stopped says why
                rows.append(self._row(cell, None) if failed.is_file() else
                            {"criterion": cell.criterion, "ratio": cell.ratio, "method": cell.method, "seed": cell.seed,
                             "budget": cell.budget, "status": NOT_RUN})
                bar.update(1)
                return None
            m = self.run_cell(cell)
            rows.append(self._row(cell, m))
            bar.update(1)
            return m

        for method in cfg.methods:  # a closed form: no training, so no budget; deterministic, so one seed
            if not cfg.trains(method) and seed == cfg.seeds[0]:
                run(self.cell(criterion, ratio, method, FREE, seed=seed))
        if "epochs" in cfg.budgets:
            for cell in self.epoch_cells(criterion, ratio, seed):
                epoch[cell.method] = run(cell)
        if "wallclock" in cfg.budgets:
            for method in filter(cfg.trains, cfg.methods):
                if method == cfg.reference:
                    continue
                if epoch.get(cfg.reference) is None or epoch.get(method) is None:
                    rows.append({"criterion": criterion, "ratio": ratio, "method": method, "seed": seed,
                                 "budget": "wallclock", "status": "skipped: its epoch cell failed"})
                    bar.update(1)
                    continue
                run(self.wallclock_cell(criterion, ratio, method, seed))
        for budget in cfg.budgets:
            if budget != FREE and budget_seconds(budget) is not None:  # a method that trains has no 0-s cell
                for method in filter(cfg.trains, cfg.methods):
                    run(self.duration_cell(criterion, ratio, method, budget, seed))
        return rows

    def run(self) -> dict:
        cfg = self.cfg
        lock = RunLock(self.out)  # one grid at a time in a folder: its cells run one after another, each timed alone
        if not self.collect_only:
            lock.acquire()
        try:
            return self._run(cfg)
        finally:
            lock.release()

    def _run(self, cfg: CompareConfig) -> dict:
        from tqdm.auto import tqdm

        compare_folder.prepare(self.out)
        (self.out / "compare.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        bar = tqdm(total=self.plan_cells(), desc="compare", unit="cell", disable=not self.progress,
                   dynamic_ncols=True)
        rows: list[dict] = []
        try:
            for criterion, ratio in cfg.pairs():
                for seed in cfg.seeds:
                    rows += self.grid_cells(criterion, ratio, seed, bar)
        except KeyboardInterrupt:
            bar.close()
            raise OverRepError(f"interrupted; finished cells are kept in {self.out / 'cells'} -- rerun the same "
                               "`overrep compare` command to continue") from None
        bar.close()
        results = collect(self, rows)
        write_json(self.out / "results.json", results)
        from .compare_report import write_compare_report

        write_compare_report(self.out, results)
        return results

    def _row(self, cell: Cell, m: dict | None) -> dict:
        row = {"criterion": cell.criterion, "ratio": cell.ratio, "method": cell.method, "budget": cell.budget,
               "seed": cell.seed, "budget_seconds": budget_seconds(cell.budget), "cell": str(cell.dir)}
        if m is None:
            err = cell.dir.parent / f"{cell.dir.name}.error"
            row["status"] = "failed: " + (err.read_text().strip() if err.is_file() else "unknown")
            return row
        t = m.get("timings_seconds", {})
        train_seq = cell.config["data"]["train_sequences"]
        per_step = cell.config["recovery"]["batch_size"] * cell.config["recovery"]["grad_accum"]
        row.update({
            "status": "ok", "removed_layers": m.get("removed_layers"), "dense_ppl": m.get("dense_ppl"),
            "pruned_ppl": m.get("pruned_ppl"), "ppl": m.get("recovered_ppl"),
            "trainable_params": m.get("trainable_params"), "recovery_ratio": m.get("recovery_ratio"),
            "compact_params": m.get("recovered_params"), "steps": m.get("train_steps"),
            "epochs": (m.get("train_steps") or 0) * per_step / train_seq, "lr": m.get("lr"),
            "train_seconds": m.get("train_seconds"), "feature_seconds": t.get("cache", 0.0),
            "criterion_seconds": t.get("criterion", 0.0), "peak_memory_bytes": m.get("peak_memory_bytes"),
            # the model where the cell's folder is now (metrics.json holds the path it was written at)
            "model_dir": str(cell.dir / "model") if m.get("model_dir") else None,
            "merge_max_abs_diff": m.get("merge_max_abs_diff"),
            "kept_step": (m.get("keep_best") or {}).get("step"),  # recovery.keep_best's choice
            "exportable": m.get("exportable", True), "extra_params": m.get("extra_params"),  # LinearPatch: False
        })
        row["search_seconds"] = t.get("search", 0.0)  # a method's own search before training (rankadaptor)
        row["recovery_seconds"] = row["train_seconds"] + row["feature_seconds"] + row["search_seconds"]
        row.update(_protocol_figures(m))
        return row

def _protocol_figures(m: dict) -> dict:
    """What the evaluation protocol adds to a row: test perplexity with its 95% interval, the
    paired ratio to dense, validation perplexity, the seconds the budget really used, the
    training FLOPs and the generation check (docs/evaluation.md)."""
    rec, dense = m.get("recovered_perplexity") or {}, m.get("dense_perplexity") or {}
    test = rec.get("test") or {}
    budget = m.get("time_budget") or {}
    gen = m.get("recovered_generation") or {}
    env = m.get("environment") or {}
    return {"machine": env.get("machine"), "precision": m.get("precision"), "code": env.get("code"),
            "scoring": m.get("eval_precision", "fp32"),  # (a cell from before eval.precision scored in fp32)
            "ppl_low": test.get("low"), "ppl_high": test.get("high"), "test_tokens": test.get("tokens"),
            "dense_ppl_low": (dense.get("test") or {}).get("low"),
            "dense_ppl_high": (dense.get("test") or {}).get("high"),
            "ratio_to_dense": (rec.get("test_vs_dense") or {}).get("ratio"),
            "val_ppl": (rec.get("validation") or {}).get("value"),
            "unseen_ppl": {k: v.get("value") for k, v in (rec.get("unseen") or {}).items()},
            "domain_ratios": _domain_ratios(m, unseen=set(rec.get("unseen") or {})),
            "used_seconds": budget.get("used_seconds"), "stopped_at_deadline": budget.get("stopped_at_step"),
            "train_flops": m.get("train_flops"), "feature_flops": m.get("feature_flops"),
            "lambada_last_word": (gen.get("lambada_last_word") or {}).get("value"),
            "distinct_2": gen.get("distinct_2"),
            "warm_start": (m.get("warm_start") or {}).get("used"),  # what the run started from (auto decides)
            "cold_because": (m.get("warm_start") or {}).get("why"),  # why auto started it cold, where it did
            "cold_code": (m.get("warm_start") or {}).get("cold"),  # the same as a code (recovery.methods.COLD_STARTS)
            "closed_form_seconds": _fit_seconds(m.get("closed_form") or {}),
            "cpu_shared": m.get("cpu_shared")}  # what the rest of the machine took meanwhile (runinfo.CpuMeter)


def _domain_ratios(m: dict, unseen: set[str]) -> dict[str, float]:
    """Recovered / dense perplexity on each test domain the run trained on (unseen corpora aside):
    the pooled figure is their geometric mean, so one domain where a method overtakes the dense
    model (by learning the corpus's own format) can carry it."""
    rec, dense = m.get("recovered_ppl_domains") or {}, m.get("dense_ppl_domains") or {}
    return {d: rec[d] / dense[d] for d in rec if d not in unseen and dense.get(d)}


def _fit_seconds(fit: dict) -> float:
    """Seconds a closed form took to fit (Prune&Comp: its scales; ReplaceMe: each run's map)."""
    return fit.get("seconds") or sum(run.get("seconds", 0.0) for run in fit.get("runs", []))
