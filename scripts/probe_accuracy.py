"""How well a time budget's probe priced the steps its runs then took, for each way of reducing
the probe's timed steps to one price.

    python scripts/probe_accuracy.py docs/grid-epyc-f25m17/cells [MORE_DIRS ...] > probe.json

Reads every run folder ``D`` with its log ``D.log`` beside it (as ``overrep compare`` keeps its
cells): the log's ``budget probe:`` lines (one a stretch of the probe: an untimed step, then the
timed ones) and ``D/train_log.jsonl`` (each step's seconds and loss phase). A stretch's price
is set against the median of the run's own steps 2-21 in that phase: the first stretch against
the first phase's steps, a later stretch against the last phase's (runs with two phases only).
Prints, per reduction (``fastest``, ``median``, ``last`` of the timed steps; ``untimed``, the
first step alone), the price / truth ratios' median, 10th and 90th percentiles, extremes and
mean |log|: nearer 1 and a smaller mean |log| is the better price.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

PROBE_LINE = re.compile(r"budget probe: step \d+: ([\d.]+) s untimed, then ([\d., ]+) s")
REDUCTIONS = {
    "fastest": lambda timed, untimed: min(timed),
    "median": lambda timed, untimed: sorted(timed)[len(timed) // 2],
    "last": lambda timed, untimed: timed[-1],
    "untimed": lambda timed, untimed: untimed,
}


def probe_stretches(log: Path) -> list[tuple[float, list[float]]]:
    """The probe's stretches in a run's log, in order: (untimed seconds, timed seconds)."""
    text = log.read_text(errors="replace").replace("\r", "\n")
    out = []
    for match in PROBE_LINE.finditer(text):
        out.append((float(match.group(1)), [float(x) for x in match.group(2).split(",")]))
    return out


def phase_seconds(run: Path) -> list[tuple[str | None, list[float]]]:
    """Each loss phase of a run in the order it trained, with its steps' seconds."""
    phases: list[tuple[str | None, list[float]]] = []
    for line in (run / "train_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "seconds" not in rec:
            continue
        phase = rec.get("phase")
        if not phases or phases[-1][0] != phase:
            phases.append((phase, []))
        phases[-1][1].append(rec["seconds"])
    return phases


def truth(seconds: list[float]) -> float | None:
    """The phase's price as its run paid it: the median of its steps 2-21 (the first pays one-off costs)."""
    return statistics.median(seconds[1:21]) if len(seconds) >= 6 else None


def summary(ratios: list[float]) -> dict:
    r = sorted(ratios)
    at = lambda q: r[min(len(r) - 1, int(q * len(r)))]  # noqa: E731
    return {"n": len(r), "median": round(statistics.median(r), 3), "p10": round(at(0.1), 3),
            "p90": round(at(0.9), 3), "min": round(r[0], 3), "max": round(r[-1], 3),
            "mean_abs_log": round(statistics.mean(abs(math.log(x)) for x in r), 3)}


def main(dirs: list[str]) -> dict:
    first: dict[str, list[float]] = {k: [] for k in REDUCTIONS}
    later: dict[str, list[float]] = {k: [] for k in REDUCTIONS}
    runs = 0
    for d in dirs:
        for log in sorted(Path(d).glob("*.log")):
            run = log.with_suffix("")
            stretches = probe_stretches(log)
            if not stretches or not (run / "train_log.jsonl").exists():
                continue
            phases = phase_seconds(run)
            if not phases:
                continue
            runs += 1
            pairs = [(stretches[0], truth(phases[0][1]))]
            if len(phases) > 1:
                pairs += [(s, truth(phases[-1][1])) for s in stretches[1:]]
            for i, ((untimed, timed), paid) in enumerate(pairs):
                if paid is None:
                    continue
                for name, reduce in REDUCTIONS.items():
                    (first if i == 0 else later)[name].append(reduce(timed, untimed) / paid)
    if not runs:
        raise SystemExit(f"no run folder with a probe in its log and a train_log.jsonl under {', '.join(dirs)}")
    return {"runs": runs,
            "first_stretch": {k: summary(v) for k, v in first.items() if v},
            "later_phase": {k: summary(v) for k, v in later.items() if v}}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(json.dumps(main(sys.argv[1:]), indent=2))
