"""``overrep plan`` prints the command of its layout, and that command runs: under ``torchrun``
with two ranks (gloo) it ends at the weights one process ends at."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from overrep.app.cli import main
from overrep.app.plan_command import MEMORY_FRACTION, scaled_lr

CONFIGS = Path(__file__).parents[1] / "examples" / "configs"


def plan(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_eight_gpu_llama3_8b_command_fits_its_gpus(capsys):
    p = plan(capsys, "--model", str(CONFIGS / "llama3-8b.json"), "--gpus", "8", "--run-model", "meta-llama/Llama-3.1-8B")
    lay = p["layout"]
    assert lay["fits"] and lay["per_rank_total_bytes"] <= MEMORY_FRACTION * 80e9
    cmd = lay["command"]
    assert cmd.startswith("torchrun --nproc-per-node=8 --standalone -m overrep run --model meta-llama/Llama-3.1-8B")
    for part in ("--set model.dtype=auto", f"--set cache.teacher={lay['teacher_weights']}",
                 "--set recovery.time_budget=null", f"--max-steps {p['data']['steps']}",
                 "--set recovery.batch_size=8", "--set recovery.lr=0.001"):
        assert part in cmd
    assert main(["plan", "--model", str(CONFIGS / "llama3-8b.json"), "--gpus", "8"]) == 0
    text = capsys.readouterr().out
    assert "single-process" not in text and text.rstrip().splitlines()[-1].startswith("torchrun ")


def test_seventy_b_on_two_nodes_onloads_and_shards(capsys):
    p = plan(capsys, "--model", str(CONFIGS / "llama3-70b.json"), "--gpus", "16", "--nodes", "2", "--batch", "16")
    lay = p["layout"]
    assert (lay["teacher_weights"], lay["fsdp"], lay["fits"]) == ("stream", True, True)
    assert "--nproc-per-node=8 --nnodes=2" in lay["command"] and "--set recovery.shard=fsdp" in lay["command"]
    assert f"--set recovery.lr={scaled_lr(16):g}" in lay["command"] and scaled_lr(16) == 0.0014


def test_gpus_that_do_not_divide_over_nodes_are_refused(capsys):
    assert main(["plan", "--model", str(CONFIGS / "llama3-8b.json"), "--gpus", "3", "--nodes", "2"]) == 2
    assert "--nodes" in capsys.readouterr().err


def _run(cmd: str, extra: list[str]) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    if argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    else:
        argv = [sys.executable, "-m", "overrep", *argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(argv + extra, capture_output=True, text=True, env=env, timeout=600)


def _weights(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("teacher", ["model", "stream"])
def test_the_printed_command_runs_on_two_ranks_as_on_one(assets, tmp_path, capsys, teacher):
    model = str(assets / "tiny-llama")
    common = ["--model", model, "--remove", "3-4", "--sequences", "24", "--seq-len", "32", "--batch", "4",
              "--epochs", "1", "--dtype", "float32", "--precision", "fp32", "--data", str(assets / "corpus.jsonl")]
    roomy = plan(capsys, *common, "--gpus", "2")["layout"]
    mem = "80GB"
    if teacher == "stream":  # a GPU too small for the whole model: the plan onloads it
        assert roomy["onloaded_weights_bytes"] < roomy["whole_weights_bytes"]
        mem = str(int((roomy["onloaded_weights_bytes"] + roomy["state_per_rank_bytes"]) / MEMORY_FRACTION) + 1)
    commands = {}
    for gpus in (1, 2):
        p = plan(capsys, *common, "--gpus", str(gpus), "--gpu-mem", mem)
        assert p["layout"]["teacher_weights"] == teacher and p["layout"]["ranks"] == gpus
        commands[gpus] = p["layout"]["command"]
    assert commands[2].startswith("torchrun --nproc-per-node=2 ") and commands[1].startswith("overrep run ")
    # the same run; a GPU that small also shards the state (FSDP) over the two ranks
    assert commands[2].split(" -m overrep run ")[1].removesuffix(" --set recovery.shard=fsdp") == \
        commands[1].removeprefix("overrep run ")
    for gpus, cmd in commands.items():
        done = _run(cmd, ["--output", str(tmp_path / str(gpus)), "--quiet", "--set", f"cache.dir={tmp_path / 'cache'}",
                          "--set", "data.heldout_sequences=4", "--set", "eval.latency=false",
                          "--set", "eval.domains=null", "--set", "model.device=cpu"])
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = _weights(tmp_path / "1" / "model"), _weights(tmp_path / "2" / "model")
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-5
    run = json.loads((tmp_path / "2" / "metrics.json").read_text())["run"]
    assert run["world_size"] == 2 and [r["rank"] for r in run["ranks"]] == [0, 1] and run["backend"] == "gloo"
    assert run["teacher"] == teacher and all(r["threads"] == 1 for r in run["ranks"])
    assert "Ran as: 2 ranks (gloo)" in (tmp_path / "2" / "report.md").read_text()


def test_auto_weights_follow_the_device(assets, tmp_path):
    import torch

    from overrep.app.config import RunConfig
    from overrep.core.precision import native_bf16, resolve_model_dtype
    from overrep.errors import OverRepError

    assert resolve_model_dtype("auto", "cpu") == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    assert resolve_model_dtype("float32", "cpu") == torch.float32
    assert RunConfig.load(overrides={"model": {"dtype": "auto"}}).model.dtype == "auto"
    with pytest.raises(OverRepError, match="model.dtype must be float32, bfloat16 or auto"):
        RunConfig.load(overrides={"model": {"dtype": "half"}})
    with pytest.raises(OverRepError, match="cache.teacher: model"):
        RunConfig.load(overrides={"cache": {"teacher": "stream"}, "prune": {"granularity": "width"}})
    with pytest.raises(OverRepError, match="laco reads every weight"):
        RunConfig.load(overrides={"cache": {"teacher": "stream"}, "prune": {"criterion": "laco"}})
