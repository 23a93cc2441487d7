"""Adding a method and a loss is one module plus one registration each: a fresh process
imports tests/extension_example.py and runs the command line with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from tiny import tiny_cfg

HERE = Path(__file__).resolve().parent


def overrep_with_extension(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys, extension_example; from overrep.app.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)


def test_a_method_added_in_one_module_trains_and_exports(assets, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "run", eval__latency=False).save(cfg)
    listed = overrep_with_extension("methods")
    assert listed.returncode == 0 and "final-norm" in listed.stdout and "l1 " in listed.stdout
    done = overrep_with_extension("run", "--config", str(cfg), "--quiet", "--max-steps", "2", "--method", "final-norm")
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["method"] == "final-norm" and metrics["trainable_params"] == 32  # hidden size of tests/tiny.py
    assert metrics["train_steps"] == 2 and metrics["recovered_params"] == metrics["pruned_params"]
    ref = tmp_path / "ref"
    tiny_cfg(assets, ref, eval__latency=False, eval__perplexity=False).save(tmp_path / "ref.yaml")
    # the model the method starts from: pruned for the same method (OverRep's warm start would plan another block 1)
    assert overrep_with_extension("prune", "--config", str(tmp_path / "ref.yaml"), "--quiet", "--method",
                                  "final-norm").returncode == 0
    trained, pruned = load_file(tmp_path / "run" / "model" / "model.safetensors"), load_file(
        ref / "pruned-model" / "model.safetensors")
    changed = {k for k in pruned if not (trained[k] == pruned[k]).all()}
    assert changed == {"model.norm.weight"}


def test_a_loss_added_in_one_module_trains_a_layerwise_method(assets, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "run", eval__latency=False, eval__perplexity=False).save(cfg)
    done = overrep_with_extension("run", "--config", str(cfg), "--quiet", "--max-steps", "2", "--loss", "l1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["loss"] == "l1"
    refused = overrep_with_extension("run", "--config", str(cfg), "--quiet", "--loss", "l2", "--overwrite")
    assert refused.returncode == 2 and "available: mse, normed, fisher, logit, kl-topk, ce, ce+kl, l1" in refused.stderr
