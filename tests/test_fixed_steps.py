"""A fixed-step run exports the same weights as the code it was pinned on.

The checksums below were produced by the same runs at df25968, before the recovery
method descriptors, the recovery config and the budget fit were reorganised; a refactor
that changes what a method trains or how it is set up changes them. Each checksum is the
sum and the sum of absolute values of every exported tensor, added over tensors, so the
pin survives a different summation order (another CPU's kernels) but not a different
weight anywhere: one changed entry of 1e-4 moves ``abs`` by more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from overrep.app.cli import main

from tiny import tiny_cfg

#: arguments -> (sum of all exported weights, sum of their absolute values), from df25968
PINNED = {
    "overrep": (292.2859751775975, 935.2555796918866),
    "plain": (292.3029689244589, 933.1534290088788),
    "streamline": (292.4362661775989, 933.2836120704618),
    "lora": (292.3593635488677, 937.3382066787717),
    "adalora": (292.1236066593282, 932.0458004296378),
    "lora-iso": (292.4995815601789, 938.9701832365931),
    "rankadaptor": (292.4253905060741, 937.8837306388148),
    "full-ft": (292.6599011755667, 939.1079950441168),
    "logit-kd": (291.9666408090453, 934.1828044147697),
    "overrep-kd": (292.32914089556544, 935.2197596370852),
    "restorelcc": (292.1258080377846, 932.0786059291712),
    "overrep --loss mse": (292.2859751775975, 935.2555796918866),
    "overrep --loss fisher": (292.2445674735527, 934.9278581764991),
    "overrep --loss logit": (292.32689629108233, 935.2593441716316),
    "overrep --loss kl-topk": (292.511084796138, 934.9709004394122),
    "overrep --loss mse>normed": (292.2859751775975, 935.2555796918866),
    "overrep --set cache.mode=live": (292.2859751775975, 935.2555796918866),
    "overrep --prune width --set prune.remove=null --set prune.ratio=0.2": (418.1924838071197, 1109.841066346975),
    "lora --prune width --set prune.remove=null --set prune.ratio=0.2": (418.07136497303793, 1110.8054746232137),
}


def checksum(folder) -> tuple[float, float]:
    weights = load_file(folder / "model.safetensors")
    total = sum(t.double().sum().item() for t in weights.values())
    size = sum(t.double().abs().sum().item() for t in weights.values())
    return total, size


@pytest.mark.parametrize("run", list(PINNED))
def test_fixed_step_run_exports_the_pinned_weights(assets, tmp_path, run, capsys):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "run", eval__perplexity=False, eval__latency=False).save(cfg)
    assert main(["run", "--config", str(cfg), "--quiet", "--max-steps", "6", "--method", *run.split(),
                 "--set", "recovery.precision=fp32", "--set", "recovery.threads=1"]) == 0
    capsys.readouterr()
    total, size = checksum(tmp_path / "run" / "model")
    want = PINNED[run]
    assert total == pytest.approx(want[0], rel=1e-6, abs=1e-6)
    assert size == pytest.approx(want[1], rel=1e-7)
