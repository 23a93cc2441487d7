"""``overrep plan``: what pruning and recovering a model will cost, from its config alone.

The model is built on PyTorch's ``meta`` device (shapes, no storage), pruned and wrapped
by the same code a run uses (:mod:`overrep.model.accounting`), so a 70B config plans in
about a second. :func:`make_plan` returns one dict (``overrep plan --json`` prints it);
:mod:`overrep.app.plan_report` renders it as text. How each number is computed:

* **Removal.** ``--ratio`` resolves to whole blocks as every run does
  (:func:`~overrep.model.accounting.blocks_for_ratio`: the output head counts as its own
  matrix, the block count is the nearest whole number) and picks them with the ``last``
  criterion, the only one that needs no weights.
* **Per preset.** Trainable parameters and the training state of the recovery module:
  AdamW keeps, per trainable parameter, the weight and its gradient at the weights' width
  (4 B each in float32) and two moments (8 B); frozen module parameters cost their weight;
  under ``bf16`` autocast with float32 weights, autocast also holds a 2 B copy of every
  module parameter during a step.
* **Feature cache.** Per recovery group, the hidden state entering it and the one it must
  reproduce: ``groups x 2 x sequences x seq_len x hidden x bytes(cache dtype)``.
* **FLOPs.** ``2 x MACs`` a forward (:mod:`overrep.model.flops`: every projection, the
  per-token products with D, the experts a token is routed to, the attention scores). The
  teacher runs the dense model up to the last block any group needs, once per token to
  build the cache (every epoch when live). A training step is forward plus backward,
  about ``3 x`` the forward (the backward computes gradients for inputs and weights,
  ``2 x`` the forward; Kaplan et al. 2020), over ``batch x seq_len`` tokens.
* **Layout.** See :func:`recommend_layout`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from .config import CacheConfig, ModelConfig, RecoveryConfig
from ..core.precision import check_precision
from ..errors import OverRepError
from ..model.accounting import blocks_for_ratio, counted_parameters, meta_model, recovery_account
from ..model.arch import check_supported, decoder_layers
from ..model.flops import blocks_macs
from ..model.presets import BUILTIN_PRESETS, get_preset
from ..model.surgery import parse_layers, plan_pruning
from ..model.wrap import count_parameters, plan_recovery
from ..pruning.last import last_but_final
from .plan_command import MEMORY_FRACTION, choose_teacher, run_command, scaled_lr

STATE_FRACTION = 0.5
"""Share of one GPU's memory the resident training state may take (the recovery module's
weights, gradients and AdamW state, plus a live teacher's weights); the rest is left for
activations, the feature batch and the allocator."""

BYTES = {"float32": 4, "bfloat16": 2}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", re.I)


def parse_size(text: str, flag: str) -> int:
    """Bytes in ``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"2TB"``, ``"512M"`` or a plain number."""
    m = _SIZE.fullmatch(str(text))
    if not m or float(m.group(1)) <= 0:
        raise OverRepError(f"{flag} must be a size such as 80GB, 80GiB or 2TB, got {text!r}")
    power = "KMGT".index(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


@dataclass
class PlanOptions:
    """What to plan for; the defaults are the paper's protocol and the project's run defaults."""

    ratio: float | None = None
    """Fraction of the counted parameters to remove (default 0.25 when ``remove`` is unset)."""
    remove: str | None = None
    """Explicit dense block indices instead of a ratio, e.g. ``"21-28"``."""
    preset: str = "hybrid"
    """The preset the layout is recommended for (every built-in preset is accounted)."""
    blocks: int = 2
    block1_init: str = "stitched"
    gpus: int = 1
    gpu_mem: str = "80GB"
    disk: str = "2TB"
    """Disk the feature cache may take; a larger cache means a live teacher."""
    sequences: int = 120_000
    """Training sequences: the paper's 120K FineWeb-Edu samples."""
    seq_len: int = 1024
    batch: int = RecoveryConfig.batch_size
    epochs: float = 20
    """The paper's OverRep schedule (Table ``tab:post-train-config``)."""
    cache_dtype: str = CacheConfig.dtype
    dtype: str = "auto"
    """Weights of the dense teacher and the recovery module (``model.dtype``; ``auto`` is
    bfloat16 on a GPU, and is counted so)."""
    precision: str = "bf16"
    """Compute precision of the training forward (``recovery.precision``; a cluster's GPUs have bf16)."""
    nodes: int = 1
    """Machines the GPUs are spread over (``--gpus`` counts all of them)."""
    data: str | None = "hf:HuggingFaceFW/fineweb-edu:sample-10BT"
    """The command's ``data.source``: the paper's FineWeb-Edu by default (None: the run's default)."""
    run_model: str = "MODEL"
    """The model the command runs (a folder or hub id; the plan itself reads only a config)."""

    def check(self) -> None:
        for name in ("blocks", "gpus", "sequences", "seq_len", "batch", "nodes"):
            if getattr(self, name) < 1:
                raise OverRepError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.epochs > 0:
            raise OverRepError(f"--epochs must be positive, got {self.epochs}")
        self.model_dtype = getattr(self, "model_dtype", self.dtype)  # as the command sets it
        if self.dtype == "auto":  # a plan is for GPUs, where auto is bfloat16
            self.dtype = "bfloat16"
        for name in ("cache_dtype", "dtype"):
            if getattr(self, name) not in BYTES:
                raise OverRepError(f"--{name.replace('_', '-')} must be float32 or bfloat16, got {getattr(self, name)!r}")
        check_precision(self.precision, "--precision")
        if self.precision == "auto":  # a plan is for a cluster's GPUs, which compute bf16
            self.precision = "bf16"
        if self.preset not in BUILTIN_PRESETS:
            raise OverRepError(f"--preset must be a built-in preset ({', '.join(BUILTIN_PRESETS)}), got {self.preset!r}")
        if self.gpus % self.nodes:
            raise OverRepError(f"--gpus ({self.gpus}) must be a multiple of --nodes ({self.nodes})")
        parse_size(self.gpu_mem, "--gpu-mem")
        parse_size(self.disk, "--disk")


def _model(config):
    try:
        model = meta_model(config)
    except (ValueError, KeyError, TypeError) as error:
        raise OverRepError(f"unsupported architecture {type(config).__name__}: no causal LM builds from it "
                           f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    check_supported(model)
    return model


def _removal(model, opts: PlanOptions) -> dict:
    """Which dense blocks go, and what fraction of the counted parameters that is."""
    num_layers = len(decoder_layers(model))
    total, per_block = counted_parameters(model)
    if opts.remove is not None:
        removed, how = parse_layers(opts.remove), f"--remove {opts.remove}"
        plan_pruning(num_layers, removed)  # validates the indices
    else:
        ratio = 0.25 if opts.ratio is None else opts.ratio
        n = blocks_for_ratio(model, ratio)
        removed, how = last_but_final(model, n).removed, f"--ratio {ratio:g}, criterion 'last'"
    n = len(removed)
    return {"how": how, "removed": removed, "num_removed": n, "num_layers": num_layers,
            "layers_left": num_layers - n, "counted_params": total, "params_per_block": per_block,
            "counted_fraction": n * per_block / total,
            "neighbours": {k: k * per_block / total for k in (n - 1, n + 1) if 0 < k < num_layers - 1}}


def _preset_rows(config, removed: list[int], opts: PlanOptions) -> list[dict]:
    """Parameters, training state and training FLOPs of every built-in preset (and of the
    single fine-tuned block Streamline trains: ``plain-full`` with one block)."""
    weight_bytes = BYTES[opts.dtype]
    autocast_copy = 2 if opts.precision == "bf16" and opts.dtype == "float32" else 0
    rows = []
    streamline = [("plain-full", 1)] if opts.blocks != 1 else []
    for name, blocks in [(p, opts.blocks) for p in BUILTIN_PRESETS] + streamline:
        acc = recovery_account(config, removed, name, blocks=blocks, block1_init=opts.block1_init,
                               train_bytes=weight_bytes, seq_len=opts.seq_len)
        train_flops_token = 3 * 2 * acc["module_macs_per_token"]
        rows.append({"preset": name, "blocks": blocks,
                     "selected": name == opts.preset and blocks == opts.blocks,
                     "trainable_params": acc["trainable_params"], "module_params": acc["recovery_module_params"],
                     "recovery_ratio": acc["recovery_ratio"],
                     "train_state_bytes": acc["train_state_bytes"] + autocast_copy * acc["recovery_module_params"],
                     "train_flops_per_token": train_flops_token,
                     "train_flops_per_sequence": train_flops_token * opts.seq_len,
                     "train_flops_per_step": train_flops_token * opts.seq_len * opts.batch})
    return rows


def recommend_layout(state_bytes: int, teacher_bytes: int, cache_bytes: int, opts: PlanOptions) -> dict:
    """Ranks, FSDP or not, cached or live teacher, by three rules:

    1. **Teacher**: cache the features when the cache fits ``--disk``, else run the dense
       model live every step (then its weights are resident too).
    2. **Ranks**: data parallel (DDP) over ``min(gpus, batch)`` ranks; a rank needs at least
       one sequence a step.
    3. **FSDP**: when the resident state (training state, plus the teacher's weights when
       live) exceeds :data:`STATE_FRACTION` of one GPU's memory, shard it over the ranks
       (FSDP); if a shard still does not fit, say how many GPUs would be needed.
    """
    gpu, disk = parse_size(opts.gpu_mem, "--gpu-mem"), parse_size(opts.disk, "--disk")
    live = cache_bytes > disk
    resident = state_bytes + (teacher_bytes if live else 0)
    ranks = min(opts.gpus, opts.batch)
    budget = STATE_FRACTION * gpu
    fsdp = resident > budget and ranks > 1
    # FSDP shards the recovery modules' state; a live teacher's weights stay whole on every rank
    per_rank = (state_bytes / ranks + (resident - state_bytes)) if fsdp else resident
    fits = per_rank <= budget
    return {"teacher": "live" if live else "cache", "ranks": ranks, "fsdp": fsdp, "fits": fits,
            "sequences_per_rank_step": opts.batch / ranks, "idle_gpus": opts.gpus - ranks,
            "resident_bytes": resident, "per_rank_bytes": per_rank, "budget_bytes": budget,
            "gpu_bytes": gpu, "disk_bytes": disk, "state_fraction": STATE_FRACTION,
            "gpus_needed": math.ceil(resident / budget)}


def _teacher(model, plan, opts: PlanOptions) -> dict:
    """The dense model up to the last block a recovery group needs: weights and forward FLOPs."""
    layers = decoder_layers(model)
    last = max(g.target_layer for g in plan.groups)
    params = count_parameters(model) - sum(count_parameters(layer) for layer in layers[last + 1:])
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is not embed.weight:
        params -= head.weight.numel()  # the head never runs for features
    per_token = 2 * blocks_macs(layers[:last + 1], model.config, opts.seq_len)
    return {"last_block": last, "params": params, "weight_bytes": params * BYTES[opts.dtype],
            "flops_per_token": per_token, "cache_build_flops": per_token * opts.sequences * opts.seq_len,
            "live_flops_per_step": per_token * opts.seq_len * opts.batch}


def make_plan(config, opts: PlanOptions, source: str = "") -> dict:
    """Everything ``overrep plan`` prints, for ``config`` (a transformers config) and ``opts``."""
    opts.check()
    model = _model(config)
    removal = _removal(model, opts)
    plan = plan_recovery(model, removal["removed"], get_preset(opts.preset), blocks=opts.blocks,
                         block1_init=opts.block1_init)
    rows = _preset_rows(config, removal["removed"], opts)
    chosen = next(r for r in rows if r["selected"])
    teacher = _teacher(model, plan, opts)
    layers = decoder_layers(model)
    dense = count_parameters(model)
    compact = dense - sum(count_parameters(layers[i]) for i in removal["removed"])
    tokens = opts.sequences * opts.seq_len
    cache_bytes = len(plan.groups) * 2 * tokens * config.hidden_size * BYTES[opts.cache_dtype]
    steps = math.ceil(math.ceil(opts.sequences / opts.batch) * opts.epochs)
    head = model.get_output_embeddings()
    outside = dense - sum(count_parameters(layer) for layer in layers)  # embeddings, final norm, head
    stream = (outside + max(count_parameters(layer) for layer in layers)) * BYTES[opts.dtype]
    layout = state = weights = None
    for resident_teacher in (teacher["weight_bytes"], 0):  # a live teacher: whole, else onloaded (one block)
        layout = recommend_layout(chosen["train_state_bytes"], resident_teacher, cache_bytes, opts)
        state = chosen["train_state_bytes"] / (layout["ranks"] if layout["fsdp"] else 1)  # the weights come next
        weights = choose_teacher(dense * BYTES[opts.dtype], compact * BYTES[opts.dtype], stream, state,
                                 layout["gpu_bytes"])
        if weights["teacher"] == "model" or layout["teacher"] == "cache":
            break
    layout["single_process_bytes"] = (dense + compact) * BYTES[opts.dtype]
    layout.update(teacher_weights=weights["teacher"], weights_bytes=weights["weights_bytes"],
                  per_rank_total_bytes=weights["per_rank_total_bytes"], state_per_rank_bytes=state,
                  whole_weights_bytes=(dense + compact) * BYTES[opts.dtype], onloaded_weights_bytes=stream,
                  memory_budget_bytes=weights["memory_budget_bytes"], memory_fraction=MEMORY_FRACTION,
                  fits=layout["fits"] and weights["fits"], lr=scaled_lr(opts.batch))
    out = {
        "source": source, "architecture": type(model).__name__, "model_type": config.model_type,
        "hidden_size": config.hidden_size, "num_layers": removal["num_layers"], "vocab_size": config.vocab_size,
        "tied_head": head is not None and head.weight is model.get_input_embeddings().weight,
        "dense_params": dense, "compact_params": compact,
        "removal": removal, "groups": [g.to_dict() for g in plan.groups], "presets": rows,
        "data": {"sequences": opts.sequences, "seq_len": opts.seq_len, "tokens": tokens, "batch": opts.batch,
                 "epochs": opts.epochs, "steps": steps},
        "cache": {"dtype": opts.cache_dtype, "groups": len(plan.groups), "bytes": cache_bytes},
        "teacher": teacher,
        "training": {**{k: chosen[k] for k in ("preset", "blocks", "train_flops_per_token",
                                               "train_flops_per_sequence", "train_flops_per_step")},
                     "run_flops": chosen["train_flops_per_step"] * steps},
        "layout": layout, "options": {**asdict(opts), "model_dtype": opts.model_dtype},
    }
    layout["ranks_per_node"] = layout["ranks"] // opts.nodes if layout["ranks"] % opts.nodes == 0 else None
    if layout["ranks_per_node"] is None:  # every machine runs the same number of ranks
        raise OverRepError(f"{layout['ranks']} ranks (min(gpus, batch)) do not divide over {opts.nodes} nodes; "
                           "raise --batch")
    layout["command"] = run_command(out, opts)
    return out
