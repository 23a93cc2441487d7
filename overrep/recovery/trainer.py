"""Recovery training: one loop for every method, with checkpoints, exact resume and a NaN guard.

The loss comes from an :mod:`objective <overrep.recovery.objectives>` (layer-wise MSE for OverRep,
language modelling or logit distillation for the baselines); everything else is shared.

Optimiser: AdamW (betas 0.9/0.95), weight decay only on pretrained matrices (D is never pulled
towards 0, away from its identity initialisation, as the reference code does). Learning rate:
linear warm-up, cosine to ``lr * min_lr_ratio``; the annealed activation's schedule
(:mod:`overrep.core.schedule`) is stepped here.

Resume is exact: the batch order is a pure function of (seed, epoch), and a checkpoint
holds the trainable tensors, the optimiser, the step and the history, so a run killed
at any point and resumed reaches the same weights as one that never stopped.

``recovery.keep_best`` (:mod:`overrep.recovery.keep_best`): the run ends at its best validated
step that folds exactly; a warm start's closed form, scored before the first step, is a candidate.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..atomic import save_torch, write_text
from . import probe, sharding
from .budget import Deadline, StepCosts, refit_late_phase, refit_to_deadline, stretches
from .keep_best import KeepBest
from .sampler import step_batch
from ..distributed import SINGLE, World
from ..errors import OverRepError
from .objectives import Objective
from .options import TrainingOptions
from ..core.schedule import AlphaSchedule, lr_factor

log = logging.getLogger(__name__)



def make_optimizer(objective: Objective, cfg: TrainingOptions) -> torch.optim.AdamW:
    params = objective.parameters()
    if not params:
        raise OverRepError("the recovery method has no trainable parameters (check the preset)")
    dec = objective.decayed_ids()
    decay = [p for p in params if id(p) in dec]
    no_decay = [p for p in params if id(p) not in dec]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas))


def trainable_state(objective: Objective) -> dict:
    """Only what training changes: trainable tensors (in the objective's fixed order),
    the annealed activations' state and the objective's own state."""
    return {"tensors": [sharding.full(p) for p in objective.parameters()],
            "activations": [a.get_extra_state() for a in objective.activations],
            "extra": objective.extra_state()}


def load_trainable_state(objective: Objective, state: dict) -> None:
    params = objective.parameters()
    tensors = state.get("tensors", [])
    if len(tensors) != len(params) or any(t.shape != p.shape for t, p in zip(tensors, params)):
        raise OverRepError("checkpoint tensors do not fit this run's trainable parameters")
    with torch.no_grad():
        for p, t in zip(params, tensors):
            p.copy_(sharding.like(t, p))
    for a, s in zip(objective.activations, state.get("activations", [])):
        a.set_extra_state(s)
    objective.load_extra_state(state.get("extra", {}))


@dataclass
class TrainResult:
    steps: int
    seconds: float
    tokens: int
    history: list[dict] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Trainer:
    """Optimises ``objective`` for ``total_steps`` steps; checkpoints into ``ckpt_dir``."""

    def __init__(self, objective: Objective, num_samples: int, cfg: TrainingOptions, total_steps: int,
                 ckpt_dir: Path, tokens_per_sample: int = 0, fingerprint: str = "", progress: bool = True,
                 world: World = SINGLE, eval_every: int | None = None):
        world.check_divides(cfg.batch_size, "recovery.batch_size")
        self.objective, self.world = objective, world
        self.num_samples, self.cfg, self.total = num_samples, cfg, total_steps
        self.ckpt_dir, self.fingerprint, self.progress = Path(ckpt_dir), fingerprint, progress
        self.tokens_per_sample = tokens_per_sample
        self.micro = cfg.batch_size
        self.per_step = cfg.batch_size * cfg.grad_accum
        if num_samples < self.per_step:
            raise OverRepError(f"batch_size x grad_accum = {self.per_step} exceeds the {num_samples} training "
                               "sequences; lower the batch or add data")
        self.steps_per_epoch = num_samples // self.per_step
        # rows past the cached ones a one-pass later phase reads once it has read these (live)
        live = getattr(objective, "live_rows", 0)
        self.live_rows = live if live >= self.per_step else 0
        objective.pass_steps = self.steps_per_epoch + self.live_rows // self.per_step
        # steps between validations (0: none); a time budget passes its own (recovery.validation_share)
        self.eval_every = cfg.eval_every if eval_every is None else eval_every
        self.opt = make_optimizer(objective, cfg)
        # FSDP (recovery.shard): it reduces the gradients, and every rank joins gathers and validation
        self.sharded = sharding.is_sharded(objective.parameters())
        self.step = 0
        self.history: list[dict] = []
        self.seconds = 0.0
        self.deadline: Deadline | None = None  # a budgeted run: re-fit the step count as it times itself
        self.refit: dict | None = None  # what the re-fits measured and changed
        self.last_scored: dict | None = None  # the last history record with a val_ppl
        self.keep = KeepBest(cfg.keep_best)  # recovery.keep_best
        self.flops_per_step: float | None = None  # counted after training (count_flops)
        self.stopped_at: int | None = None  # a budgeted run stopped at its deadline before its planned last step
        self.score_start = False  # a warm start: its closed form (step 0) is a keep_best candidate too
        # a budgeted run's clock: when its budget began in this process and when its training ended
        # (perf_counter), and the budget seconds earlier processes spent up to the checkpoint resumed from
        self.budget_clock: float | None = None
        self.trained_at: float | None = None
        self.budget_seconds_before: float = 0.0
        self.resumed_from: int | None = None
        self.set_total(total_steps)

    def capped(self, total: int) -> int:
        """``total``, or fewer where the objective allows no more (:meth:`Objective.step_limit`)."""
        limit = self.objective.step_limit()
        return total if limit is None else min(total, max(limit, self.step + 1))

    def set_total(self, total: int) -> None:
        """Train for ``total`` steps (fewer where the objective allows no more): the α
        schedule, the learning rate and the objective's own phases all follow."""
        self.total = total = self.capped(total)
        schedule = AlphaSchedule(total, self.cfg.alpha_warmup_ratio, self.cfg.alpha_linear_ratio)
        for a in self.objective.activations:
            a.set_schedule(schedule)
        self.objective.set_total_steps(total)

    # ---- data --------------------------------------------------------------------
    def batch_indices(self, step: int) -> list[int]:
        # an objective's later phase (the next-token phase of normed>ce) starts a fresh pass over
        # the rows, so that it sees each once before any twice (losses.fresh_share sizes the rows)
        start = self.phase_start(step)
        return step_batch(step - start, self.num_samples, self.per_step, seed=self.cfg.seed, phase=start,
                          live_rows=self.live_rows if start else 0)

    def phase_start(self, step: int) -> int:
        """The step at which the objective's phase holding ``step`` began (0: the first phase)."""
        return max((s for s in self.objective.phase_starts() if 0 < s <= step), default=0)

    @property
    def alpha(self) -> float:
        return self.objective.activations[0].alpha if self.objective.activations else 0.0

    # ---- checkpoints -------------------------------------------------------------
    def _ckpt_path(self, step: int) -> Path:
        return self.ckpt_dir / f"step-{step:06d}.pt"

    def latest_checkpoint(self) -> Path | None:
        found = sorted(self.ckpt_dir.glob("step-*.pt")) if self.ckpt_dir.is_dir() else []
        return found[-1] if found else None

    def save_checkpoint(self) -> Path:
        path = self._ckpt_path(self.step)
        if not (self.world.is_main or self.sharded):  # one writer; every rank reads it back on resume
            return path
        trainable, optimizer = trainable_state(self.objective), sharding.optimizer_state(self.opt)
        keep = self.keep.checkpoint(self.step, self.objective.parameters())
        if not self.world.is_main:  # it took part in gathering the shards
            return path
        state = {"step": self.step, "total_steps": self.total, "fingerprint": self.fingerprint,
                 "trainable": trainable, "optimizer": optimizer, **keep,
                 "history": self.history, "seconds": self.seconds, "eval_every": self.eval_every,
                 "budget_seconds": self.budget_seconds_used(), "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        save_torch(path, state, "checkpoint")
        for old in sorted(self.ckpt_dir.glob("step-*.pt"))[:-2]:  # keep the two newest
            old.unlink(missing_ok=True)
        return path

    def budget_seconds_used(self) -> float | None:
        """A budgeted run's seconds, over every process that trained it: those before a resume
        (up to their checkpoint) plus this process's since its budget began, until training
        ended (the FLOP count after it is bookkeeping; None: no budget clock)."""
        if self.budget_clock is None:
            return None
        end = time.perf_counter() if self.trained_at is None else self.trained_at
        return self.budget_seconds_before + end - self.budget_clock

    def resume(self) -> bool:
        """Load the newest checkpoint if there is one; returns whether it did."""
        path = self.latest_checkpoint()
        if path is None:
            return False
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a torn or corrupt file
            raise OverRepError(f"checkpoint {path} cannot be read ({type(e).__name__}); delete it to resume "
                               "from the one before") from None
        if state.get("fingerprint") != self.fingerprint or state.get("total_steps") != self.total:
            raise OverRepError(f"checkpoint {path} belongs to a different configuration; start a new output "
                               "folder or pass --overwrite")
        load_trainable_state(self.objective, state["trainable"])
        sharding.load_optimizer_state(self.opt, state["optimizer"])
        self.step, self.history, self.seconds = state["step"], state["history"], state["seconds"]
        self.eval_every = state.get("eval_every", self.eval_every)
        self.budget_seconds_before, self.resumed_from = float(state.get("budget_seconds") or 0.0), self.step
        self.last_scored = next((h for h in reversed(self.history) if h.get("val_ppl") is not None), None)
        self.keep.resume(state, self.objective.parameters())
        if state.get("rng") is not None:  # dropout (LoRA) draws from it: resume draws the same masks
            torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        log.info("resumed from %s (step %d of %d)", path, self.step, self.total)
        return True

    # ---- the loop ----------------------------------------------------------------
    def _step(self) -> tuple[float, torch.Tensor]:
        """One optimiser step at ``self.step``: (summed micro-batch loss, gradient norm)."""
        cfg, obj = self.cfg, self.objective
        for a in obj.activations:
            a.set_step(self.step)
        for g in self.opt.param_groups:
            g["lr"] = cfg.lr * lr_factor(self.step, self.total, cfg.warmup_ratio, cfg.min_lr_ratio, cfg.warmup_steps or 0)
        idx = self.batch_indices(self.step)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(cfg.grad_accum):
            loss = obj.loss(self.world.part(idx[k * self.micro:(k + 1) * self.micro])) / cfg.grad_accum
            loss.backward()
            total += loss.item()
        params = [p for g in self.opt.param_groups for p in g["params"]]
        # several ranks: each had its share of the batch; the mean of their means is the batch's
        grads = [] if self.sharded else [p.grad for p in params if p.grad is not None]  # FSDP reduced them
        [total] = self.world.average(grads, [total])
        if not math.isfinite(total):  # the same verdict on every rank: they stop together
            raise OverRepError(f"loss became {total} at step {self.step}; last good checkpoint: "
                               f"{self.latest_checkpoint() or 'none'} (lower recovery.lr, or check the data)")
        gnorm = sharding.plain(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0
                                                              else float("inf")))
        if not torch.isfinite(gnorm):
            raise OverRepError(f"gradient norm became {gnorm.item()} at step {self.step}; last good "
                               f"checkpoint: {self.latest_checkpoint() or 'none'} (lower recovery.lr)")
        self.opt.step()
        self.objective.after_optimizer_step(self.step)
        return total, gnorm

    def stretch_cuts(self) -> list[int]:
        """Where this run's steps may change cost: where the activations' final linear phase
        begins (folded projections are cheaper) and where an ``A>B`` loss switches (a loss
        through the frozen tail costs more than a layer-wise one)."""
        cuts = list(self.objective.phase_starts())
        if self.objective.activations:
            cuts.append(math.ceil(AlphaSchedule(self.total, self.cfg.alpha_warmup_ratio,
                                                self.cfg.alpha_linear_ratio).decay_end))
        return cuts

    def stretches(self) -> list[tuple[int, float]]:
        """:func:`~overrep.recovery.budget.stretches` of this run, cut at :meth:`stretch_cuts`."""
        return stretches(self.total, self.stretch_cuts())

    def first_stretch_end(self) -> int:
        """The step at which this run's first stretch ends (its last step + 1 where it has one)."""
        return min([c for c in self.stretch_cuts() if 0 < c < self.total], default=self.total)

    def measure(self, steps: int = 3, within: float | None = None) -> StepCosts:
        """A time budget's probe of this trainer (:func:`.probe.measure`)."""
        return probe.measure(self, steps, within)

    def run(self) -> TrainResult:
        cfg, obj = self.cfg, self.objective
        obj.train(True)
        bar = tqdm(total=self.total, initial=self.step, desc="recovery", unit="step",
                   disable=not (self.progress and self.world.is_main), dynamic_ncols=True)
        refit_at = list(self.deadline.refit_steps(self.total)) if self.deadline and self.objective.retargetable else []
        scheduled = set(refit_at)  # the later ones (Deadline.next_refit) stay inside the first stretch
        if self.step == 0:
            self.score_the_start()
        step_seconds: list[float] = []
        timed_from = 1  # the steps a re-fit times: since the last one (the first step pays one-off costs)
        phase_from = None  # (phase, where in step_seconds it began, a later phase): budget.refit_late_phase
        try:
            while self.step < self.total:
                t0, phase = time.perf_counter(), obj.phase()
                total, gnorm = self._step()
                self.step += 1
                step_seconds.append(time.perf_counter() - t0)
                self.seconds += step_seconds[-1]
                if refit_at and self.step == refit_at[0] < self.total:  # a run that short has nothing to re-fit
                    refit_to_deadline(self, step_seconds[timed_from:] or step_seconds)
                    timed_from, bar.total = len(step_seconds), self.total
                    later = self.deadline.next_refit(self.step, self.first_stretch_end()) if len(refit_at) == 1 else None
                    refit_at += [later] if later else []
                # a later re-fit whose first stretch a re-fit has since ended before it times nothing it prices
                refit_at = [s for s in refit_at if s > self.step and (s in scheduled or s <= self.first_stretch_end())]
                if refit_at == [] and self.deadline and obj.retargetable and phase is not None:
                    phase_from = refit_late_phase(self, phase, phase_from, step_seconds)
                    bar.total = self.total
                rec = {"step": self.step, "loss": total, "lr": self.opt.param_groups[0]["lr"],
                       "alpha": self.alpha, "grad_norm": float(gnorm), "seconds": round(step_seconds[-1], 4)}
                if phase is not None:  # an A>B loss: which one this step trained on
                    rec["phase"] = phase
                stop = self.past_deadline(step_seconds)
                if stop:  # scored as it will be exported: α where its schedule ends (0, it folds)
                    for a in obj.activations:
                        a.set_step(self.total)
                if (self.world.is_main or self.sharded) and self.eval_every and (
                        self.step % self.eval_every == 0 or self.step == self.total or stop) and self.room_to_validate():
                    rec.update(self.validate())
                    self.last_scored = rec if rec["val_ppl"] is not None else self.last_scored
                    self.keep.note(self.step, rec["val_ppl"], self.foldable(), self.objective.parameters())
                self.history.append(rec)
                bar.update(1)
                post = {"loss": f"{total:.4g}", "alpha": f"{rec['alpha']:.2f}", "lr": f"{rec['lr']:.2g}"}
                if self.last_scored is not None:
                    post["val_ppl"] = f"{self.last_scored['val_ppl']:.4g}"
                bar.set_postfix(**post)
                if self.step % cfg.checkpoint_every == 0 or self.step == self.total:
                    self.save_checkpoint()
                if stop:
                    break
        except KeyboardInterrupt:
            bar.close()
            path = self.save_checkpoint() if self.step > 0 else None
            raise OverRepError(f"interrupted at step {self.step} of {self.total}; progress saved to {path}; "
                               "rerun with --resume to continue") from None
        bar.close()
        self.restore_best()
        for a in obj.activations:
            a.set_step(self.total)
        self.trained_at = time.perf_counter()
        self.flops_per_step = self.count_flops() if self.step > 0 else None
        obj.train(False)
        tokens = self.tokens_per_sample * self.per_step * len(self.history)
        return TrainResult(self.step, self.seconds, tokens, self.history)

    def validate(self) -> dict:
        """One validation, timed: ``val_loss``, ``val_ppl`` and ``val_seconds``. A budgeted run
        prices its later validations at this one's seconds from here on: the probe times a
        quarter of the rows and scales up, and one validation under-counted that way had let the
        last step of a 2.5-minute run through and ended it 4 s past its budget."""
        t0 = time.perf_counter()
        out = {"val_loss": self.objective.validation_loss(), "val_ppl": self.objective.validation_ppl()}
        out["val_seconds"] = round(time.perf_counter() - t0, 4)
        if self.deadline is not None:  # the price of a validation in the phase this one ran in
            which = "later_validation" if self.in_later_phase(self.step) else "validation"
            self.deadline.costs = replace(self.deadline.costs, **{which: out["val_seconds"]})
        return out

    def in_later_phase(self, step: int) -> bool:
        """Whether a validation after ``step`` steps is in the objective's later phase."""
        return self.deadline is not None and bool(self.deadline.costs.later_share) and any(
            0 < s <= step for s in self.objective.phase_starts())

    def validation_price(self, step: int) -> float:
        """Seconds a validation after ``step`` steps is priced at: its phase's (``StepCosts.validation_in``)."""
        return self.deadline.costs.validation_in(self.in_later_phase(step))

    def room_to_validate(self) -> bool:
        """A budgeted run validates only when the validation ends before its deadline (the
        probe timed one): a final validation past the deadline would score the run after its
        budget. Without it, ``recovery.keep_best`` keeps the last state unless an earlier
        validated one was better."""
        if self.deadline is None:
            return True
        late = time.perf_counter() + self.validation_price(self.step) > self.deadline.at
        return not (self.world.broadcast(int(late)) if self.sharded else late)  # sharded: every rank validates

    def past_deadline(self, step_seconds: list[float]) -> bool:
        """A budgeted run is scored at its budget: when the next step would end after the
        deadline (its time taken as the median of the last three) before the planned last step
        (the machine slowed down after the re-fit), training stops here, so that a run of a few
        long steps does not overrun its budget by most of one; the α schedule then ends at 0 as
        it would have, so the module still folds exactly. Where validations are planned it stops
        one validation earlier and validates the step it stops at, so that ``recovery.keep_best``
        compares the model it exports (a stop after the re-fits had over-counted steps left the
        default run's last 93 steps unvalidated on a 2-core AVX2 CPU). The validation is priced
        in the phase the next step is in (``ce``'s through the frozen tail), and a checkpoint
        the next step writes (the last step's, for one) is reserved too: without either, a
        five-minute cell had ended 7 s past its budget."""
        if self.deadline is None or self.step >= self.total:
            return False
        recent = sorted(step_seconds[-3:])
        next_step = recent[len(recent) // 2] if recent else 0.0
        # where validations are planned, the step it stops at is validated: room for that too
        reserve = self.validation_price(self.step + 1) if self.eval_every else 0.0
        if (self.step + 1) % self.cfg.checkpoint_every == 0 or self.step + 1 == self.total:
            reserve += self.deadline.costs.checkpoint
        late = self.world.broadcast(int(time.perf_counter() + next_step + reserve > self.deadline.at))  # all stop together
        if late:
            self.stopped_at = self.step
            log.warning("time budget: the next step would end after the deadline; training stops at step %d "
                        "of %d", self.step, self.total)
        return bool(late)

    def count_flops(self) -> float:
        """FLOPs of one optimiser step, for ``metrics.json``: the forward pass of one step's
        batch counted by torch's FlopCounterMode (matrix products and attention; a live
        teacher's forward included) times 3, the usual forward + backward estimate. Counted on
        a separate no-grad pass after training, since a dispatch mode around a real step would
        change its numerics."""
        from ..model.flops import flop_counter

        idx = self.batch_indices(0)
        counter = flop_counter()
        with torch.no_grad(), counter:
            for k in range(self.cfg.grad_accum):
                self.objective.loss(self.world.part(idx[k * self.micro:(k + 1) * self.micro]))
        return 3.0 * float(counter.get_total_flops()) * self.world.size

    # ---- recovery.keep_best ---------------------------------------------------------
    def score_the_start(self) -> None:
        """``score_start``: validate the model before its first step (the closed form a warm
        start begins at) as a ``keep_best`` candidate, where validations happen at all."""
        if not (self.score_start and self.cfg.keep_best and self.eval_every and (self.world.is_main or self.sharded)
                and self.room_to_validate()):
            return
        for a in self.objective.activations:
            a.set_step(0)
        start = self.keep.start = {"step": 0, **self.validate()}
        self.objective.train(True)
        log.info("keep_best: the closed form it starts from scores val_ppl %.4g", start["val_ppl"] or float("nan"))
        self.keep.note(0, start["val_ppl"], self.foldable(), self.objective.parameters())

    def foldable(self) -> bool:
        """Whether the weights as they are now fold exactly (every annealed activation at α = 0)."""
        return all(a.alpha == 0 for a in self.objective.activations)

    @property
    def selected(self) -> dict | None:
        """Which step the run ended at, and why (``recovery.keep_best``)."""
        return self.keep.selected

    def restore_best(self) -> None:
        """End at the best foldable step when it beats the last one."""
        self.keep.restore(self.step, self.last_scored, self.objective.parameters())

    def write_log(self, path: Path) -> None:
        write_text(path, "".join(json.dumps(r) + "\n" for r in self.history), "the training log")
