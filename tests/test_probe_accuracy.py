"""scripts/probe_accuracy.py: a budget probe's prices set against the steps its run then took."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_accuracy.py"


def accuracy(*dirs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, dirs)], capture_output=True, text=True, timeout=60)


def write_run(folder: Path, name: str, probe: list[str], phases: list[tuple[str, list[float]]]) -> None:
    """A run folder as ``overrep compare`` keeps a cell: its log beside it, its steps inside."""
    run = folder / name
    run.mkdir(parents=True)
    (folder / f"{name}.log").write_text("".join(f"INFO overrep.recovery.probe: budget probe: {p}\n" for p in probe))
    steps = [{"step": i + 1, "seconds": s, "phase": phase} for phase, secs in phases for i, s in enumerate(secs)]
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))


def test_each_reduction_of_the_probe_is_set_against_the_runs_own_steps(tmp_path):
    # a layer-wise phase at 1 s a step (its first pays one-off costs), a next-token one at 4 s
    write_run(tmp_path, "a", ["step 30: 3.00 s untimed, then 1.50, 1.20, 1.00 s",
                              "step 80: 6.00 s untimed, then 4.00, 6.00, 5.00 s"],
              [("normed", [5.0] + [1.0] * 30), ("ce", [9.0] + [4.0] * 10)])
    write_run(tmp_path, "b", ["step 30: 2.00 s untimed, then 2.00, 1.00 s"], [(None, [3.0] + [2.0] * 30)])
    (tmp_path / "no-run.log").write_text("budget probe: step 3: 1.00 s untimed, then 1.00 s\n")  # no folder: skipped
    done = accuracy(tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["runs"] == 2
    first, later = out["first_stretch"], out["later_phase"]
    assert first["fastest"]["n"] == 2 and first["fastest"]["min"] == 0.5 and first["fastest"]["max"] == 1.0
    assert first["median"]["min"] == 1.0 and first["median"]["max"] == 1.2  # b: the median of two is the slower
    assert first["untimed"]["max"] == 3.0
    assert later["fastest"]["n"] == 1 and later["fastest"]["median"] == 1.0 and later["median"]["median"] == 1.25
    assert later["fastest"]["mean_abs_log"] == 0.0


def test_a_folder_without_probed_runs_says_so(tmp_path):
    done = accuracy(tmp_path)
    assert done.returncode != 0 and "no run folder with a probe" in done.stderr


def test_a_log_without_probe_lines_is_not_a_run(tmp_path):
    write_run(tmp_path, "c", [], [("normed", [1.0] * 10)])  # (a run with a fixed step count: no probe)
    assert accuracy(tmp_path).returncode != 0
