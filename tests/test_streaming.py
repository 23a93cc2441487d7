"""The streaming teacher: the dense model's features read block by block from its
safetensors files equal those of the whole model in memory."""

from __future__ import annotations

import pytest
import torch

from overrep.errors import OverRepError
from overrep.model.hooks import teacher_features
from overrep.model.loading import load_model
from overrep.model.streaming import stream_features
from overrep.model.surgery import plan_pruning

from tiny import corpus, make_tiny_model_dir, tiny_cfg


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3_moe"])
def test_streamed_features_equal_the_whole_models(arch, tmp_path):
    folder = make_tiny_model_dir(tmp_path / arch, corpus(40), arch=arch)
    model, _, _ = load_model(str(folder), attn_implementation="eager")
    plan = plan_pruning(6, [1, 2, 5], blocks=2)  # a module inside the network and one at its end
    assert any(g.final_norm for g in plan.groups) and not all(g.final_norm for g in plan.groups)
    ids = torch.randint(0, 200, (5, 12), generator=torch.Generator().manual_seed(0))
    whole = teacher_features(model, ids, plan.groups)
    streamed = stream_features(folder, ids, plan.groups, batch=2)
    for a, b in zip(whole, streamed):
        for k in ("inputs", "targets"):
            assert a[k].shape == b[k].shape and (a[k] - b[k]).abs().max().item() <= 1e-5, (arch, k)


def test_a_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(OverRepError, match="safetensors"):
        stream_features(tmp_path, torch.zeros(1, 4, dtype=torch.long), plan_pruning(6, [2], blocks=1).groups)


def test_the_pipeline_caches_the_same_features_by_streaming(assets, tmp_path):
    from overrep.app.pipeline import Pipeline

    caches = {}
    for teacher in ("model", "stream"):
        p = Pipeline(tiny_cfg(assets, tmp_path / teacher, cache__teacher=teacher, cache__dir=str(tmp_path / teacher)),
                     progress=False)
        p.load(create_output=False)
        p.prune()
        caches[teacher] = p.features()(list(range(6)))
    for a, b in zip(caches["model"], caches["stream"]):
        assert all((a[k] - b[k]).abs().max().item() <= 1e-5 for k in ("inputs", "targets"))
