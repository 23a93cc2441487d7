"""Layer-wise recovery training with checkpoints, exact resume and a NaN guard.

Loss (paper ``eq:ours``): mean squared error between each recovery module's output and
the dense model's hidden state after the removed segment, averaged over modules.

Optimiser: AdamW (betas 0.9/0.95). Weight decay only on pretrained matrices: W is
decayed towards 0 by nothing and D is never pulled towards 0 (the reference code decays
D towards 0, away from its identity initialisation). Learning rate: linear warm-up,
cosine to ``lr * min_lr_ratio``. The annealed activation follows its own schedule
(:mod:`overrep.schedule`), stepped here.

Resume is exact: the batch order is a pure function of (seed, epoch), and a checkpoint
holds the trainable tensors, the optimiser, the step and the history, so a run killed
at any point and resumed reaches the same weights as one that never stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from .cache import epoch_batches
from .config import RecoveryConfig
from .errors import OverRepError
from .projection import OvercompleteLinear
from .recovery import RecoveryModule
from .schedule import AlphaSchedule

log = logging.getLogger(__name__)

# indices -> per module {"inputs": [B,T,H], "targets": [B,T,H]}
BatchSource = Callable[[list[int]], list[dict]]


def _decayed(module: RecoveryModule) -> set[int]:
    """ids of pretrained matrices (the only tensors that get weight decay)."""
    ids = set()
    for m in module.modules():
        if isinstance(m, OvercompleteLinear):
            ids.add(id(m.base_layer.weight))
        elif isinstance(m, torch.nn.Linear):
            ids.add(id(m.weight))
    for name, p in module.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:  # fused experts
            ids.add(id(p))
    return ids


def make_optimizer(modules: list[RecoveryModule], cfg: RecoveryConfig) -> torch.optim.AdamW:
    decay, no_decay, seen = [], [], set()
    for m in modules:
        dec = _decayed(m)
        for p in m.trainable_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            (decay if id(p) in dec else no_decay).append(p)
    if not seen:
        raise OverRepError("the recovery module has no trainable parameters (check the preset)")
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas))


def lr_factor(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    warm = max(1, int(round(warmup_ratio * total)))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def trainable_state(modules: list[RecoveryModule]) -> list[dict]:
    """Only what training changes: trainable tensors plus the activation's state."""
    out = []
    for m in modules:
        state = {k: v.detach().clone() for k, v in m.named_parameters() if v.requires_grad}
        state["_activation"] = m.activation.get_extra_state()
        out.append(state)
    return out


def load_trainable_state(modules: list[RecoveryModule], states: list[dict]) -> None:
    if len(states) != len(modules):
        raise OverRepError("checkpoint holds a different number of recovery modules than this run")
    for m, state in zip(modules, states):
        params = dict(m.named_parameters())
        with torch.no_grad():
            for k, v in state.items():
                if k == "_activation":
                    m.activation.set_extra_state(v)
                elif k not in params or params[k].shape != v.shape:
                    raise OverRepError(f"checkpoint tensor '{k}' does not fit this run's recovery module")
                else:
                    params[k].copy_(v)


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
    """Trains ``modules`` on batches from ``source``; checkpoints into ``ckpt_dir``."""

    def __init__(self, modules: list[RecoveryModule], contexts: list[list[dict]], source: BatchSource,
                 num_samples: int, cfg: RecoveryConfig, total_steps: int, ckpt_dir: Path,
                 val_batch: list[dict] | None = None, fingerprint: str = "", progress: bool = True):
        self.modules, self.contexts, self.source = modules, contexts, source
        self.num_samples, self.cfg, self.total = num_samples, cfg, total_steps
        self.ckpt_dir, self.val_batch, self.fingerprint, self.progress = Path(ckpt_dir), val_batch, fingerprint, progress
        self.micro = cfg.batch_size
        self.per_step = cfg.batch_size * cfg.grad_accum
        if num_samples < self.per_step:
            raise OverRepError(f"batch_size x grad_accum = {self.per_step} exceeds the {num_samples} training "
                               "sequences; lower the batch or add data")
        self.steps_per_epoch = num_samples // self.per_step
        schedule = AlphaSchedule(total_steps, cfg.alpha_warmup_ratio, cfg.alpha_linear_ratio)
        for m in modules:
            m.activation.set_schedule(schedule)
        self.opt = make_optimizer(modules, cfg)
        self.step = 0
        self.history: list[dict] = []
        self.seconds = 0.0

    # ---- data --------------------------------------------------------------------
    def batch_indices(self, step: int) -> list[int]:
        epoch, i = divmod(step, self.steps_per_epoch)
        return epoch_batches(self.num_samples, self.per_step, seed=self.cfg.seed, epoch=epoch)[i]

    # ---- losses ------------------------------------------------------------------
    def _loss(self, batch: list[dict]) -> torch.Tensor:
        losses = []
        for m, ctx, feats in zip(self.modules, self.contexts, batch):
            p = next(m.parameters())
            pred = m(feats["inputs"].to(p.device, p.dtype), ctx)
            losses.append(torch.nn.functional.mse_loss(pred.float(), feats["targets"].to(p.device).float()))
        return torch.stack(losses).mean()

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        if not self.val_batch:
            return None
        for m in self.modules:
            m.eval()
        loss = self._loss(self.val_batch).item()
        for m in self.modules:
            m.train()
        return loss

    # ---- checkpoints -------------------------------------------------------------
    def _ckpt_path(self, step: int) -> Path:
        return self.ckpt_dir / f"step-{step:06d}.pt"

    def latest_checkpoint(self) -> Path | None:
        found = sorted(self.ckpt_dir.glob("step-*.pt")) if self.ckpt_dir.is_dir() else []
        return found[-1] if found else None

    def save_checkpoint(self) -> Path:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = self._ckpt_path(self.step)
        tmp = path.with_name(path.name + ".tmp")
        state = {"step": self.step, "total_steps": self.total, "fingerprint": self.fingerprint,
                 "modules": trainable_state(self.modules), "optimizer": self.opt.state_dict(),
                 "history": self.history, "seconds": self.seconds}
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == 28:
                raise OverRepError(f"no space left on device while writing checkpoint {path}") from None
            raise
        for old in sorted(self.ckpt_dir.glob("step-*.pt"))[:-2]:  # keep the two newest
            old.unlink(missing_ok=True)
        return path

    def resume(self) -> bool:
        """Load the newest checkpoint if there is one; returns whether it did."""
        path = self.latest_checkpoint()
        if path is None:
            return False
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # a torn or corrupt file
            raise OverRepError(f"checkpoint {path} cannot be read ({type(e).__name__}); delete it to resume "
                               "from the one before") from None
        if state.get("fingerprint") != self.fingerprint or state.get("total_steps") != self.total:
            raise OverRepError(f"checkpoint {path} belongs to a different configuration; start a new output "
                               "folder or pass --overwrite")
        load_trainable_state(self.modules, state["modules"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.history, self.seconds = state["step"], state["history"], state["seconds"]
        log.info("resumed from %s (step %d of %d)", path, self.step, self.total)
        return True

    # ---- the loop ----------------------------------------------------------------
    def run(self) -> TrainResult:
        cfg = self.cfg
        for m in self.modules:
            m.train()
        tokens_per_step = None
        bar = tqdm(total=self.total, initial=self.step, desc="recovery", unit="step", disable=not self.progress,
                   dynamic_ncols=True)
        try:
            while self.step < self.total:
                t0 = time.perf_counter()
                for m in self.modules:
                    m.activation.set_step(self.step)
                for g in self.opt.param_groups:
                    g["lr"] = cfg.lr * lr_factor(self.step, self.total, cfg.warmup_ratio, cfg.min_lr_ratio)
                idx = self.batch_indices(self.step)
                self.opt.zero_grad(set_to_none=True)
                total = 0.0
                for k in range(cfg.grad_accum):
                    batch = self.source(idx[k * self.micro:(k + 1) * self.micro])
                    loss = self._loss(batch) / cfg.grad_accum
                    if not torch.isfinite(loss):
                        last = self.latest_checkpoint()
                        raise OverRepError(f"loss became {loss.item()} at step {self.step}; last good checkpoint: "
                                           f"{last or 'none'} (lower recovery.lr, or check the data)")
                    loss.backward()
                    total += loss.item()
                    if tokens_per_step is None:
                        tokens_per_step = batch[0]["inputs"].shape[0] * batch[0]["inputs"].shape[1] * cfg.grad_accum
                params = [p for g in self.opt.param_groups for p in g["params"]]
                gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
                if not torch.isfinite(gnorm):
                    raise OverRepError(f"gradient norm became {gnorm.item()} at step {self.step}; last good "
                                       f"checkpoint: {self.latest_checkpoint() or 'none'} (lower recovery.lr)")
                self.opt.step()
                self.step += 1
                self.seconds += time.perf_counter() - t0
                rec = {"step": self.step, "loss": total, "lr": self.opt.param_groups[0]["lr"],
                       "alpha": self.modules[0].activation.alpha, "grad_norm": float(gnorm)}
                if self.step % cfg.eval_every == 0 or self.step == self.total:
                    rec["val_loss"] = self.validation_loss()
                self.history.append(rec)
                bar.update(1)
                bar.set_postfix(loss=f"{total:.4g}", alpha=f"{rec['alpha']:.2f}", lr=f"{rec['lr']:.2g}")
                if self.step % cfg.checkpoint_every == 0 or self.step == self.total:
                    self.save_checkpoint()
        except KeyboardInterrupt:
            bar.close()
            path = self.save_checkpoint() if self.step > 0 else None
            raise OverRepError(f"interrupted at step {self.step} of {self.total}; progress saved to {path}; "
                               "rerun with --resume to continue") from None
        bar.close()
        for m in self.modules:
            m.activation.set_step(self.total)
            m.eval()
        steps_done = len(self.history)
        return TrainResult(self.total, self.seconds, (tokens_per_step or 0) * steps_done, self.history)

    def write_log(self, path: Path) -> None:
        path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
