"""The end-to-end job: prune -> cache -> recover -> merge -> export -> evaluate.

Read top to bottom; each stage is a method of :class:`Pipeline` so the CLI can run a stage on
its own (``overrep cache``, ``overrep recover`` ...) or all of them (``overrep run``). A run's
output folder (its rules: :mod:`overrep.app.outdir`):

    config.yaml      resolved configuration          plan.json      removed blocks, modules
    checkpoints/     resumable training state        train_log.jsonl  per-step losses
    model/           the compact Hugging Face model  metrics.json   numbers (written last)
    report.md        readable summary with plots     plots/         PNG figures
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from pathlib import Path

import torch

from .. import __version__
from ..atomic import write_json
from ..core.precision import resolve_model_dtype
from ..data.text import token_splits
from ..errors import OverRepError
from ..eval.figures import eval_data
from ..eval.heldout import unseen_domain_rows
from ..model.accounting import blocks_for_ratio, pruning_account
from ..model.arch import check_supported, decoder_layers
from ..model.loading import load_model
from ..model import onload
from ..model.placement import is_placed, placed_copy, teacher_placement
from ..model.runtime import check_finite, digest, model_fingerprint, peak_memory_bytes, resolve_device
from ..model.surgery import parse_layers, plan_pruning, prune
from ..pruning.cached import cached_selection
from ..pruning.criteria import NEEDS_CALIBRATION, Selection
from ..recovery.budget import Deadline
from ..recovery.methods import build_recovery, fits_warm_start, get_method, prepare_closed_form
from ..recovery.teacher import MethodInputs, Teacher
from ..recovery.sharding import gather, shard_objective
from ..recovery.trainer import Trainer
from ..paths import cache_root
from ..distributed import World, world_from_env
from .budgeting import BudgetFit, budget_outcome, checkpointed_total, compute_spent, fit_budget, run_limit_budget
from .config import RunConfig
from .export import export_checked, export_model
from .outdir import RunFolder
from .runinfo import CpuMeter, environment, how_it_ran
from .scoring import score_model
from . import warm_start

log = logging.getLogger(__name__)


class Pipeline:
    def __init__(self, cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, reuse: bool = False,
                 progress: bool = True, world: World | None = None):
        """``resume``: continue the run in ``cfg.output`` (it must exist); ``overwrite``: replace
        it; ``reuse``: write into it whether or not a run is there (single stages such as
        ``overrep prune``). ``world``: this process's rank (default: from ``torchrun``'s
        environment, else one process; see :mod:`overrep.distributed`)."""
        self.world = world or world_from_env()
        self.cfg, self.resume, self.overwrite, self.reuse = cfg, resume, overwrite, reuse
        self.progress = progress and self.world.is_main
        self.out = Path(cfg.output)
        self.metrics: dict = {}
        self.timings: dict[str, float] = {}
        self.benchmark_results: dict[str, dict] = {}
        self.eval_cost: dict[str, float | None] = {}  # evaluate_model: seconds each model's figures cost (cached or not)
        self.eval_rows_cost: dict[str, float | None] = {}  # ... of which the perplexity rows (eval.figures)
        self.eval_rows_timed: dict[str, tuple] = {}  # (seconds, budgeting.row_sets) of the rows scored in this run
        self.run_started: float | None = None  # run(): when the whole run began (recovery.run_limit)
        # what the stages produce, set by them in this order (None until a stage has run):
        self.folder: RunFolder | None = None  # prepare_output (rank 0)
        self.device = self.dense = self.tokenizer = self.model_info = self._offload = self.num_layers = None  # load
        self.model_fp = self.method = self.rcfg = self.total_steps = self.selection = self.plan = self.teacher = None
        self.train_ids = self.heldout_ids = self.val_ids = self.eval_data = self.data_info = None
        self.dense_scores = None  # evaluate_model("dense"): per-document scores the others are paired with
        self.shared_prefix = None  # load: the blocks every model of the run shares, run once per rows (model.prefix)
        self.pruned = None  # prune (merge: the compact model)
        self.budget: BudgetFit | None = None  # build_recovery: recovery.time_budget's decision
        self.recovery_started: float | None = None  # build_recovery: when the recovery (and a budget) started
        self.cpu_meter: CpuMeter | None = None  # build_recovery to train's end: the machine's other load
        self.recovery = None  # build_recovery: the method's MethodRun
        self.trainer, self.history = None, []  # train

    # ---- stage 0: output folder ----------------------------------------------------
    def prepare_output(self) -> None:
        """Check what the output folder allows (``--resume``, ``--overwrite``); writes nothing (rank 0's folder)."""
        if not self.world.is_main:
            return
        folder = RunFolder(self.out, resume=self.resume, overwrite=self.overwrite, reuse=self.reuse)
        folder.lock()  # first: another run's folder is named as such, and what check() sees stays true
        try:
            folder.check()
            if (self.resume or self.reuse) and not self.overwrite:
                folder.check_same_config(self.cfg)
        except BaseException:
            folder.unlock()
            raise
        self.folder = folder

    @contextlib.contextmanager
    def output_guard(self):
        """Around the stages that write: a failure before anything resumable exists leaves the
        disk as it was (see :mod:`overrep.app.outdir`); success drops a run ``--overwrite`` replaced."""
        try:
            yield
        except BaseException:
            if self.folder is not None:
                self.folder.rollback()
            raise
        else:
            if self.folder is not None:
                self.folder.commit()
        finally:
            if self.folder is not None:
                self.folder.unlock()  # the output folder is free for the next run

    # ---- stage 1: model, plan, data ------------------------------------------------
    def load(self, create_output: bool = True) -> None:
        cfg = self.cfg
        if cfg.recovery.threads:
            torch.set_num_threads(cfg.recovery.threads)
        torch.manual_seed(cfg.recovery.seed)
        self.device = self.world.device(resolve_device(cfg.model.device))
        t0 = time.perf_counter()
        dtype = resolve_model_dtype(cfg.model.dtype, self.device)
        stream = cfg.cache.teacher == "stream"  # never whole: blocks read from the safetensors shards as they run
        placement, self._offload = (None, None) if stream else teacher_placement(
            cfg.model.device_map, cfg.model.max_memory, self.world.size, self.cache_root)  # None: whole, below
        self.dense, self.tokenizer, self.model_info = (onload.load_onloaded(cfg.model.source, dtype=dtype,
            device=self.device) if stream else load_model(cfg.model.source, dtype=dtype, placement=placement))
        check_supported(self.dense)
        check_finite(self.dense, "model")
        if is_placed(self.dense):  # where accelerate put the teacher's parts (a device, "cpu" or "disk")
            self.metrics["teacher_device_map"] = {k: str(v) for k, v in self.dense.hf_device_map.items()}
        elif not onload.is_onloaded(self.dense):  # (an onloaded model is on self.device already)
            self.dense.to(self.device)
        self.timings["load_model"] = time.perf_counter() - t0
        self.metrics["run"] = how_it_ran(self.world, self.device, cfg.recovery.shard, cfg.cache.teacher, dtype)
        self.num_layers = len(decoder_layers(self.dense))
        self.model_fp = model_fingerprint(self.dense, self.model_info["source"])
        r = cfg.recovery
        self.method = get_method(r.method)
        if cfg.prune.remove is not None:  # an impossible --remove fails before the data loads
            plan_pruning(self.num_layers, parse_layers(str(cfg.prune.remove)), blocks=r.blocks_per_run,
                         block1_init=r.block1_layout, final_block=r.final_block)
        t0 = time.perf_counter()
        d = cfg.data
        splits = token_splits(d.source, self.tokenizer, seq_len=d.seq_len, train_sequences=d.train_sequences,
                              test_sequences=d.heldout_sequences, validation_sequences=d.validation_sequences,
                              seed=d.seed, text_field=d.text_field, progress=self.progress)
        self.train_ids, self.heldout_ids, val_ids, self.data_info, _ = splits  # heldout_ids: the test rows
        self.val_ids = val_ids if val_ids.shape[0] else None
        self.eval_data = eval_data(splits, unseen_domain_rows(
            cfg.eval.domains if cfg.eval.perplexity else None, self.tokenizer, training_source=d.source,
            seq_len=d.seq_len, rows=cfg.eval.domain_sequences, seed=d.seed), cfg.eval)
        self.timings["data"] = time.perf_counter() - t0
        self.select_widths() if self.width else self.select_blocks()
        warm_start.resolve(self)  # the plan, the resolved recovery section and the teacher follow from it
        if cold := warm_start.resumes_cold(self):
            warm_start.resolve(self, cold_because=cold)
        if not create_output or not self.world.is_main:
            return
        # the output folder is touched only once model, plan and data are known good (a typo changes nothing)
        if self.folder is None:
            self.prepare_output()
        self.folder.open()
        self.cfg.save(self.out / "config.yaml")
        write_json(self.out / "plan.json", self.plan.to_dict(), "the pruning plan")

    def select_blocks(self) -> None:
        """The blocks to remove: explicit (``prune.remove``) or chosen by ``prune.criterion``."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if cfg.prune.remove is not None:
            self.selection = Selection(parse_layers(str(cfg.prune.remove)))
        else:
            n = blocks_for_ratio(self.dense, cfg.prune.ratio)
            calibration = None
            if cfg.prune.criterion in NEEDS_CALIBRATION:
                calibration = self.train_ids[:cfg.prune.calibration_sequences].to(self.device)
            with self.world.main_first():  # the others find rank 0's result in the cache
                self.selection = cached_selection(cfg.prune.criterion, self.dense, n, calibration,
                                                  model_fp=self.model_fp, root=self.cache_root)
        self.timings["criterion"] = time.perf_counter() - t0

    width = property(lambda self: self.cfg.prune.granularity == "width")  # width pruning, not blocks

    def select_widths(self) -> None:
        """Width pruning: the heads and MLP channels every block keeps (``prune.width_criterion``)."""
        from ..pruning.width import plan_width

        p = self.cfg.prune
        t0 = time.perf_counter()
        calibration = self.train_ids[:p.calibration_sequences].to(self.device)
        self.plan, _ = plan_width(self.dense, p.ratio, p.width_criterion, calibration, heads=p.width_heads)
        self.selection = Selection([], scores={"widths": self.plan.widths()})
        self.timings["criterion"] = time.perf_counter() - t0

    # ---- stage 2: prune, baseline evaluation ---------------------------------------
    def prune(self) -> None:
        if is_placed(self.dense):  # never the whole dense model in one place: only what the pruned model keeps
            keep = set(range(self.num_layers)) - set(self.plan.removed)
            keep |= {src for g in self.plan.groups for src in g.stitch.values()}
            model = placed_copy(self.dense, keep, self.device)
        elif onload.is_onloaded(self.dense):  # real weights only in the blocks recovery trains
            model = onload.pruned_copy(self.dense, self.plan, self.method.family, self.selection.replaced)
        else:
            model = copy.deepcopy(self.dense)
        if self.width:
            from ..model.width import slice_width

            self.pruned = slice_width(model, self.plan)
        else:
            layers = decoder_layers(model)
            for index, state in self.selection.replaced.items():  # e.g. LaCo's collapsed blocks
                layers[index].load_state_dict(state)
            self.pruned = prune(model, self.plan)
        p = self.cfg.prune
        self.metrics.update({
            "granularity": p.granularity, "removed_layers": list(self.plan.removed),
            "criterion": (p.width_criterion if self.width else p.criterion) if p.remove is None else "explicit",
            "criterion_scores": self.selection.scores,
            **pruning_account(self.dense, self.pruned, self.plan.removed),
            "recovery_modules": [g.to_dict() for g in self.plan.groups],
        })
        if self.width:
            self.metrics["widths"] = {"before": {k: getattr(self.dense.config, k, None) for k in self.plan.widths()},
                                      "after": self.plan.widths()}

    def evaluate_model(self, model, tag: str) -> None:
        """The figures of the dense, pruned or recovered model (:func:`.scoring.score_model`)."""
        score_model(self, model, tag)

    # ---- stage 3: the recovery method and its data -------------------------------
    def build_recovery(self, with_data: bool = True) -> None:
        """Set up ``recovery.method`` on the pruned model, after fixing a time budget's step
        count (``with_data=False``: no feature cache and no measurement, for re-exporting
        from checkpoints and ``overrep inspect``)."""
        assert self.recovery is None, "the recovery is built once"
        self.recovery_started = t0 = time.perf_counter()  # a time budget counts from here
        self.cpu_meter = CpuMeter() if not self.world.distributed else None  # what others took of the CPUs meanwhile
        r = self.cfg.recovery
        budgeted = self.budgeted
        # under a time budget a warm start's map is fitted once the probe has timed its layout
        # (warm_start.fit_budget_warm_or_cold); otherwise once, here
        deferred = budgeted and with_data and fits_warm_start(self.rcfg, self.method)
        prepared = {} if deferred else prepare_closed_form(self.method_inputs(), self.method)
        if budgeted:
            seconds, limit = run_limit_budget(self) if with_data else (None, None)

            def fit(started: float, prepared: dict, warm: bool, timed: tuple | None = None, timed_by: str | None = None):
                return fit_budget(self.method, self.method_inputs(), cache_mode=self.cfg.cache.mode, started=started,
                                  world=self.world, resumed_total=checkpointed_total(self.out) if self.resume
                                  else None, make_trainer=lambda objective: self.make_trainer(objective, False),
                                  measure=with_data, prepared=prepared, seconds=seconds, warm=warm, timed=timed,
                                  timed_by=timed_by)
            self.budget, prepared = warm_start.fit_budget_warm_or_cold(self, fit, t0, prepared, deferred)
            if self.budget is not None and limit is not None:
                self.budget.info["run_limit"] = limit
        if self.budget is not None:
            self.total_steps = self.budget.steps
            if self.budget.rows is not None:
                self.train_ids = self.train_ids[:self.budget.rows]
                self.teacher.use_rows(self.budget.rows)
            self.metrics["time_budget"] = self.budget.info
            torch.manual_seed(r.seed)  # the measured steps leave no trace: a fresh recovery
        self.recovery = build_recovery(self.method_inputs(), self.method, with_data=with_data, prepared=prepared)
        self.note_cache()
        if self.recovery.search_seconds:
            self.timings["search"] = self.recovery.search_seconds
        self.metrics.update(method=self.method.name, objective=self.method.objective, lr=self.rcfg.lr,
                            trainable_params=self.recovery.trainable_params, precision=self.rcfg.precision,
                            recovery_ratio=self.recovery.trainable_params / self.metrics["pruned_params"],
                            loss=self.recovery.describe().get("loss"))  # precision: resolved; loss: None for LM/KD

    @property
    def budgeted(self) -> bool:
        """Whether the recovery trains to ``recovery.time_budget`` (no step count set; a closed form has no steps)."""
        r = self.cfg.recovery
        return r.time_budget is not None and r.steps is None and self.method.trains

    def method_inputs(self) -> MethodInputs:
        return MethodInputs(self.pruned, self.dense, self.plan, self.rcfg, self.train_ids,  # probes: never test
                            self.val_ids if self.val_ids is not None else self.train_ids,
                            self.total_steps, self.teacher, self.val_ids, self.shared_prefix,
                            progress=self.progress)

    @property
    def cache_root(self) -> Path:
        """Where features, criterion results and loss constants are cached (``cache.dir``)."""
        return Path(self.cfg.cache.dir) if self.cfg.cache.dir else cache_root()

    def make_teacher(self) -> Teacher:
        """The dense side of the plan: features (``cache.mode``) and loss constants, cached
        under ``cache.dir`` keyed by model, plan, data and sequence length."""
        c = self.cfg.cache
        fingerprint = {"model": self.model_fp, "plan": self.plan.to_dict(), "data": self.data_info.get("train_fingerprint"),
                       "seq_len": self.cfg.data.seq_len, "model_dtype": str(self.dense.dtype).removeprefix("torch."),
                       "precision": self.rcfg.precision}
        return Teacher(self.dense, self.plan, self.train_ids, self.cache_root, fingerprint, mode=c.mode, dtype=c.dtype,
                       rebuild=c.rebuild, progress=self.progress, world=self.world, precision=self.rcfg.precision,
                       stream_from=Path(self.model_info["folder"]) if c.teacher == "stream" else None)

    def features(self):
        """Build (or open) the feature cache: ``overrep cache``."""
        source = self.teacher.features()
        self.note_cache()
        return source

    def note_cache(self) -> None:
        if self.teacher.seconds:
            self.timings["cache"] = self.teacher.seconds  # a budgeted run's rebuild adds its reopen
        if self.teacher.cache is not None:
            self.metrics["cache"] = {"path": str(self.teacher.cache.path), "bytes": self.teacher.cache.nbytes,
                                     "build_seconds": self.teacher.cache.build_seconds}

    # ---- stage 4: training ---------------------------------------------------------
    def make_trainer(self, objective=None, resume: bool | None = None) -> Trainer:
        """A trainer for the recovery's objective (or ``objective``: a time budget's
        measurement), resumed from the checkpoints under ``--resume`` (or ``resume``)."""
        cfg = self.cfg
        run = {k: v for k, v in cfg.to_dict().items() if k != "output"}
        run["recovery"].pop("shard")  # sharded or not, the same checkpoints
        fingerprint = digest({"cfg": run, "model": self.model_fp})
        cadence = None if objective is not None or self.budget is None else self.budget.eval_every  # validation_share
        objective = objective if objective is not None else self.recovery.objective
        if self.rcfg.shard == "fsdp":  # before the optimiser: it steps the shards
            shard_objective(objective, self.world)
        trainer = Trainer(objective, self.train_ids.shape[0], self.rcfg, self.total_steps, self.out / "checkpoints",
                          tokens_per_sample=cfg.data.seq_len, fingerprint=fingerprint, progress=self.progress,
                          world=self.world, eval_every=cadence)
        if self.resume if resume is None else resume:
            trainer.resume()
        return trainer

    def train(self) -> None:
        r = self.cfg.recovery
        if not self.method.trains:  # a closed form, fitted when the method was set up
            return self.metrics.update(train_steps=0, train_seconds=0.0)
        self.trainer = trainer = self.make_trainer()
        trainer.budget_clock = None if self.budget is None else self.recovery_started  # carried across a resume
        trainer.score_start = self.rcfg.warm_start != "none"  # recovery.keep_best may keep the closed form
        if self.budget is not None and self.budget.costs is not None and trainer.step == 0:  # re-fit once it runs
            trainer.deadline = Deadline(self.recovery_started + self.budget.info["seconds"], self.budget.costs,
                                        trainer.eval_every, r.checkpoint_every)
        result = trainer.run()
        gather(self.recovery.objective)  # recovery.shard: fsdp -- full plain blocks again, for the merge
        if self.budget is not None:
            self.metrics["time_budget"].update(budget_outcome(trainer))
            if self.teacher is not None and self.teacher.live_rows_read:  # the later phase read past the cache
                self.metrics["time_budget"].update(live_rows=self.teacher.live_rows_read,
                                                   live_seconds=round(self.teacher.live_seconds, 2))
        if self.cpu_meter is not None:
            self.metrics["cpu_shared"] = self.cpu_meter.read()
        if self.world.is_main:
            trainer.write_log(self.out / "train_log.jsonl")
        self.metrics.update({"train_steps": result.steps, "train_seconds": result.seconds, "train_tokens": result.tokens,
                             "train_tokens_per_second": result.tokens_per_second, "keep_best": trainer.selected,
                             **compute_spent(self, trainer),
                             "final_train_loss": result.history[-1]["loss"] if result.history else None,
                             "final_val_loss": next((h["val_loss"] for h in reversed(result.history)
                                                     if h.get("val_loss") is not None), None)})
        self.history = result.history

    # ---- stage 5: fold back into the compact model and check -----------------------
    def merge(self) -> None:
        self.metrics.update(self.recovery.finish())
        self.pruned = self.recovery.model  # an adapter method's merge returns a new model

    # ---- stage 6: export -----------------------------------------------------------
    def export(self) -> Path:
        if not self.method.exports:
            raise OverRepError(f"{self.method.name} needs a module the stock architecture lacks (an extra d x d patch "
                               "at each gap): it is scored by `overrep run`, never exported")
        training = ("train_steps", "train_seconds", "train_tokens", "final_train_loss", "final_val_loss")
        provenance = {
            "overrep_version": __version__, "source_model": self.model_info, "removed_layers": list(self.plan.removed),
            "plan": self.plan.to_dict(), "method": self.method.name, "recovery": self.recovery.describe(),
            "merge_max_abs_diff": self.metrics.get("merge_max_abs_diff"),
            "training": {k: self.metrics.get(k) for k in training}, "data": self.data_info, "config": self.cfg.to_dict(),
        }
        path, diff = export_checked(self.pruned, self.tokenizer, self.out / "model", provenance, self.train_ids[:1],
                                    self.device)  # reloaded as it is held: whole, or block by block
        self.metrics.update(export_reload_max_abs_diff=diff, model_dir=str(path))
        return path

    def export_pruned(self) -> Path:
        """The pruned model without recovery, as a loadable folder (a baseline)."""
        provenance = {"overrep_version": __version__, "source_model": self.model_info, "method": "none",
                      "removed_layers": list(self.plan.removed), "plan": self.plan.to_dict(), "config": self.cfg.to_dict()}
        return export_model(self.pruned, self.tokenizer, self.out / "pruned-model", provenance, overwrite=True)

    # ---- the public entry points ---------------------------------------------------
    def prepare(self, *, evaluate: tuple[str, ...] = (), recovery: bool = True, with_data: bool = True,
                create_output: bool = True) -> None:
        """Everything before training: model, plan and data, the pruned model, the baseline
        evaluations named in ``evaluate`` ("dense", "pruned"), and the recovery method set up
        (``recovery=False``: stop at the pruned model; ``with_data``: see :meth:`build_recovery`)."""
        self.load(create_output=create_output)
        self.prune()
        for tag in evaluate:
            self.evaluate_model(self.dense if tag == "dense" else self.pruned, tag)
        if recovery:
            self.build_recovery(with_data=with_data)

    def recover(self) -> None:
        """Train, then fold the recovery into the compact model (rank 0 merges)."""
        self.train()
        if self.world.is_main:
            self.merge()

    def run(self) -> dict:
        self.run_started = time.perf_counter()
        self.prepare_output()
        try:
            with self.output_guard():
                return self._run()
        finally:
            if self._offload is not None:  # model.device_map's offloaded weights
                self._offload.cleanup()

    def _run(self) -> dict:
        t_start = time.perf_counter()
        self.prepare(evaluate=("dense", "pruned"))
        self.recover()
        if not self.world.is_main:  # the rest is written once
            return self.metrics
        self.evaluate_model(self.pruned, "recovered")
        if self.method.exports:
            self.export()
        else:  # a reference whose extra module the stock architecture lacks (LinearPatch): scored, never saved
            log.warning("%s needs a module the stock architecture lacks: scored above, no model folder written",
                        self.method.name)
            self.metrics["model_dir"] = None
        from .report import recovery_check, write_report
        self.metrics.update({
            "preset": getattr(self.recovery, "preset", None) and self.recovery.preset.name,
            "model": self.model_info["source"], "peak_memory_bytes": peak_memory_bytes(self.device),
            "data": {k: v for k, v in self.data_info.items() if not isinstance(v, (list, dict))},
            "timings_seconds": self.timings, "total_seconds": time.perf_counter() - t_start,
            "environment": environment(self.device), "recovery_check": recovery_check(self.metrics),
        })
        write_report(self.out, self.metrics, self.history, self.cfg)
        write_json(self.out / "metrics.json", self.metrics, "the metrics")  # last: marks the run finished
        return self.metrics
