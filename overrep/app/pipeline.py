"""The end-to-end job: prune -> cache -> recover -> merge -> export -> evaluate.

Read top to bottom; each stage is a method of :class:`Pipeline` so the CLI can run a
stage on its own (``overrep cache``, ``overrep recover`` ...) or all of them
(``overrep run``). Everything a run produces lives in its output folder:

    config.yaml      resolved configuration          plan.json      removed blocks, modules
    checkpoints/     resumable training state        train_log.jsonl  per-step losses
    model/           the compact Hugging Face model  metrics.json   numbers (written last)
    report.md        readable summary with plots     plots/         PNG figures

``metrics.json`` is written last, so its presence marks a finished run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import platform
import time
from pathlib import Path

import torch

from .. import __version__
from ..atomic import write_json
from ..core.precision import resolve_precision
from ..data.text import token_splits
from ..errors import OverRepError
from ..eval.heldout import domain_perplexities, unseen_domain_rows
from ..eval.measure import generation_latency
from ..model.accounting import blocks_for_ratio, counted_parameters
from ..model.arch import check_supported, decoder_layers
from ..model.loading import load_model
from ..model.placement import is_placed, placed_copy, teacher_placement
from ..model.runtime import digest, model_fingerprint, peak_memory_bytes, resolve_device
from ..model.surgery import can_stitch, parse_layers, plan_pruning, prune
from ..model.presets import get_preset
from ..model.wrap import count_parameters, plan_recovery
from ..pruning.cached import cached_selection
from ..pruning.criteria import NEEDS_CALIBRATION
from ..recovery.budget import Deadline, parse_duration
from ..recovery.methods import build_recovery, get_method
from ..recovery.teacher import MethodInputs, Teacher
from ..recovery.sharding import gather, shard_objective
from ..recovery.trainer import Trainer
from ..paths import cache_root
from ..distributed import World, world_from_env
from .budgeting import BudgetStages
from .config import RunConfig
from .export import export_model
from .outdir import RunFolder

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Pipeline(BudgetStages):
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
        self.metrics, self.timings, self.benchmark_results = {}, {}, {}  # numbers, seconds per stage, lm-eval

    # ---- stage 0: output folder ----------------------------------------------------
    def prepare_output(self) -> None:
        """Check what the output folder allows (``--resume``, ``--overwrite``); writes nothing.
        The folder is rank 0's: the other ranks never write into it."""
        if not self.world.is_main:
            return
        self.folder = RunFolder(self.out, resume=self.resume, overwrite=self.overwrite, reuse=self.reuse)
        self.folder.check()
        if (self.resume or self.reuse) and not self.overwrite and (self.out / "config.yaml").exists():
            saved = RunConfig.load(self.out / "config.yaml")
            mine = self.cfg.to_dict()
            diff = [k for k in mine if k != "output" and json.dumps(mine[k], default=str)
                    != json.dumps(saved.to_dict()[k], default=str)]
            if diff:
                raise OverRepError(f"--resume with a different configuration (section '{diff[0]}' differs from "
                                   f"{self.out / 'config.yaml'})")

    @contextlib.contextmanager
    def output_guard(self):
        """Around the stages that write: a failure before anything resumable exists leaves the
        disk as it was (see :mod:`overrep.app.outdir`); success drops a run ``--overwrite`` replaced."""
        try:
            yield
        except BaseException:
            folder = getattr(self, "folder", None)
            if folder is not None:
                folder.rollback()
            raise
        if getattr(self, "folder", None) is not None:
            self.folder.commit()

    # ---- stage 1: model, plan, data ------------------------------------------------
    def load(self, create_output: bool = True) -> None:
        cfg = self.cfg
        if cfg.recovery.threads:
            torch.set_num_threads(cfg.recovery.threads)
        torch.manual_seed(cfg.recovery.seed)
        self.device = self.world.device(resolve_device(cfg.model.device))
        t0 = time.perf_counter()
        placement, self._offload = teacher_placement(cfg.model.device_map, cfg.model.max_memory, self.world.size,
                                                     self.cache_root)  # model.device_map (None: whole, below)
        self.dense, self.tokenizer, self.model_info = load_model(cfg.model.source, dtype=_DTYPES[cfg.model.dtype],
                                                                 placement=placement)
        check_supported(self.dense)
        if is_placed(self.dense):  # where accelerate put the teacher's parts (a device, "cpu" or "disk")
            self.metrics["teacher_device_map"] = {k: str(v) for k, v in self.dense.hf_device_map.items()}
        else:
            self.dense.to(self.device)
        self.timings["load_model"] = time.perf_counter() - t0
        self.num_layers = len(decoder_layers(self.dense))
        self.model_fp = model_fingerprint(self.dense, self.model_info["source"])
        r = cfg.recovery
        self.method = get_method(r.method)
        if cfg.prune.remove is not None:  # an impossible --remove fails before the data loads
            plan_pruning(self.num_layers, parse_layers(str(cfg.prune.remove)), blocks=self.method.blocks or r.blocks,
                         block1_init=r.block1_init, final_block=r.final_block)
        t0 = time.perf_counter()
        d = cfg.data
        self.train_ids, self.heldout_ids, val_ids, self.data_info = token_splits(
            d.source, self.tokenizer, seq_len=d.seq_len, train_sequences=d.train_sequences,
            heldout_sequences=d.heldout_sequences, validation_sequences=d.validation_sequences, seed=d.seed,
            text_field=d.text_field, progress=self.progress)
        self.val_ids = val_ids if val_ids.shape[0] else None
        if d.validation_sequences and self.val_ids is None:
            log.warning("data %s: no training documents to spare for validation rows; val_ppl and "
                        "recovery.keep_best are off", d.source)
        self.unseen_ids = unseen_domain_rows(cfg.eval.domains if cfg.eval.perplexity else None, self.tokenizer,
                                             training_source=d.source, seq_len=d.seq_len,
                                             rows=cfg.eval.domain_sequences, seed=d.seed)
        self.timings["data"] = time.perf_counter() - t0
        if self.width:
            self.select_widths()
        else:
            self.select_blocks()
            self.plan = plan_recovery(self.dense, self.selection.removed, get_preset(self.method.preset or r.preset),
                                      blocks=self.method.blocks or r.blocks, block1_init=r.block1_init,
                                      final_block=r.final_block)
        layers = decoder_layers(self.dense)
        for g in self.plan.groups:  # a block a criterion already rewrote (LaCo) keeps its weights,
            for target, source in list(g.stitch.items()):  # and a hybrid's one-part block its own
                if target in self.selection.replaced or not can_stitch(layers, target, source):
                    del g.stitch[target]
        self.rcfg = dataclasses.replace(r, lr=r.lr if r.lr is not None else self.method.default_lr,
                                        precision=resolve_precision(r.precision, self.device))
        self.total_steps = cfg.total_steps()
        self.teacher = self.make_teacher()
        if not create_output or not self.world.is_main:
            return
        # The output folder is touched only once model, plan and data are known to be good, so
        # a typo in the command leaves everything as it was.
        if not hasattr(self, "folder"):
            self.prepare_output()
        self.folder.open()
        self.cfg.save(self.out / "config.yaml")
        write_json(self.out / "plan.json", self.plan.to_dict(), "the pruning plan")

    def select_blocks(self) -> None:
        """The blocks to remove: explicit (``prune.remove``) or chosen by ``prune.criterion``."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if cfg.prune.remove is not None:
            from ..pruning.criteria import Selection

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

    @property
    def width(self) -> bool:
        return self.cfg.prune.granularity == "width"

    def select_widths(self) -> None:
        """Width pruning: the heads and MLP channels every block keeps (``prune.width_criterion``)."""
        from ..pruning.selection import Selection
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
        dense_params, compact_params = count_parameters(self.dense), count_parameters(self.pruned)
        counted, _ = counted_parameters(self.dense)
        p = self.cfg.prune
        self.metrics.update({
            "granularity": p.granularity,
            "removed_layers": list(self.plan.removed),
            "criterion": (p.width_criterion if self.width else p.criterion) if p.remove is None else "explicit",
            "criterion_scores": self.selection.scores,
            "num_layers_before": self.num_layers,
            "num_layers_after": self.num_layers - len(self.plan.removed),
            "layer_fraction_removed": len(self.plan.removed) / self.num_layers,
            "param_fraction_removed": 1 - compact_params / dense_params,
            "param_fraction_removed_head_counted": (dense_params - compact_params) / counted,
            "dense_params": dense_params,
            "pruned_params": compact_params,
            "recovery_modules": [g.to_dict() for g in self.plan.groups],
        })
        if self.width:
            self.metrics["widths"] = {"before": {k: getattr(self.dense.config, k, None) for k in self.plan.widths()},
                                      "after": self.plan.widths()}

    def evaluate_model(self, model, tag: str) -> None:
        if not self.world.is_main:
            return
        ev = self.cfg.eval
        t0 = time.perf_counter()
        if ev.perplexity:
            ppl = domain_perplexities(model, self.heldout_ids, self.data_info.get("components"), self.unseen_ids,
                                      desc=f"ppl {tag}", progress=self.progress)
            self.metrics[f"{tag}_ppl"] = ppl["all"]
            if ppl["domains"] or ppl["unseen"]:
                self.metrics[f"{tag}_ppl_domains"] = {**ppl["domains"], **ppl["unseen"]}
        if ev.latency:
            lat = generation_latency(model, self.tokenizer, ev.sample_prompt, ev.latency_tokens)
            self.metrics[f"{tag}_latency_s_per_token"] = lat["seconds_per_token"]
            self.metrics.setdefault("samples", {})[tag] = lat["text"]
        if ev.benchmarks:
            from ..eval.lmeval import evaluate_benchmarks

            results = evaluate_benchmarks(model, self.tokenizer, tasks=ev.benchmarks, limit=ev.benchmark_limit,
                                          output=self.out / "benchmarks" / f"{tag}.json", progress=self.progress)
            self.benchmark_results[tag] = results
            self.metrics.setdefault("benchmarks", {})[tag] = {
                b: r.get("value") for b, r in results["tasks"].items() if r.get("status") == "ok"}
            if tag != "dense" and "dense" in self.benchmark_results:
                from ..eval.retained import retained_performance

                rp = retained_performance(results, self.benchmark_results["dense"])
                self.metrics.setdefault("retained_performance", {})[tag] = {
                    suite: v.get("rp") for suite, v in rp.items()}
        self.metrics[f"{tag}_params"] = count_parameters(model)
        self.timings[f"eval_{tag}"] = time.perf_counter() - t0

    # ---- stage 3: the recovery method and its data -------------------------------
    def build_recovery(self, with_data: bool = True) -> None:
        """Set up ``recovery.method`` on the pruned model (``with_data=False``: no feature
        cache, for re-exporting from checkpoints)."""
        t0 = time.perf_counter()
        self.recovery_started = getattr(self, "recovery_started", t0)  # a time budget counts from here
        if with_data and self.budget_sizes_cache() and "time_budget" not in self.metrics:
            self.fit_cached_budget()
        cached = self.teacher.seconds
        self.recovery = build_recovery(self.method_inputs(), self.method, with_data=with_data)
        self.note_cache()
        # what a rebuild (a time budget's) costs again: not the cache, nor a search it reads back
        self.build_seconds = time.perf_counter() - t0 - (self.teacher.seconds - cached) - (
            self.recovery.search_seconds if self.recovery.searched_now else 0.0)
        if self.recovery.search_seconds:
            self.timings["search"] = self.recovery.search_seconds
        self.metrics.update(method=self.method.name, objective=self.method.objective)
        self.metrics["trainable_params"] = self.recovery.trainable_params
        self.metrics["recovery_ratio"] = self.metrics["trainable_params"] / self.metrics["pruned_params"]
        self.metrics.update(lr=self.rcfg.lr, precision=self.rcfg.precision)  # precision: resolved for the device
        self.metrics["loss"] = self.recovery.describe().get("loss")  # the layer-wise loss; None for LM/KD methods

    def method_inputs(self) -> MethodInputs:
        return MethodInputs(self.pruned, self.dense, self.plan, self.rcfg, self.train_ids, self.heldout_ids,
                            self.total_steps, self.teacher, self.val_ids)

    @property
    def cache_root(self) -> Path:
        """Where features, criterion results and loss constants are cached (``cache.dir``)."""
        return Path(self.cfg.cache.dir) if self.cfg.cache.dir else cache_root()

    def make_teacher(self) -> Teacher:
        """The dense side of the plan: features (``cache.mode``) and loss constants, cached
        under ``cache.dir`` keyed by model, plan, data and sequence length."""
        c = self.cfg.cache
        fingerprint = {"model": self.model_fp, "plan": self.plan.to_dict(),
                       "data": self.data_info.get("train_fingerprint"), "seq_len": self.cfg.data.seq_len,
                       "model_dtype": self.cfg.model.dtype}
        stream = None
        if c.teacher == "stream":
            if self.model_info["kind"] not in ("local", "embedded"):
                raise OverRepError("cache.teacher: stream reads a local Hugging Face folder; "
                                   f"model.source is a {self.model_info['kind']} model")
            stream = Path(self.model_info["source"])
        return Teacher(self.dense, self.plan, self.train_ids, self.cache_root, fingerprint, mode=c.mode, dtype=c.dtype,
                       rebuild=c.rebuild, progress=self.progress, world=self.world, stream_from=stream)

    def features(self):
        """Build (or open) the feature cache: ``overrep cache``."""
        source = self.teacher.features()
        self.note_cache()
        return source

    def note_cache(self) -> None:
        if self.teacher.seconds:
            self.timings["cache"] = self.teacher.seconds  # a budgeted run's rebuild adds its reopen
        if self.teacher.cache is not None:
            self.metrics["cache"] = {"path": str(self.teacher.cache_path), "bytes": self.teacher.cache.nbytes,
                                     "build_seconds": self.teacher.cache.build_seconds}

    # ---- stage 4: training ---------------------------------------------------------
    def make_trainer(self) -> Trainer:
        cfg = self.cfg
        run = {k: v for k, v in cfg.to_dict().items() if k != "output"}
        run["recovery"].pop("shard")  # sharded or not, the same checkpoints
        fingerprint = digest({"cfg": run, "model": self.model_fp})
        if self.rcfg.shard == "fsdp":  # before the optimiser: it steps the shards
            shard_objective(self.recovery.objective, self.world)
        self.trainer = Trainer(self.recovery.objective, self.train_ids.shape[0], self.rcfg, self.total_steps,
                               self.out / "checkpoints", tokens_per_sample=cfg.data.seq_len,
                               fingerprint=fingerprint, progress=self.progress, world=self.world)
        if self.resume:
            self.trainer.resume()
        return self.trainer

    def train(self) -> None:
        r = self.cfg.recovery
        if not self.recovery.trains:  # a closed form, fitted when the method was set up: nothing to train
            self.history, self.metrics["train_steps"], self.metrics["train_seconds"] = [], 0, 0.0
            return
        if r.time_budget is not None and r.steps is None and "time_budget" not in self.metrics:
            self.fit_time_budget()
        trainer = self.make_trainer()
        costs = getattr(self, "budget_costs", None)
        if costs is not None and trainer.step == 0:  # measured in this process: re-fit once it runs
            trainer.deadline = Deadline(self.recovery_started + parse_duration(r.time_budget), costs,
                                        r.eval_every, r.checkpoint_every)
        result = trainer.run()
        gather(self.recovery.objective)  # recovery.shard: fsdp -- full plain blocks again, for the merge
        if "time_budget" in self.metrics:
            info = self.metrics["time_budget"]
            info["used_seconds"] = time.perf_counter() - self.recovery_started
            if trainer.refit is not None:
                info["steps"], info["refit"] = trainer.total, trainer.refit
        if self.world.is_main:
            self.trainer.write_log(self.out / "train_log.jsonl")
        self.metrics.update({"train_steps": result.steps, "train_seconds": result.seconds,
                             "train_tokens": result.tokens, "train_tokens_per_second": result.tokens_per_second,
                             "final_train_loss": result.history[-1]["loss"] if result.history else None,
                             "final_val_loss": next((h["val_loss"] for h in reversed(result.history)
                                                     if h.get("val_loss") is not None), None),
                             "keep_best": trainer.selected})
        self.history = result.history

    # ---- stage 5: fold back into the compact model and check -----------------------
    def merge(self) -> None:
        self.metrics.update(self.recovery.finish())
        self.pruned = self.recovery.model  # an adapter method's merge returns a new model

    # ---- stage 6: export -----------------------------------------------------------
    def export(self) -> Path:
        from transformers import AutoModelForCausalLM

        provenance = {
            "overrep_version": __version__,
            "source_model": self.model_info,
            "removed_layers": list(self.plan.removed),
            "plan": self.plan.to_dict(),
            "method": self.method.name,
            "recovery": self.recovery.describe(),
            "merge_max_abs_diff": self.metrics.get("merge_max_abs_diff"),
            "training": {k: self.metrics.get(k) for k in ("train_steps", "train_seconds", "train_tokens",
                                                          "final_train_loss", "final_val_loss")},
            "data": self.data_info,
            "config": self.cfg.to_dict(),
        }
        path = export_model(self.pruned, self.tokenizer, self.out / "model", provenance, overwrite=True)
        reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=self.pruned.dtype).to(self.device).eval()
        ids = self.heldout_ids[:1].to(self.device)
        with torch.no_grad():
            d = (reloaded(ids).logits - self.pruned(ids).logits).abs().max().item()
        self.metrics.update(export_reload_max_abs_diff=d, model_dir=str(path))
        return path

    def export_pruned(self) -> Path:
        """The pruned model without recovery, as a loadable folder (a baseline)."""
        provenance = {"overrep_version": __version__, "source_model": self.model_info, "method": "none",
                      "removed_layers": list(self.plan.removed), "plan": self.plan.to_dict(),
                      "config": self.cfg.to_dict()}
        return export_model(self.pruned, self.tokenizer, self.out / "pruned-model", provenance, overwrite=True)

    # ---- everything ----------------------------------------------------------------
    def run(self) -> dict:
        self.prepare_output()
        try:
            with self.output_guard():
                return self._run()
        finally:
            if getattr(self, "_offload", None) is not None:  # model.device_map's offloaded weights
                self._offload.cleanup()

    def _run(self) -> dict:
        t_start = time.perf_counter()
        self.load()
        self.prune()
        self.evaluate_model(self.dense, "dense")
        self.evaluate_model(self.pruned, "pruned")
        self.build_recovery()
        self.train()
        if not self.world.is_main:  # the rest is written once
            return self.metrics
        self.merge()
        self.evaluate_model(self.pruned, "recovered")
        self.export()
        self.metrics.update({
            "preset": getattr(self.recovery, "preset", None) and self.recovery.preset.name,
            "model": self.model_info["source"], "peak_memory_bytes": peak_memory_bytes(self.device),
            "data": {k: v for k, v in self.data_info.items() if not isinstance(v, (list, dict))},
            "timings_seconds": self.timings, "total_seconds": time.perf_counter() - t_start,
            "environment": {"overrep": __version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                            "python": platform.python_version(), "machine": platform.machine()},
        })
        from .report import write_report
        write_report(self.out, self.metrics, self.history, self.cfg)
        write_json(self.out / "metrics.json", self.metrics, "the metrics")  # last: marks the run finished
        return self.metrics
