"""The training options every recovery method shares: what the trainer, the sampler and
the time budget read, with their checks.

Each method's own options (LoRA's rank, the layer-wise loss, RestoreLCC's heads ...) live
beside its code; :class:`overrep.recovery.config.RecoveryConfig` composes them with these
into the run configuration's ``recovery`` section, so a YAML key or a
``--set recovery.x=...`` override names a field of one of these dataclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.precision import check_precision
from ..errors import OverRepError
from .budget import parse_duration
from .sharding import check_shard


#: ``recovery.run_limit: auto``: this limit where ``recovery.time_budget`` is its default, none
#: elsewhere. 18 minutes and about 1.6 of installation: `make run` within 20 on a 2-core CPU
#: (19 min 32 s from a fresh clone on the AVX2 EPYC, where the three models' evaluation alone
#: takes 8-9 minutes and the 12-minute budget was cut to 528 s; docs/configuration.md, "Time budgets")
AUTO_RUN_LIMIT, DEFAULT_RUN_LIMIT, DEFAULT_TIME_BUDGET = "auto", "18m", "12m"


@dataclass
class TrainingOptions:
    method: str = "overrep"  # a name in overrep.recovery.methods.METHODS (`overrep methods` lists them)
    preset: str = "hybrid"  # overrep / overrep-kd: built-in preset name (see `overrep presets`) or a preset .yaml file
    blocks: int | str = "auto"  # recovery blocks per removed run (block before it + blocks after it); "auto": 2 for a mask of one run (3 from the auto warm start), 1 for several separate runs (each measured better there: docs/results-former-protocol.md, docs/results-log.md)
    # a module may extend into the model's final block and end at the final norm's output (the paper's
    # layout on its mask); off: it stops before the final block (better per wall-clock: docs/results-former-protocol.md)
    final_block: bool = False
    block1_init: str = "stitched"  # "stitched" (attention of the block before, MLP+norms of the last removed) | "retained" (what the auto warm start trains on a mask of one run with two blocks after it, whatever this says)
    steps: int | None = None  # optimiser steps; overrides epochs when set
    epochs: float = 4.5  # passes over the training sequences (used when neither steps nor time_budget is set)
    time_budget: str | None = DEFAULT_TIME_BUDGET  # wall-clock for feature caching + training, e.g. "20m", "90s", "1.5h": fixes the step count by measurement (steps, when set, take precedence; epochs only size the data)
    run_limit: str | None = AUTO_RUN_LIMIT  # the whole `overrep run`'s wall-clock (loading, evaluation and export; not installation), e.g. "20m": the time budget is cut to what it leaves after the final evaluation, predicted from the dense model's | "auto": 18m with the default time_budget (so that `make run` with its installation fits 20 minutes on a 2-core CPU), none with a budget you set | null: never cut (docs/configuration.md, "Time budgets"); `overrep compare`'s cells never use it
    budget_passes: float = 6.0  # time budget, methods on cached features: passes over each cached row the step count is planned for (at most data.train_sequences rows: a long budget caches them all and passes more often); fewer rows seen more often buy steps where features are dear: 6 (was 1) measured better on validation at 2.5 minutes in bf16 and in fixed-step fp32 cells, level in budgeted fp32 runs (docs/results-log.md, "Rows against steps")
    batch_size: int = 8  # sequences per optimiser step (before accumulation)
    grad_accum: int = 1  # micro-batches accumulated per step
    lr: float | None = None  # peak learning rate (AdamW); None = the method's default (`overrep methods` lists them)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_ratio: float = 0.01  # linear learning-rate warm-up, fraction of steps
    warmup_steps: int | None = None  # ... and at least this many steps, however short the run; None: 20 from a warm start (without it the first full-rate steps undo the fit: docs/closed-forms.md), else 0
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    weight_decay: float = 0.01  # applied to pretrained matrices only, never to W, D or norms
    grad_clip: float = 1.0  # max global gradient norm (0 disables)
    alpha_warmup_ratio: float = 0.01  # annealed activation: rho_w
    alpha_linear_ratio: float = 0.2  # annealed activation: rho_l (final linear phase)
    seed: int = 0  # initialisation / batch-order seed
    checkpoint_every: int = 50  # steps between checkpoints (and at the end)
    eval_every: int = 50  # steps between validation measurements (val_loss; val_ppl on data.validation_sequences rows); a time-budgeted run sets its own (validation_share)
    budget_min_steps: int | None = None  # time budget: the fewest optimiser steps it may leave, else the run stops with an error before training (None: 10, and 20 from a warm start: fewer measured worse than its own closed form, docs/closed-forms.md)
    validation_share: float = 0.05  # time-budgeted runs: the most of the budget the validations during training (keep_best, val_ppl in the log) may take, spread evenly, the last at the end; none where one does not fit (the report scores the validation rows anyway), except that a warm start with keep_best always validates its start and its last step
    keep_best: bool = True  # end at the checkpoint of lowest val_ppl (among those that fold exactly: alpha = 0) when it beats the last step, a warm start's closed form (step 0) among them; needs validation rows
    threads: int | None = None  # torch CPU threads (None = torch's default)
    precision: str = "auto"  # training forward of every method: "bf16" (autocast matmuls, fp32 master weights and AdamW state) | "fp32" | "auto" (bf16 where the device has bf16 instructions: AVX512-BF16/AMX CPUs, GPUs; else fp32); see docs/speed.md
    shard: str = "none"  # several ranks (torchrun), methods on cached features: "none" (every rank holds the recovery modules, gradients all-reduced) | "fsdp" (W, D and the recovery blocks sharded over the ranks by torch FSDP2; README "Scaling")

    @property
    def resolved_run_limit(self) -> str | None:
        """``run_limit`` made concrete (``auto``: :data:`DEFAULT_RUN_LIMIT` with the default budget)."""
        if self.run_limit != AUTO_RUN_LIMIT:
            return self.run_limit
        return DEFAULT_RUN_LIMIT if self.time_budget == DEFAULT_TIME_BUDGET else None

    def check_training(self) -> None:
        """The step count, schedule and optimiser settings."""
        if self.steps is not None and self.steps < 1:
            raise OverRepError(f"recovery.steps must be >= 1, got {self.steps}")
        if self.time_budget is not None:
            parse_duration(self.time_budget)
        if self.run_limit not in (None, AUTO_RUN_LIMIT):
            parse_duration(self.run_limit, "recovery.run_limit")
        if not (self.budget_passes >= 1 and math.isfinite(self.budget_passes)):
            raise OverRepError(f"recovery.budget_passes must be a number >= 1, got {self.budget_passes}")
        if not 0 <= self.validation_share < 1:
            raise OverRepError(f"recovery.validation_share must be in [0, 1), got {self.validation_share}")
        if self.steps is None and self.epochs <= 0:
            raise OverRepError(f"recovery.epochs must be > 0, got {self.epochs}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise OverRepError(f"recovery.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.budget_min_steps is not None and self.budget_min_steps < 1:
            raise OverRepError(f"recovery.budget_min_steps must be >= 1, got {self.budget_min_steps}")
        for name in ("batch_size", "grad_accum", "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise OverRepError(f"recovery.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr is not None and self.lr <= 0:
            raise OverRepError(f"recovery.lr must be > 0, got {self.lr}")
        if not 0 < self.alpha_linear_ratio <= 1:
            raise OverRepError(f"recovery.alpha_linear_ratio must be in (0, 1] (the merge needs a final linear "
                               f"phase), got {self.alpha_linear_ratio}")
        if not 0 <= self.alpha_warmup_ratio <= 1 - self.alpha_linear_ratio:
            raise OverRepError(f"recovery.alpha_warmup_ratio must be in [0, 1 - alpha_linear_ratio], "
                               f"got {self.alpha_warmup_ratio}")
        for name in ("warmup_ratio", "min_lr_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise OverRepError(f"recovery.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise OverRepError("recovery.weight_decay and recovery.grad_clip must be >= 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise OverRepError(f"recovery.betas must be in [0, 1), got {list(self.betas)}")
        if self.blocks != "auto" and (isinstance(self.blocks, bool) or not isinstance(self.blocks, int)
                                      or self.blocks < 1):
            raise OverRepError(f"recovery.blocks must be an integer >= 1 or 'auto', got {self.blocks!r}")
        if self.threads is not None and self.threads < 1:
            raise OverRepError(f"recovery.threads must be >= 1, got {self.threads}")

    def check_runtime(self, shardable: bool) -> None:
        """``precision`` and ``shard`` (``shardable``: whether the method can shard its modules)."""
        check_precision(self.precision)
        if check_shard(self.shard) == "fsdp" and not shardable:
            raise OverRepError(f"recovery.shard: fsdp shards layer-wise recovery modules; '{self.method}' trains the "
                               "whole model (use recovery.shard: none)")

    def total_steps(self, train_sequences: int) -> int:
        """``steps``, or ``epochs`` passes over ``train_sequences`` rows."""
        if self.steps is not None:
            return self.steps
        per_epoch = max(1, train_sequences // (self.batch_size * self.grad_accum))
        return max(1, int(round(self.epochs * per_epoch)))
