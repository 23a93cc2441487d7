"""What the rest of the machine took of its CPUs while a run recovered: measured from
/proc/stat less this process's own CPU time, stated in the report and flagged in a grid."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from overrep.app import runinfo
from overrep.app.compare_report import _used
from overrep.app.report import _cpu_line
from overrep.app.runinfo import CpuMeter


def test_the_share_is_the_others_busy_time_over_the_machines_capacity(monkeypatch):
    # (wall, cpus, busy seconds on every CPU, stolen seconds, this process's own CPU seconds)
    samples = iter([(100.0, 2, 1000.0, 5.0, 50.0), (110.0, 2, 1016.0, 6.0, 63.0)])
    monkeypatch.setattr(runinfo, "_cpu_sample", lambda: next(samples))
    got = CpuMeter().read()
    assert got == {"seconds": 10.0, "cpus": 2, "others_share": 0.15, "steal_share": 0.05}  # 3 s and 1 s of 20
    samples = iter([(100.0, 2, 1000.0, 0.0, 50.0), (110.0, 2, 1010.0, 0.0, 62.0)])  # own time past the ticks'
    assert CpuMeter().read()["others_share"] == 0.0  # rounding: never below 0
    monkeypatch.setattr(runinfo, "_cpu_sample", lambda: None)  # not Linux
    assert CpuMeter().read() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat")
def test_a_process_burning_cpu_beside_the_run_is_counted_as_others(tmp_path):
    done = tmp_path / "done"
    meter = CpuMeter()
    burner = subprocess.Popen([sys.executable, "-c", (
        "import time, pathlib\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.8: pass\n"
        f"pathlib.Path({str(done)!r}).touch()\n"
        "time.sleep(30)\n")])
    try:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = meter.read()  # before the burner is reaped: its CPU time is not this process's children's
    finally:
        burner.kill()
        burner.wait()
    assert done.exists()
    assert got["others_share"] * got["seconds"] * got["cpus"] >= 0.7  # its 0.8 s at least (ticks: 10 ms)


def test_the_report_and_the_grid_say_when_the_machine_was_shared():
    idle = {"seconds": 600.0, "cpus": 2, "others_share": 0.01, "steal_share": 0.0}
    busy = {**idle, "others_share": 0.12}
    assert "otherwise idle" in _cpu_line(idle)[0] and "other processes 1%" in _cpu_line(idle)[0]
    assert "**the machine was shared" in _cpu_line(busy)[0] and "fewer steps" in _cpu_line(busy)[0]
    assert _cpu_line(None) == []
    row = {"used_seconds": 598.0, "budget_seconds": 600.0, "budget": "10m", "recovery_seconds": 598.0}
    assert _used({**row, "cpu_shared": idle}) == "598 / 600"
    assert _used({**row, "cpu_shared": busy}) == "598 / 600 **(machine shared: 12% of its CPU to others)**"
    assert _used(row) == "598 / 600"  # a cell from before it was measured
