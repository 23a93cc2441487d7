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
        p = Pipeline(tiny_cfg(assets, tmp_path / teacher, cache__teacher=teacher, cache__dir=str(tmp_path / teacher),
                              recovery__precision="fp32"), progress=False)  # bf16 features differ by op order
        p.load(create_output=False)
        p.prune()
        caches[teacher] = p.features()(list(range(6)))
    for a, b in zip(caches["model"], caches["stream"]):
        assert all((a[k] - b[k]).abs().max().item() <= 1e-5 for k in ("inputs", "targets"))


def _folder_weights(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_an_onloaded_model_computes_what_the_whole_model_computes(arch, tmp_path):
    from overrep.model.onload import is_lazy, load_onloaded
    from overrep.model.arch import decoder_layers

    folder = make_tiny_model_dir(tmp_path / arch, corpus(40), arch=arch)
    whole, _, _ = load_model(str(folder))
    lazy, _, info = load_onloaded(str(folder), real={2})
    layers = decoder_layers(lazy)
    assert info["onloaded"] and not is_lazy(layers[2]) and all(is_lazy(b) for i, b in enumerate(layers) if i != 2)
    ids = torch.randint(0, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (whole(ids).logits - lazy(ids).logits).abs().max().item() <= 1e-5
    # no block but the real one keeps its matrices after a forward
    assert all(p.device.type == "meta" for i, b in enumerate(layers) if i != 2 for p in b.parameters() if p.dim() > 1)
    # saved block by block into many small shards, it loads back whole
    from transformers import AutoModelForCausalLM

    from overrep.model.onload_export import save_onloaded

    save_onloaded(lazy, tmp_path / "saved", shard_bytes=40_000)
    assert len(list((tmp_path / "saved").glob("*.safetensors"))) > 2
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert (whole(ids).logits - again(ids).logits).abs().max().item() == 0


def test_a_streamed_run_ends_where_the_in_memory_run_ends(assets, tmp_path):
    """prune -> features -> recover -> merge -> export -> reload with the model never whole:
    the same metrics and the same exported weights as the run that loads it whole."""
    from overrep.app.pipeline import Pipeline

    runs = {}
    for teacher in ("model", "stream"):
        cfg = tiny_cfg(assets, tmp_path / teacher, cache__teacher=teacher, cache__dir=str(tmp_path / f"c-{teacher}"),
                       recovery__precision="fp32", eval__latency=False, eval__domains=None)
        runs[teacher] = Pipeline(cfg, progress=False).run()
    a, b = runs["model"], runs["stream"]
    for k in ("dense_ppl", "pruned_ppl", "recovered_ppl", "final_train_loss"):
        assert abs(a[k] - b[k]) <= 1e-4 * abs(a[k]), k
    assert b["export_reload_max_abs_diff"] <= 1e-5
    assert (b["run"]["teacher"], b["run"]["world_size"], a["run"]["teacher"]) == ("stream", 1, "model")
    wa, wb = _folder_weights(tmp_path / "model" / "model"), _folder_weights(tmp_path / "stream" / "model")
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5


def test_a_hub_id_is_onloaded_from_the_hub_cache_and_an_uncached_one_fails_in_one_line(assets, tmp_path,
                                                                                       monkeypatch):
    import shutil

    import huggingface_hub

    from overrep.model.onload import load_onloaded

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny--llama" / "snapshots" / "0123abcd"
    shutil.copytree(assets / "tiny-llama", snapshot)
    (cache / "models--tiny--llama" / "refs").mkdir()
    (cache / "models--tiny--llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    model, _, info = load_onloaded("tiny/llama")
    assert info["kind"] == "hub" and info["source"] == "tiny/llama" and info["folder"] == str(snapshot)
    whole, _, _ = load_model(str(assets / "tiny-llama"))
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert (whole(ids).logits - model(ids).logits).abs().max().item() <= 1e-5
    with pytest.raises(OverRepError, match="not in the local cache") as error:
        load_onloaded("nobody/no-such-model")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("criterion", ["cosine", "block-influence"])
def test_a_criterion_scores_an_onloaded_model_as_the_whole_model(assets, criterion):
    from overrep.model.onload import load_onloaded
    from overrep.pruning.criteria import get_criterion

    folder = str(assets / "tiny-llama")
    ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(1))
    whole = get_criterion(criterion)(load_model(folder)[0], 2, ids)
    lazy = get_criterion(criterion)(load_onloaded(folder)[0], 2, ids)
    assert whole.removed == lazy.removed
    a, b = next(iter(whole.scores.values())), next(iter(lazy.scores.values()))
    a, b = (list(x.values()) if isinstance(x, dict) else x for x in (a, b))
    assert len(a) == len(b) and all(abs(x - y) <= 1e-5 for x, y in zip(a, b))


def test_features_are_computed_in_the_training_precision(assets, tmp_path):
    """recovery.precision bf16 computes the dense features under bf16 autocast (close to the
    fp32 ones, not equal), and each precision keeps a cache of its own."""
    from overrep.app.pipeline import Pipeline

    got = {}
    for precision in ("fp32", "bf16"):
        p = Pipeline(tiny_cfg(assets, tmp_path / precision, cache__dir=str(tmp_path / "cache"),
                              recovery__precision=precision), progress=False)
        p.load(create_output=False)
        p.prune()
        got[precision] = (p.features()(list(range(6))), p.teacher.cache_path)
    assert got["fp32"][1] != got["bf16"][1]
    for a, b in zip(got["fp32"][0], got["bf16"][0]):
        for k in ("inputs", "targets"):
            rel = ((a[k] - b[k]).norm() / a[k].norm()).item()
            assert 0 < rel < 0.05, (k, rel)
