"""On a CUDA device: the onloaded model, ``model.dtype: auto`` and a short bf16 run. Skipped
without one; ``make gpu-check`` (benchmarks/gpu_check.py) runs them with its measurements."""

from __future__ import annotations

import pytest
import torch

from overrep.core.precision import resolve_model_dtype
from overrep.model.loading import load_model
from overrep.model.onload import load_onloaded

from tiny import tiny_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_auto_weights_are_bf16_on_the_gpu():
    assert resolve_model_dtype("auto", "cuda") == torch.bfloat16


def test_an_onloaded_model_on_the_gpu_computes_what_the_whole_model_computes(assets):
    folder = str(assets / "tiny-llama")
    whole = load_model(folder)[0].to("cuda")
    lazy = load_onloaded(folder, device="cuda")[0]
    ids = torch.randint(0, 200, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        assert (whole(ids).logits - lazy(ids).logits).abs().max().item() <= 1e-4
    assert all(p.device.type in ("cuda", "meta") for p in lazy.parameters())


@pytest.mark.parametrize("teacher", ["model", "stream"])
def test_a_bf16_run_on_the_gpu(assets, tmp_path, teacher):
    from overrep.app.pipeline import Pipeline

    cfg = tiny_cfg(assets, tmp_path / teacher, model__device="cuda", model__dtype="auto", cache__teacher=teacher,
                   recovery__precision="auto", eval__latency=False, eval__domains=None)
    m = Pipeline(cfg, progress=False).run()
    assert m["precision"] == "bf16" and m["run"]["model_dtype"] == "bfloat16"
    assert m["run"]["ranks"][0]["device"].startswith("cuda") and m["export_reload_max_abs_diff"] <= 1e-2
