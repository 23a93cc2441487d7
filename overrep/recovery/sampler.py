"""The epoch sampler: shuffled sample-index batches, a pure function of (seed, epoch), so a resumed run skips exactly what it trained."""

from __future__ import annotations

import random


from ..errors import OverRepError


def epoch_batches(
    num_samples: int, batch_size: int, *, seed: int, epoch: int, drop_last: bool = True, phase: int = 0
) -> list[list[int]]:
    """Shuffled sample-index batches for one epoch, a pure function of (seed, epoch).

    Uses Python's ``random.Random`` seeded with a string (sha512-based, stable across
    Python versions and independent of torch), so a resumed run can recompute the same
    epoch and skip the batches it already trained on. ``phase``: the step at which an
    objective's later phase began (0: the run's start); its epochs count from there, so that
    phase starts on a fresh pass over the rows.
    """
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise OverRepError(f"batch_size must be a positive integer, got {batch_size!r}")
    if num_samples < 0:
        raise OverRepError(f"num_samples must be non-negative, got {num_samples}")
    if drop_last and num_samples < batch_size:
        raise OverRepError(
            f"batch_size {batch_size} exceeds the {num_samples} cached samples, so an epoch has no full batch; "
            "lower the batch size or use more calibration samples"
        )
    order = list(range(num_samples))
    random.Random(f"overrep-epoch:{seed}:{epoch}" + (f":from-step-{phase}" if phase else "")).shuffle(order)
    stop = num_samples - num_samples % batch_size if drop_last else num_samples
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


def step_batch(i: int, num_samples: int, batch_size: int, *, seed: int, phase: int = 0, live_rows: int = 0) -> list[int]:
    """The row indices of step ``i`` of a phase that began at step ``phase`` (0: the run's
    start): epochs of :func:`epoch_batches` over the ``num_samples`` cached rows, or, with
    ``live_rows``, one pass over the cached rows, then one over the ``live_rows`` rows numbered
    after them (read past the cache: ``Objective.live_rows``), then the cached rows again."""
    per_epoch = num_samples // batch_size
    if live_rows and i >= per_epoch:
        past = epoch_batches(live_rows, batch_size, seed=seed, epoch=0, phase=phase)
        if i - per_epoch < len(past):
            return [num_samples + k for k in past[i - per_epoch]]
        i -= len(past)
    epoch, i = divmod(i, per_epoch)
    return epoch_batches(num_samples, batch_size, seed=seed, epoch=epoch, phase=phase)[i]
