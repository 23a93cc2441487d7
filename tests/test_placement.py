"""A dense model placed by accelerate (``model.device_map``): its blocks spread over the
devices and, with ``model.max_memory`` capping them, a folder on disk. On a CPU-only machine
"auto" with a small CPU cap offloads most blocks to disk, which exercises accelerate's
hooks (weights brought in for each block's forward and dropped after) the same way as GPUs.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from overrep.app.cli import main
from overrep.errors import OverRepError
from overrep.model.hooks import teacher_features
from overrep.model.loading import load_model
from overrep.model.placement import input_device, is_placed, placed_copy, placement_kwargs
from overrep.model.runtime import model_fingerprint
from overrep.model.surgery import plan_pruning, prune

from tiny import corpus, make_tiny_model_dir, tiny_cfg

CAP = {"cpu": "60KB"}  # the embeddings and about one block of the tiny models; the rest on disk


def placed(folder, tmp_path):
    model, _, _ = load_model(str(folder), attn_implementation="eager",
                             placement=placement_kwargs("auto", CAP, tmp_path / "offload"))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_model_offloaded_to_disk_gives_the_whole_models_features_weights_and_pruned_copy(arch, tmp_path):
    folder = make_tiny_model_dir(tmp_path / arch, corpus(40), arch=arch)
    whole, _, _ = load_model(str(folder), attn_implementation="eager")
    model = placed(folder, tmp_path)
    assert is_placed(model) and "disk" in set(model.hf_device_map.values())
    assert any(p.device.type == "meta" for p in model.parameters())  # really offloaded
    assert input_device(model) == torch.device("cpu")
    assert model_fingerprint(model, "x") == model_fingerprint(whole, "x")  # caches keyed by it are shared

    plan = plan_pruning(6, [2, 3], blocks=2)
    ids = torch.randint(0, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    for a, b in zip(teacher_features(whole, ids, plan.groups), teacher_features(model, ids, plan.groups)):
        for k in ("inputs", "targets"):
            assert (a[k] - b[k]).abs().max().item() <= 1e-6, (arch, k)

    keep = {0, 1, 4, 5} | {s for g in plan.groups for s in g.stitch.values()}
    copy_ = prune(placed_copy(model, keep, torch.device("cpu")), plan)
    reference = prune(copy.deepcopy(whole), copy.deepcopy(plan))
    assert not any(t.device.type == "meta" for t in copy_.state_dict().values())
    assert copy_.lm_head.weight is copy_.get_input_embeddings().weight  # tied, as in the loaded model
    ref = reference.state_dict()
    assert copy_.state_dict().keys() == ref.keys()
    assert all(torch.equal(v, ref[k]) for k, v in copy_.state_dict().items())
    assert torch.equal(copy_(ids).logits, reference(ids).logits)


def test_a_run_with_the_live_teacher_on_disk_ends_where_the_whole_teacher_does(assets, tmp_path):
    """Through the CLI: the same recovered model, and the folder loads."""
    outs = {}
    for name, extra in (("whole", {}), ("placed", {"device_map": "auto", "max_memory": CAP})):
        cfg = tiny_cfg(assets, tmp_path / name, cache__mode="live", eval__latency=False)
        for k, v in extra.items():
            setattr(cfg.model, k, v)
        cfg.save(tmp_path / f"{name}.yaml")
        assert main(["run", "--config", str(tmp_path / f"{name}.yaml"), "--quiet"]) == 0
        outs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert "disk" in outs["placed"]["teacher_device_map"].values()
    for key in ("dense_ppl", "pruned_ppl", "recovered_ppl"):
        assert outs["placed"][key] == pytest.approx(outs["whole"][key], rel=1e-5), key
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "model")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "placed" / "model")
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    assert (a(ids).logits - b(ids).logits).abs().max().item() <= 1e-5
    assert not list((tmp_path / "cache").glob("offload-*"))  # the offload folder goes with the run


@pytest.mark.parametrize("model, match", [
    ({"device_map": "everywhere"}, "model.device_map must be one of"),
    ({"max_memory": {"cpu": "1GiB"}}, "set model.device_map"),
    ({"device_map": "auto", "max_memory": {"gpu0": "1GiB"}}, "unknown device 'gpu0'"),
    ({"device_map": "auto", "max_memory": {0: "lots"}}, "must look like 20GiB"),
])
def test_the_config_checks_the_placement(assets, tmp_path, model, match):
    with pytest.raises(OverRepError, match=match):
        tiny_cfg(assets, tmp_path / "x", **{f"model__{k}": v for k, v in model.items()})


def test_width_pruning_refuses_a_placed_teacher(assets, tmp_path):
    with pytest.raises(OverRepError, match="width pruning"):
        tiny_cfg(assets, tmp_path / "x", model__device_map="auto", prune__granularity="width", prune__remove=None,
                 prune__ratio=0.25)


def test_a_placed_teacher_is_one_process_only(tmp_path):
    from overrep.model.placement import teacher_placement

    with pytest.raises(OverRepError, match="under torchrun every rank"):
        teacher_placement("auto", None, 2, tmp_path)
    assert teacher_placement(None, None, 2, tmp_path) == (None, None)
    kwargs, folder = teacher_placement("auto", {0: "20GiB", "cpu": "1 GiB"}, 1, tmp_path)
    assert kwargs["max_memory"] == {0: "20GiB", "cpu": "1GiB"} and kwargs["offload_folder"] == folder.name
    folder.cleanup()
