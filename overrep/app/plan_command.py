"""The run a plan describes: its memory per rank and the exact command that starts it.

:func:`choose_teacher` decides how the dense model is held, by one rule: load it whole
(``cache.teacher: model``, every rank holding the dense and the compact weights) when that,
plus the rank's share of the training state, fits :data:`MEMORY_FRACTION` of one GPU; else
onload it block by block (``cache.teacher: stream``): every rank then holds the embeddings
and head once, one block being read, and the training state (:mod:`overrep.model.onload`).

:func:`run_command` prints the layout as the command that runs it: ``overrep run`` for one
rank, ``torchrun --nproc-per-node N -m overrep run`` for several (``--nnodes``, a
rendezvous endpoint and the output and cache on ``$SHARED`` storage across machines), with the plan's removal, data, step count, batch,
weights dtype, teacher and sharding, and the learning rate scaled with the batch.
"""

from __future__ import annotations

import math
import shlex

MEMORY_FRACTION = 0.8
"""Share of one GPU's memory that weights plus training state may take; the rest is left for
activations, the feature batch and the allocator."""

BASE_BATCH = 8
"""The batch the methods' default learning rates were measured at (``recovery.batch_size``)."""

BASE_LR = 1e-3
"""OverRep's default learning rate at :data:`BASE_BATCH` (``overrep methods``)."""


def scaled_lr(batch: int, base_lr: float = BASE_LR) -> float:
    """The learning rate for ``batch``: square-root scaling from :data:`BASE_BATCH`, the rule
    for Adam-family optimisers (Malladi et al., 2022, "On the SDEs and Scaling Rules for
    Adaptive Gradient Algorithms"); rounded to two significant digits."""
    lr = base_lr * math.sqrt(batch / BASE_BATCH)
    return float(f"{lr:.2g}")


def choose_teacher(dense_bytes: int, compact_bytes: int, stream_bytes: int, state_per_rank: float,
                   gpu_bytes: int) -> dict:
    """``{"teacher", "weights_bytes", "per_rank_total_bytes", "fits"}`` for one rank."""
    budget = MEMORY_FRACTION * gpu_bytes
    whole = dense_bytes + compact_bytes + state_per_rank
    if whole <= budget:
        return {"teacher": "model", "weights_bytes": dense_bytes + compact_bytes, "per_rank_total_bytes": whole,
                "fits": True, "memory_budget_bytes": budget}
    total = stream_bytes + state_per_rank
    return {"teacher": "stream", "weights_bytes": stream_bytes, "per_rank_total_bytes": total,
            "fits": total <= budget, "memory_budget_bytes": budget}


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def run_command(plan: dict, opts) -> str:
    """The command that runs ``plan`` (a :func:`~overrep.app.planner.make_plan` dict)."""
    lay, data = plan["layout"], plan["data"]
    ranks, nodes = lay["ranks"], opts.nodes
    if ranks == 1:
        head = ["overrep", "run"]
    else:
        head = ["torchrun", f"--nproc-per-node={lay['ranks_per_node']}"]
        if nodes > 1:
            head += [f"--nnodes={nodes}", "--node-rank=$NODE_RANK", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=$MASTER_ADDR:29500"]
        else:
            head += ["--standalone"]
        head += ["-m", "overrep", "run"]
    args = ["--model", opts.run_model]
    from .plan_report import ranges

    args += ["--remove", ranges(plan["removal"]["removed"])]
    if opts.preset != "hybrid":
        args += ["--preset", opts.preset]
    args += ["--max-steps", str(data["steps"])]
    sets = {"recovery.batch_size": data["batch"], "recovery.lr": lay["lr"], "recovery.time_budget": "null",
            "recovery.blocks": opts.blocks, "data.train_sequences": data["sequences"], "data.seq_len": data["seq_len"],
            "model.dtype": opts.model_dtype, "recovery.precision": opts.precision,
            "cache.dtype": opts.cache_dtype, "cache.teacher": lay["teacher_weights"],
            "cache.mode": "disk" if lay["teacher"] == "cache" else "live"}
    if opts.data:
        sets["data.source"] = opts.data
    if lay["fsdp"]:
        sets["recovery.shard"] = "fsdp"
    if nodes > 1:  # every rank reads the checkpoints and the cache: storage all machines see
        args += ["--output", "$SHARED/runs/overrep"]
        sets["cache.dir"] = "$SHARED/overrep-cache"
    for k, v in sets.items():
        args += ["--set", f"{k}={_fmt(v)}"]
    keep = ("--node-rank=$", "--rdzv-endpoint=$", "$SHARED/", "cache.dir=$SHARED/")  # shell variables, unquoted
    return " ".join(a if a.startswith(keep) else shlex.quote(a) for a in head + args)
