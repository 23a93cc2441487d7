"""The dense model's figures shipped with the package for the default run, checked on the
machine that reads them.

A first run scores the dense model on every row of its evaluation (test, validation, the
unseen corpora, the generation check) before recovery starts: on a 2-core AVX2 CPU in fp32
that took 250-368 s of a run whose whole is meant to end within 20 minutes, and
``recovery.run_limit`` took those seconds from training. The figures depend only on the
model, the rows, the precision and the protocol, so the package carries them for the
embedded default model and rows, in each precision, as files in ``overrep/eval/reference/``
named by those (:func:`entry_name`: the run cache's key, without the folder the model was
loaded from), written by ``make reference`` (:func:`write`, :mod:`overrep.app.dense_reference`)
and read where the run's cache has no entry of its own (``eval.dense_reference``).

A shipped entry is never taken on trust: the run scores the first :data:`CHECK_ROWS` test rows
of the dense model itself and compares their losses with the ones the entry recorded for them,
together and row by row. Beyond :data:`TOLERANCE` or :data:`ROW_TOLERANCE` (another library
version, another kernel that changes the numbers) the entry is set aside and every row is
scored, as without it. The same rows, timed against the entry's own timing of them, give this
machine's speed, so the cost recorded with the figures (from which ``recovery.run_limit``
predicts the final evaluation) is this machine's, not the writer's. ``metrics.json`` says
where the dense figures came from (``dense_reference``: the machine, the versions, the check).
"""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path

import torch

from ..atomic import save_torch
from ..core.precision import autocast
from ..model.perplexity import row_token_nll
from ..model.placement import input_device
from .figures import EvalData, figures_path, model_figures

log = logging.getLogger(__name__)

#: where the shipped entries lie (package data)
REFERENCE_DIR = Path(__file__).with_name("reference")
#: test rows the reading machine scores itself: three batches of four, whose fastest batch times
#: this machine against the entry's machine (the fastest: a run's first minute can be disturbed,
#: by the installation's disk writes among others; a fresh clone's `make run` on the family 6
#: model 167 Xeon took their median at 1.52x the writer's, the same code alone on the machine 0.92x)
CHECK_ROWS = 12
#: largest differences from the entry's (nats a token) of the checked rows' mean loss together and
#: of any one row's. In bf16 on the default's first 12 test rows, a batch of one row (another
#: kernel path) moved them by 3.4e-4 and 7.9e-3, scoring in fp32 instead by 6.1e-4 and 6.8e-3; in
#: fp32 batch sizes 1, 3, 4 and 12 gave the same bits (a family 6 model 167 Xeon, docs/evaluation.md)
TOLERANCE = 2e-3
ROW_TOLERANCE = 2e-2


def shipped_source(info: dict) -> str:
    """The model's name in a shipped entry's key: ``embedded`` for the embedded model, wherever
    this installation keeps its file (the run's own cache keys by the path it read), else the
    source the run read (a hub id; nothing else is shipped)."""
    return "embedded" if info.get("kind") == "embedded" else info["source"]


def entry_name(model, data, source: str, precision: str) -> str:
    """The file name of the dense entry of ``model`` (named ``source``: :func:`shipped_source`) on
    ``data``: the key of the run's cache (:func:`~overrep.eval.figures.figures_path`) with the
    model's fingerprint taken without the folder it was loaded from (its config's
    ``_name_or_path``), so that every installation finds the same entry."""
    return figures_path(model, data, tag="dense", source=source, mask=False, root=REFERENCE_DIR, precision=precision,
                        portable=True).name


def check_rows(model, test: torch.Tensor, precision: str) -> dict:
    """The first :data:`CHECK_ROWS` rows of ``test`` scored by ``model`` in ``precision``, four at
    a time: each row's summed loss (``nll``), its tokens, and the seconds of the fastest batch."""
    rows, times, sums = test[:CHECK_ROWS], [], []
    with autocast(precision, input_device(model)):
        for i in range(0, rows.shape[0], 4):
            t0 = time.perf_counter()
            sums.append(row_token_nll(model, rows[i:i + 4]).sum(dim=1))
            times.append(time.perf_counter() - t0)
    return {"nll": torch.cat(sums), "tokens": torch.full((rows.shape[0],), rows.shape[1] - 1, dtype=torch.float64),
            "batch_seconds": min(times)}


def read(name: str, model, test: torch.Tensor, precision: str) -> dict | None:
    """The shipped entry ``name`` (a file name of the run's figure cache) as this machine's
    scores, or None: none shipped, unreadable, or its checked rows scored differently here."""
    path = REFERENCE_DIR / name
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, map_location="cpu", weights_only=True)
        want = entry["reference"]["check"]
    except Exception:  # a torn or foreign file: the run scores the dense model itself
        log.warning("dense figures: the shipped entry %s is unreadable; scoring every row", path)
        return None
    got = check_rows(model, test, precision)
    n = min(len(got["nll"]), len(want["nll"]))
    if not n or not torch.equal(got["tokens"][:n], want["tokens"][:n]):
        log.warning("dense figures: the shipped entry's checked rows are not this run's; scoring every row")
        return None
    mine, theirs, tokens = got["nll"][:n], want["nll"][:n], got["tokens"][:n]
    gap = float((mine.sum() - theirs.sum()).abs() / tokens.sum())
    row_gap = float(((mine - theirs) / tokens).abs().max())
    if not (gap <= TOLERANCE and row_gap <= ROW_TOLERANCE):
        log.warning("dense figures: the shipped entry's %d checked rows score differently here (off by %.2g nats a "
                    "token together, at most %.0e, and by %.2g on one row, at most %.0e); scoring every row",
                    n, gap, TOLERANCE, row_gap, ROW_TOLERANCE)
        return None
    speed = got["batch_seconds"] / want["batch_seconds"]
    log.info("dense figures: the package's, written on %s; %d rows checked here (off by %.1e nats a token together, "
             "%.1e on one row at most), this machine %.2fx their time", entry["reference"]["machine"], n, gap,
             row_gap, speed)
    scores = {k: v for k, v in entry.items() if k != "reference"}
    for key in ("seconds", "seconds_rows"):  # what scoring every row would have cost here
        if scores.get(key) is not None:
            scores[key] = scores[key] * speed
    scores["reference"] = {**{k: v for k, v in entry["reference"].items() if k != "check"},
                           "checked_rows": n, "gap_nats": gap, "largest_row_gap_nats": row_gap, "speed_here": speed}
    return scores


def shipped_scores(model, data: EvalData, info: dict, precision: str) -> dict | None:
    """:func:`read` of the entry shipped for ``model`` (``info``: what loading it returned) on ``data``."""
    return read(entry_name(model, data, shipped_source(info), precision), model, data.test, precision)


def describe(scores: dict) -> dict | None:
    """What ``metrics.json["dense_reference"]`` records of scores :func:`read` returned (None: measured here)."""
    ref = scores.get("reference")
    return None if ref is None else {k: (round(v, 6) if isinstance(v, float) else v) for k, v in ref.items()}


def write(model, tokenizer, data, *, source: str, precision: str, machine: str, directory: Path = REFERENCE_DIR) -> Path:
    """Score ``model`` (named ``source``: :func:`shipped_source`) on every row of ``data`` in
    ``precision`` and store the entry, with its checked rows and where it was made, under
    ``directory`` (:func:`entry_name`). The checked rows are scored first, as a run scores
    them right after loading the model and choosing its blocks, so that their timing compares
    with a run's: one process per precision (``make reference``)."""
    from .. import __version__

    check = check_rows(model, data.test, precision)  # first, as a run checks them: timed alike
    _, scores, _ = model_figures(model, tokenizer, data, tag="dense", source=source, mask=False, root=None,
                                 precision=precision, progress=True)
    scores["reference"] = {"machine": machine, "precision": precision, "torch": str(torch.__version__),
                           "overrep": __version__, "written": datetime.date.today().isoformat(), "check": check}
    name = entry_name(model, data, source, precision)
    for old in directory.glob("dense-*.pt"):  # the entry it replaces (another protocol, data or model)
        try:
            stale = torch.load(old, map_location="cpu", weights_only=True)["reference"]["precision"] == precision
        except Exception:
            stale = True
        if stale and old.name != name:
            old.unlink()
    return save_torch(directory / name, scores, "the dense reference figures")
