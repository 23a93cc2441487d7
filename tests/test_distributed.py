"""Several processes (``torchrun``, gloo on CPU) give what one process gives.

* two ranks, each on half of every batch, end at the weights of one process with the same
  effective batch; a rank killed with SIGKILL and the run resumed still ends there;
* the same with the recovery modules sharded by torch FSDP2 (``recovery.shard: fsdp``), whose
  full-tensor checkpoints one process resumes too;
* a feature cache built by two ranks equals one built by one rank, tensor for tensor.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from overrep.app.pipeline import Pipeline
from overrep.distributed import SINGLE, World, world_from_env
from overrep.errors import OverRepError
from overrep.recovery import sharding

from tiny import tiny_cfg

WORKER = Path(__file__).with_name("ddp_worker.py")


def torchrun(args: list[str], env: dict | None = None, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), *args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=environment, timeout=300)


def weights(out: Path) -> dict:
    return load_file(out / "model" / "model.safetensors")


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, worst


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    """The reference: one process, 12 steps of batch 4 in fp32 (bf16 matmuls round differently
    for a different number of rows)."""
    root = tmp_path_factory.mktemp("ddp")
    cfg = tiny_cfg(assets, root / "one", recovery__steps=12, recovery__precision="fp32", eval__latency=False,
                   model__device="cpu")
    Pipeline(cfg, progress=False, world=SINGLE).run()
    return root, cfg


def test_two_ranks_end_at_the_weights_of_one_process(one_process):
    root, cfg = one_process
    cfg.output = str(root / "two")
    cfg.save(root / "two.yaml")
    done = torchrun(["run", "--config", str(root / "two.yaml"), "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_weights(weights(root / "one"), weights(root / "two"))
    m = json.loads((root / "two" / "metrics.json").read_text())
    log = [json.loads(x) for x in (root / "two" / "train_log.jsonl").read_text().splitlines()]
    assert m["train_steps"] == len(log) == 12 and m["merge_max_rel_diff"] <= 1e-5


def test_a_rank_killed_mid_run_resumes_to_the_same_weights(one_process):
    root, cfg = one_process
    cfg.output = str(root / "killed")
    cfg.save(root / "killed.yaml")
    died = torchrun(["run", "--config", str(root / "killed.yaml"), "--quiet"], env={"OVERREP_TEST_KILL": "1:7"})
    assert died.returncode != 0 and not (root / "killed" / "metrics.json").exists()
    assert sorted((root / "killed" / "checkpoints").glob("step-*.pt"))  # rank 0 saved before rank 1 died
    done = torchrun(["run", "--config", str(root / "killed.yaml"), "--resume", "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    assert_same_weights(weights(root / "one"), weights(root / "killed"))


def test_fsdp_on_two_ranks_ends_at_the_weights_of_one_process(one_process):
    """recovery.shard: fsdp -- W, D and the blocks sharded by torch FSDP2 over two gloo ranks."""
    root, cfg = one_process
    cfg = copy.deepcopy(cfg)
    cfg.output, cfg.recovery.shard = str(root / "fsdp"), "fsdp"
    cfg.save(root / "fsdp.yaml")
    done = torchrun(["run", "--config", str(root / "fsdp.yaml"), "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_weights(weights(root / "one"), weights(root / "fsdp"))
    m = json.loads((root / "fsdp" / "metrics.json").read_text())
    log = [json.loads(x) for x in (root / "fsdp" / "train_log.jsonl").read_text().splitlines()]
    assert m["train_steps"] == len(log) == 12 and m["merge_max_rel_diff"] <= 1e-5
    one = [json.loads(x) for x in (root / "one" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_ppl" in r] == [r["step"] for r in one if "val_ppl" in r]


@pytest.mark.parametrize("variant", ["kl-topk", "moe", "width"])
def test_fsdp_with_the_top_k_loss_an_moe_model_and_width_pruning(assets, tmp_path, variant):
    """FSDP where more moves: the kl-topk loss (the frozen tail and head after each module,
    the cached top-K read by both ranks), fused MoE experts in a recovery block, and width
    pruning (every block a module, rectangular D's, the live teacher)."""
    from tiny import corpus, make_tiny_model_dir

    over = {"recovery__steps": 6, "recovery__precision": "fp32", "eval__latency": False, "model__device": "cpu",
            "recovery__shard": "fsdp", "cache__dir": str(tmp_path / "cache")}
    if variant == "kl-topk":
        over["recovery__loss"] = "kl-topk"
    if variant == "moe":
        over["model__source"] = str(make_tiny_model_dir(tmp_path / "moe", corpus(), arch="qwen3_moe"))
    if variant == "width":
        over.update(prune__granularity="width", prune__remove=None, prune__ratio=0.25)
    cfg = tiny_cfg(assets, tmp_path / "one", **over)
    Pipeline(cfg, progress=False, world=SINGLE).run()  # one process: nothing to shard over
    cfg.output = str(tmp_path / "fsdp")
    cfg.save(tmp_path / "fsdp.yaml")
    done = torchrun(["run", "--config", str(tmp_path / "fsdp.yaml"), "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "fsdp"))


def test_a_sharded_run_killed_mid_run_resumes_sharded_or_unsharded(one_process):
    """Sharded checkpoints hold full tensors: two FSDP ranks resume one, and so does one process
    (which trains unsharded); both end at the weights of one process."""
    root, cfg = one_process
    cfg = copy.deepcopy(cfg)
    cfg.output, cfg.recovery.shard = str(root / "fsdp-killed"), "fsdp"
    cfg.save(root / "fsdp-killed.yaml")
    died = torchrun(["run", "--config", str(root / "fsdp-killed.yaml"), "--quiet"], env={"OVERREP_TEST_KILL": "1:7"})
    assert died.returncode != 0 and not (root / "fsdp-killed" / "metrics.json").exists()
    assert sorted((root / "fsdp-killed" / "checkpoints").glob("step-*.pt"))[-1].name == "step-000006.pt"
    shutil.copytree(root / "fsdp-killed", root / "fsdp-killed-single")
    done = torchrun(["run", "--config", str(root / "fsdp-killed.yaml"), "--resume", "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    assert_same_weights(weights(root / "one"), weights(root / "fsdp-killed"))
    cfg.output = str(root / "fsdp-killed-single")  # one process: recovery.shard fsdp has nothing to shard over
    Pipeline(cfg, resume=True, progress=False, world=SINGLE).run()
    assert_same_weights(weights(root / "one"), weights(root / "fsdp-killed-single"))


def test_a_budgeted_run_on_two_ranks_agrees_on_its_steps(one_process):
    """A time budget: both ranks probe, rank 0's figures fix the steps and the rows (and the
    re-fit), and the two ranks build the feature cache together."""
    root, cfg = one_process
    cfg.output = str(root / "budget")
    cfg.recovery.steps, cfg.recovery.time_budget = None, "6s"
    cfg.cache.dir = str(root / "budget-cache")
    cfg.save(root / "budget.yaml")
    done = torchrun(["run", "--config", str(root / "budget.yaml"), "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads((root / "budget" / "metrics.json").read_text())
    tb = m["time_budget"]  # the planned steps, or where both ranks stopped together at the deadline
    assert m["train_steps"] == (tb["stopped_at_step"] or tb["steps"]) >= 1 and m["merge_max_rel_diff"] <= 1e-5
    manifest = json.loads((root / "budget-cache" / "features").glob("*/manifest.json").__next__().read_text())
    assert manifest["layout"]["num_samples"] == m["time_budget"]["rows"]


def test_a_batch_the_ranks_cannot_share_is_refused(one_process):
    root, cfg = one_process
    cfg.output = str(root / "odd")
    cfg.recovery.batch_size = 3
    cfg.save(root / "odd.yaml")
    done = torchrun(["run", "--config", str(root / "odd.yaml"), "--quiet"])
    assert done.returncode != 0 and "must be a multiple of the 2 ranks" in done.stderr
    assert not (root / "odd" / "metrics.json").exists()


def _build_cache(rank: int, size: int, port: int, path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = world_from_env()
    try:
        _cache_at(path, world)
    finally:
        torch.distributed.destroy_process_group()


def _cache_at(path, world: World):
    from overrep.data.cache import build_or_open

    def produce(rows: range) -> dict:
        g = torch.Generator().manual_seed(rows.start)  # a row's features depend on the row alone
        return {name: torch.randn(len(rows), 8, 4, generator=g) for name in ("inputs_0", "targets_0")}

    return build_or_open(path, fingerprint={"test": 1}, num_samples=50, seq_len=8, hidden_size=4,
                         dtype=torch.float32, produce=produce, shard_size=8, tensors=("inputs_0", "targets_0"),
                         progress=False, world=world)


def test_a_cache_built_by_two_ranks_equals_one_built_by_one(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_build_cache, args=(2, port, str(tmp_path / "two")), nprocs=2, join=True)
    one = _cache_at(tmp_path / "one", SINGLE)
    two = _cache_at(tmp_path / "two", SINGLE)  # opens what the two ranks wrote, checking every sha256
    rows = list(range(50))
    a, b = one.get(rows), two.get(rows)
    assert all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert {e["shard"] % 2 for e in manifest["shards"] if e["rank"] == 1} == {1}
    assert {e["rank"] for e in manifest["shards"]} == {0, 1}


def test_the_config_checks_recovery_shard(assets, tmp_path):
    with pytest.raises(OverRepError, match="recovery.shard must be one of none, fsdp"):
        tiny_cfg(assets, tmp_path / "bad", recovery__shard="zero3")
    with pytest.raises(OverRepError, match="'lora' trains the whole model"):
        tiny_cfg(assets, tmp_path / "lora", recovery__shard="fsdp", recovery__method="lora")
    plain = torch.ones(3)  # unsharded tensors pass through the sharding helpers unchanged
    assert sharding.like(plain, plain) is plain and sharding.plain(plain) is plain
    assert not sharding.is_sharded([plain]) and torch.equal(sharding.full(plain), plain)


def test_world_shares_a_batch_in_equal_contiguous_parts():
    assert World(0, 2).part([5, 6, 7, 8]) == [5, 6] and World(1, 2).part([5, 6, 7, 8]) == [7, 8]
    assert SINGLE.part([1, 2, 3]) == [1, 2, 3] and SINGLE.average([], [2.5]) == [2.5]
    with pytest.raises(Exception, match="multiple of the 3 ranks"):
        World(0, 3).check_divides(8, "recovery.batch_size")
