"""Several processes, one run: the ranks that ``torchrun`` starts, on ``torch.distributed``.

One process is the default and needs nothing: :data:`SINGLE` is rank 0 of 1 and every
collective below is a no-op. Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment)
:func:`world_from_env` joins the process group (``gloo`` on CPU, ``nccl`` on CUDA, one
GPU per local rank) and the run divides its work:

* **training** -- every rank takes an equal contiguous slice of each global micro-batch
  (:meth:`World.part`) and reads only those rows' features; gradients and the step's loss
  are averaged by one all-reduce of one flat buffer (:meth:`World.average`). The update,
  the effective batch and the schedules are those of one process with the same batch.
* **the feature cache** -- rank r produces every shard s with s mod N = r; rank 0 settles
  the folder before and writes the manifest after (:mod:`overrep.data.cache.build`).
* **everything written once** -- the output folder, evaluations, checkpoints, logs and
  the export belong to rank 0; decisions taken from timings (a time budget's step count)
  are rank 0's, broadcast (:meth:`World.broadcast`), so that no two ranks disagree.

Checkpoints are read back by every rank, so the output folder must be one that all ranks
see (one machine, or a shared file system across machines).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch

from .errors import OverRepError


@dataclass(frozen=True)
class World:
    """This process's place in the run: ``rank`` of ``size``, ``local_rank`` on its machine."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def device(self, device: torch.device) -> torch.device:
        """A CUDA device without an index becomes this rank's GPU."""
        if self.distributed and device.type == "cuda" and device.index is None:
            if self.local_rank >= torch.cuda.device_count():
                raise OverRepError(f"rank {self.rank} would use GPU {self.local_rank}, but this machine has "
                                   f"{torch.cuda.device_count()}: start at most that many processes a machine")
            return torch.device("cuda", self.local_rank)
        return device

    def check_divides(self, n: int, what: str) -> None:
        if n % self.size:
            raise OverRepError(f"{what} = {n} must be a multiple of the {self.size} ranks: every rank takes an "
                               "equal share of each batch")

    def part(self, items: list) -> list:
        """This rank's contiguous equal share of ``items`` (a global micro-batch)."""
        n = len(items) // self.size
        return items[self.rank * n:(self.rank + 1) * n]

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def average(self, tensors: list[torch.Tensor], scalars: list[float]) -> list[float]:
        """Average ``tensors`` in place over the ranks, ``scalars`` riding along in the same
        all-reduce; returns the averaged scalars."""
        if not self.distributed:
            return scalars
        device = tensors[0].device if tensors else torch.device("cpu")
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]
                         + [torch.tensor(scalars, dtype=torch.float32, device=device)])
        torch.distributed.all_reduce(flat)
        flat /= self.size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return flat[offset:].tolist()

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the body first (it fills a shared cache), the others after it."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


SINGLE = World()


def world_from_env() -> World:
    """The run's world: :data:`SINGLE`, or this rank's place when ``torchrun`` started it."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return SINGLE
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.distributed.is_available():
        raise OverRepError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    if not torch.distributed.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda and local < torch.cuda.device_count():
            torch.cuda.set_device(local)
        # gloo for CPU tensors (a CPU run, or a CPU model on a GPU machine), nccl for CUDA ones;
        # ranks wait at barriers while rank 0 evaluates: allow that, but fail rather than hang for ever
        torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                             timeout=datetime.timedelta(hours=2))
    return World(torch.distributed.get_rank(), torch.distributed.get_world_size(), local)
