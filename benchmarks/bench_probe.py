"""What a time budget's probe prices a step at, against the run's own steps, in one process.

The default run's budget is fixed from a probe (:func:`overrep.recovery.probe.measure`): a few
real steps of each stretch of the schedule, timed on a copy of the pruned model and priced at
the fastest. On some CPUs its first stretch came out dearer than the steps the run then took
(docs/results-log.md). This script sets the default job up as ``overrep run`` does (``--set``
overrides as there; the dense and unrecovered evaluations are skipped), with a probe of
``--probe-steps`` timed steps a stretch instead of three, then times

  probe        the budget's own probe, each step of its first stretch;
  run          the run's first ``--run-steps`` layer-wise steps: the trainer ``overrep run``
               builds, on the feature cache, its real loop (``Trainer.run``, cut short);
  probe again  a second probe of the same kind after them, in the same process,

and prints each series and the ratios: the probe's fastest step and the median of its last
half against the median of the run's steps 2-21 (what scripts/probe_accuracy.py compares).
If ``probe again`` matches the run where ``probe`` did not, what the first probe paid was the
process warming up, not something a probe does differently.

Run:  .venv/bin/python benchmarks/bench_probe.py [--probe-steps 12] [--run-steps 30] [--set KEY=VALUE ...]
A JSON summary goes to stdout (``--json-out`` also writes it), progress to stderr.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

class ProbeSteps:
    """Every step a probe takes, timed here to the microsecond (its log line keeps two decimals):
    :meth:`measure` replaces ``Trainer.measure`` with a probe of ``steps`` timed steps a stretch,
    no share limit, whose ``_step`` calls it records as ``(step index, seconds)``."""

    def __init__(self, measure, steps: int):
        self.real, self.steps_per_stretch = measure, steps
        self.calls: list[tuple[int, float]] = []

    def measure(self, trainer):
        step = trainer._step

        def timed():
            t0 = time.perf_counter()
            out = step()
            self.calls.append((trainer.step, time.perf_counter() - t0))
            return out
        trainer._step = timed
        try:
            return self.real(trainer, self.steps_per_stretch, None)
        finally:
            del trainer._step

    def first_stretch(self) -> tuple[int, float, list[float]] | None:
        """(step index, the untimed step's seconds, the timed ones') of the first stretch since
        :meth:`clear`: one untimed step, then ``steps`` timed ones (``within=None``)."""
        if len(self.calls) < 1 + self.steps_per_stretch:
            return None
        head = self.calls[:1 + self.steps_per_stretch]
        return head[0][0], round(head[0][1], 4), [round(t, 4) for _, t in head[1:]]

    def clear(self):
        self.calls.clear()


def cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        get = lambda key: re.search(rf"^{key}\s*:\s*(.*)$", info, re.M).group(1)  # noqa: E731
        return f"{get('model name')} (family {get('cpu family')} model {get('model')})"
    except (OSError, AttributeError):
        return platform.processor() or platform.machine()


def interleaved(p, clean, run_trainer, n: int) -> dict:
    """``n`` steps each of a probe's trainer (built as :func:`overrep.app.budgeting.probe_costs`
    builds it, stepped as :func:`overrep.recovery.probe.measure` steps it: one step index, its
    first stretch's) and of the run's trainer (on the feature cache, its own step indices, in its
    first phase), alternated and the order swapped every round, after one untimed step each."""
    from overrep.recovery.methods import build_recovery

    inputs = p.method_inputs()
    probe_inputs = dataclasses.replace(inputs, pruned=copy.deepcopy(clean),
                                       teacher=dataclasses.replace(inputs.teacher, mode="probe"))
    probe = p.make_trainer(build_recovery(probe_inputs, p.method, prepared={}).objective, False)
    at = probe.stretches()[0][0]
    probe.step = at
    probe.objective.after_optimizer_step(at - 1)
    first_phase = min(run_trainer.first_stretch_end(), 20)

    def run_step():
        run_trainer.objective.after_optimizer_step(run_trainer.step - 1)
        run_trainer._step()
        run_trainer.step = (run_trainer.step + 1) % first_phase

    run_trainer.step = 0
    for t in (probe, run_trainer):
        t.objective.train(True)
    probe._step()
    run_step()
    times: dict[str, list[float]] = {"probe": [], "run": []}
    for i in range(n):
        pair = [("probe", probe._step), ("run", run_step)]
        for name, step in pair if i % 2 == 0 else pair[::-1]:
            t0 = time.perf_counter()
            step()
            times[name].append(round(time.perf_counter() - t0, 4))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**times, "probe_median_x_run_median": round(med["probe"] / med["run"], 3),
            "probe_fastest_x_run_fastest": round(min(times["probe"]) / min(times["run"]), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe-steps", type=int, default=12, help="timed steps a probe takes in each stretch")
    ap.add_argument("--run-steps", type=int, default=30, help="the run's own steps to time (a two-phase loss's "
                    "switch moves with them: its first phase's are compared)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, as overrep run")
    ap.add_argument("--interleave", type=int, default=0, metavar="N",
                    help="then N steps each of a probe's trainer and the run's, alternated (the same moments)")
    ap.add_argument("--json-out", help="also write the summary here")
    args = ap.parse_args(argv)
    if args.probe_steps < 2 or args.run_steps < 3:
        ap.error("--probe-steps needs at least 2 and --run-steps at least 3")

    from overrep.app import budgeting
    from overrep.app.config import RunConfig
    from overrep.app.pipeline import Pipeline
    from overrep.recovery import trainer as trainer_mod

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    probes = ProbeSteps(trainer_mod.Trainer.measure, args.probe_steps)
    trainer_mod.Trainer.measure = lambda self, steps=3, within=None: probes.measure(self)

    with tempfile.TemporaryDirectory() as out:
        cfg = RunConfig.load(None, [*args.set, f"output={out}/run"])
        p = Pipeline(cfg, overwrite=True, progress=False)
        p.prepare_output()
        t0 = time.perf_counter()
        p.load()
        p.prune()
        clean = copy.deepcopy(p.pruned)  # the second probe's model: pruned, no method on it yet
        p.build_recovery()  # the probe, the budget, the feature cache, the method (Pipeline.prepare)
        prepared = time.perf_counter() - t0
        first = probes.first_stretch()
        steps = min(args.run_steps, p.total_steps)
        trainer = p.make_trainer()
        trainer.set_total(steps)
        history = trainer.run().history
        timed = [h for h in history if "seconds" in h]
        # the first phase's steps alone (set_total moves a later phase's switch into the cut run)
        run = [h["seconds"] for h in timed if h.get("phase") == timed[0].get("phase")]
        probes.clear()
        inputs = dataclasses.replace(p.method_inputs(), pruned=clean)
        budgeting.probe_costs(p.method, inputs, {}, lambda objective: p.make_trainer(objective, False),
                              p.method.needs_features and cfg.cache.mode == "disk", 0.0)
        again = probes.first_stretch()
        side = interleaved(p, clean, trainer, args.interleave) if args.interleave else None

    truth = statistics.median(run[1:21])

    def summary(stretch):
        if stretch is None:
            return None
        step, untimed, timed = stretch
        return {"step": step, "untimed": untimed, "timed": timed, "fastest_x_run": round(min(timed) / truth, 3),
                "first_three_fastest_x_run": round(min(timed[:3]) / truth, 3),
                "last_half_median_x_run": round(statistics.median(timed[len(timed) // 2:]) / truth, 3)}

    result = {"cpu": cpu_name(), "setup_seconds": round(prepared, 1), "probe_steps": args.probe_steps,
              "run_steps": run, "run_median_2_21": round(truth, 4), "probe": summary(first),
              "probe_again": summary(again), "interleaved": side, "overrides": args.set}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if side:
        print(f"interleaved: the probe's step {side['probe_median_x_run_median']}x the run's (medians), "
              f"{side['probe_fastest_x_run_fastest']}x (fastest)", file=sys.stderr)
    for name in ("probe", "probe_again"):
        s = result[name]
        if s:
            print(f"{name:12s} first stretch (step {s['step']}): fastest {s['fastest_x_run']}x the run's median, "
                  f"fastest of the first three {s['first_three_fastest_x_run']}x, median of the last half "
                  f"{s['last_half_median_x_run']}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
