"""A grid folder kept under version control, and one grid per machine (:mod:`overrep.app.compare_folder`)."""

from __future__ import annotations

import json
import shutil
import subprocess

from overrep.app.cli import main
from overrep.app.runinfo import describe_cpu

from test_compare import grid_file

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16

processor\t: 1
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16
"""


def test_two_cpus_of_one_name_are_told_apart():
    zen4 = describe_cpu(CPUINFO, "x86_64")
    assert zen4 == "AMD EPYC (x86_64, family 25 model 17, AVX512-BF16)"
    zen5 = describe_cpu(CPUINFO.replace(": 25", ": 26").replace(": 17", ": 2"), "x86_64")
    assert zen5 == "AMD EPYC (x86_64, family 26 model 2, AVX512-BF16)" != zen4
    assert describe_cpu(CPUINFO.replace("avx512_bf16", "amx_bf16"), "x86_64").endswith("AMX-BF16)")
    assert describe_cpu(CPUINFO.replace(" avx512_bf16", ""), "x86_64").endswith("no bf16 instructions)")
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nmodel name\t: Neoverse-V2\n"
    assert describe_cpu(arm, "aarch64") == "Neoverse-V2"  # no x86 flags line: the name alone


def test_a_kept_grid_resumes_without_its_models_and_refuses_another_machine(assets, tmp_path, capsys):
    config = grid_file(assets, tmp_path, methods=["plain"], budgets=["epochs"])
    assert main(["compare", "--config", config, "--quiet"]) == 0
    out = tmp_path / "grid"
    subprocess.run(["git", "init", "-q", str(out)], check=True)
    (cell,) = (out / "cells").glob("*/metrics.json")
    ignored = subprocess.run(["git", "-C", str(out), "check-ignore", "--no-index", "cache/eval",
                              f"cells/{cell.parent.name}/model/model.safetensors",
                              f"cells/{cell.parent.name}/metrics.json", f"cells/{cell.parent.name}.yaml"],
                             capture_output=True, text=True).stdout.split()
    assert ignored == ["cache/eval", f"cells/{cell.parent.name}/model/model.safetensors"]

    # what a checkout of the committed folder holds: no models, no caches; nothing is rerun
    shutil.rmtree(cell.parent / "model")
    shutil.rmtree(out / "cache")
    stamp = cell.stat().st_mtime_ns
    assert main(["compare", "--config", config, "--quiet"]) == 0
    assert cell.stat().st_mtime_ns == stamp
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["status"] == "ok" and row["ppl"] > 0

    # a cell committed while it ran: its request, config and log, no checkpoint to resume from
    partial = sorted(p.name for p in cell.parent.iterdir())
    (cell.parent / "metrics.json").unlink()
    shutil.rmtree(cell.parent / "plots", ignore_errors=True)
    (cell.parent / "report.md").unlink(missing_ok=True)
    assert (cell.parent / "config.yaml").is_file() and not (cell.parent / "checkpoints").exists()
    assert main(["compare", "--config", config, "--quiet"]) == 0  # resumed with no checkpoint: from its first step
    assert sorted(p.name for p in cell.parent.iterdir()) == sorted(partial + ["model"])
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["status"] == "ok"

    # a cell to add, on a machine other than the one the grid's cells ran on: refused, in one line
    m = json.loads(cell.read_text())
    m["environment"]["machine"] = "Another CPU (x86_64, family 6 model 85, no bf16 instructions)"
    cell.write_text(json.dumps(m))
    capsys.readouterr()
    assert main(["compare", "--config", config, "--methods", "plain,lora", "--quiet"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("overrep: error: ") and "Another CPU" in line and "--output" in line
    assert not list((out / "cells").glob("*-lora-*"))
    # its tables can still be written
    assert main(["compare", "--config", config, "--collect-only", "--quiet"]) == 0

