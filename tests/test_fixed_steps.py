"""A fixed-step run exports the same weights as the code it was pinned on.

The checksums were first produced at df25968, before the recovery method descriptors, the
recovery config and the budget fit were reorganised, and the reorganised code matched them.
They were produced again once the evaluation protocol split every source into train,
validation and test by document (the training rows changed, on purpose); a refactor that
changes what a method trains or how it is set up changes them. Each checksum is the
sum and the sum of absolute values of every exported tensor, added over tensors, so the
pin survives a different summation order (another CPU's kernels) but not a different
weight anywhere: one changed entry of 1e-4 moves ``abs`` by more than the tolerance.

Every run is pinned from a cold start (``recovery.warm_start: none``) and on the ``normed``
loss, as the pins were made; the default warm start (``auto``) and the default loss
(``normed>ce``, a next-token phase after the layer-wise one) have pins of their own.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from overrep.app.cli import main

from tiny import tiny_cfg

#: arguments -> (sum of all exported weights, sum of their absolute values)
PINNED = {
    "overrep": (292.3488188371474, 934.934629432716),
    "plain": (292.4679734988234, 932.6035069692574),
    "streamline": (292.3436132801611, 932.6766688446318),
    "lora": (292.46629127142995, 936.5683871449005),
    "adalora": (292.1244990292115, 932.0474249431649),
    "lora-iso": (291.8394247296708, 937.9713440676697),
    "rankadaptor": (292.70902433805065, 936.8960764690927),
    "full-ft": (292.2219952346114, 937.8017398491667),
    "logit-kd": (292.13503484659293, 933.6030687822007),
    "overrep-kd": (292.39480335289784, 934.5422370517242),
    "overrep-lm": (292.31283371508846, 937.4704742996724),
    "restorelcc": (292.1234014143546, 932.0795221476609),
    "overrep --loss mse": (292.3488188371474, 934.934629432716),
    "overrep --loss fisher": (292.32220058503367, 934.4825411719441),
    "overrep --loss logit": (292.4063199631727, 934.619349197589),
    "overrep --loss kl-topk": (292.27083873547787, 934.3148946599442),
    # B's phase starts a fresh pass over the rows (Trainer.batch_indices), so B sees other rows;
    # re-pinned when recovery.loss_switch became 0.75 (the switch at step 4 of 6, not 5: with
    # --set recovery.loss_switch=0.8 the former pins are reproduced)
    "overrep --loss mse>normed": (292.3956290388413, 934.9839235777525),
    "overrep --loss normed>ce": (292.43007282611313, 935.1496503581837),
    "overrep --loss normed>ce+kl": (292.4379334056574, 935.1939071259193),
    "overrep --set cache.mode=live": (292.3488188371474, 934.934629432716),
    "overrep --prune width --set prune.remove=null --set prune.ratio=0.2": (420.5741398781316, 1110.9913861090108),
    "lora --prune width --set prune.remove=null --set prune.ratio=0.2": (419.526808017465, 1110.9466100738255),
    # block 1 retained since the auto warm start trains its own layout (docs/results-log.md); its
    # module's target holds attention sinks, which recovery.loss_sinks weighs apart (docs/losses.md);
    # re-pinned when the fit began to count the sinks at a fixed share (recovery.closed_tokens: balanced)
    "overrep --set recovery.warm_start=auto": (297.34542913510234, 1280.44380607366),
}


def checksum(folder) -> tuple[float, float]:
    weights = load_file(folder / "model.safetensors")
    total = sum(t.double().sum().item() for t in weights.values())
    size = sum(t.double().abs().sum().item() for t in weights.values())
    return total, size


@pytest.mark.parametrize("run", list(PINNED))
def test_fixed_step_run_exports_the_pinned_weights(assets, tmp_path, run, capsys):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "run", eval__perplexity=False, eval__latency=False, recovery__warm_start="none",
             recovery__loss="normed").save(cfg)
    assert main(["run", "--config", str(cfg), "--quiet", "--max-steps", "6", "--method", *run.split(),
                 "--set", "recovery.precision=fp32", "--set", "recovery.threads=1"]) == 0
    capsys.readouterr()
    total, size = checksum(tmp_path / "run" / "model")
    want = PINNED[run]
    assert total == pytest.approx(want[0], rel=1e-6, abs=1e-6)
    assert size == pytest.approx(want[1], rel=1e-7)
