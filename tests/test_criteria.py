"""Pruning criteria against naive references on tiny random models."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from overrep.model.arch import decoder_layers
from overrep.pruning.criteria import (CRITERIA, NEEDS_CALIBRATION, Selection, block_influence, get_criterion, laco,
                              last_but_final, segment_cosine)
from overrep.errors import OverRepError
from overrep.model.surgery import remove_layers

from tiny import tiny_ids, tiny_model

CALIB = dict(batch=10, seq=12, seed=3)  # 10 rows: with batch_size=4 the last batch is ragged


def reference_states(model, ids):
    """Inputs of every block and the un-normed output of the last one, from HF's own tensors."""
    last = []
    h = decoder_layers(model)[-1].register_forward_hook(
        lambda m, a, o: last.append(o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
    finally:
        h.remove()
    # hs[i] enters block i; hs[-1] is after the final norm, so the last block's output comes from the hook.
    return list(hs[:-1]) + [last[0]]


def mean_cos(a, b):
    return F.cosine_similarity(a.float(), b.float(), dim=-1).double().mean().item()


def make_identity(model, blocks):
    """Zero the output projections of ``blocks``: each then passes its input through unchanged."""
    with torch.no_grad():
        for i in blocks:
            layer = decoder_layers(model)[i]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, decoder_layers(model),
            copy.deepcopy(vars(model.config)), [m.training for m in model.modules()])


def assert_unchanged(model, snap):
    state, layers, config, modes = snap
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert decoder_layers(model) is layers
    assert vars(model.config) == config
    assert [m.training for m in model.modules()] == modes


# ---- registry and errors --------------------------------------------------------------------

def test_registry_and_unknown_name():
    assert set(CRITERIA) == {"last", "block-influence", "cosine", "laco"}
    assert NEEDS_CALIBRATION == {"block-influence", "cosine", "laco"}
    with pytest.raises(OverRepError, match=r"unknown pruning criterion 'nope'; available: "
                                           r"last, block-influence, cosine, laco"):
        get_criterion("nope")


@pytest.mark.parametrize("name", sorted(NEEDS_CALIBRATION))
def test_data_criteria_need_calibration(name):
    model = tiny_model("llama")
    with pytest.raises(OverRepError, match=f"criterion '{name}' needs calibration data"):
        get_criterion(name)(model, 2, None)
    with pytest.raises(OverRepError, match="integer tensor"):
        get_criterion(name)(model, 2, torch.randn(2, 8))
    with pytest.raises(OverRepError, match="at least one block must remain"):
        get_criterion(name)(model, 6, tiny_ids())
    with pytest.raises(OverRepError, match="at least 1 block"):
        get_criterion(name)(model, 0, tiny_ids())


def test_last_returns_selection_and_keeps_its_limit():
    model = tiny_model("llama")
    sel = get_criterion("last")(model, 3, None)
    assert isinstance(sel, Selection) and sel.removed == [2, 3, 4] and sel.replaced == {}
    assert last_but_final(model, 4).removed == [1, 2, 3, 4]
    with pytest.raises(OverRepError, match="at most 4 of 6 blocks"):
        last_but_final(model, 5)


# ---- block influence ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_block_influence_matches_reference(arch):
    model, ids = tiny_model(arch), tiny_ids(**CALIB)
    states = reference_states(model, ids)
    ref = [1 - mean_cos(states[i], states[i + 1]) for i in range(6)]
    ref_removed = sorted(sorted(range(6), key=lambda i: ref[i])[:2])
    sel = block_influence(model, 2, ids, batch_size=4)
    assert sel.removed == ref_removed
    assert sel.scores["block_influence"] == pytest.approx(ref, abs=1e-5)
    # one batch gives the same scores as ragged batches
    whole = block_influence(model, 2, ids, batch_size=100).scores["block_influence"]
    assert whole == pytest.approx(ref, abs=1e-5)


def test_block_influence_can_be_non_contiguous():
    model = make_identity(tiny_model("llama"), [1, 4])
    snap = snapshot(model)
    sel = block_influence(model, 2, tiny_ids(**CALIB), batch_size=4)
    assert sel.removed == [1, 4]
    bi = sel.scores["block_influence"]
    assert abs(bi[1]) < 1e-6 and abs(bi[4]) < 1e-6
    assert min(bi[i] for i in (0, 2, 3, 5)) > 1e-3
    assert_unchanged(model, snap)


# ---- segment cosine -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("n", [2, 3])
def test_cosine_matches_reference(arch, n):
    model, ids = tiny_model(arch), tiny_ids(**CALIB)
    states = reference_states(model, ids)
    ref = {i: mean_cos(states[i], states[i + n]) for i in range(6 - n + 1)}
    best = max(ref, key=ref.get)
    sel = segment_cosine(model, n, ids, batch_size=4)
    assert sel.removed == list(range(best, best + n))
    assert sorted(sel.scores["segment_cosine"]) == [str(i) for i in ref]
    assert [sel.scores["segment_cosine"][str(i)] for i in ref] == pytest.approx(list(ref.values()), abs=1e-5)


def test_cosine_picks_the_identity_segment():
    model = make_identity(tiny_model("llama"), [2, 3])
    snap = snapshot(model)
    sel = segment_cosine(model, 2, tiny_ids(**CALIB), batch_size=4)
    assert sel.removed == [2, 3]
    assert sel.scores["segment_cosine"]["2"] == pytest.approx(1.0, abs=1e-6)
    assert_unchanged(model, snap)


# ---- LaCo -----------------------------------------------------------------------------------------

def block_state(model, i):
    return {k: v.clone() for k, v in decoder_layers(model)[i].state_dict().items()}


def rdsc(base, others):
    return {k: base[k] + sum(o[k] - base[k] for o in others) for k in base}


def assert_state_close(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].device.type == "cpu"
        assert torch.allclose(got[k], want[k], atol=1e-6, rtol=0), k


def test_laco_single_merge_is_rdsc():
    model, ids = tiny_model("llama"), tiny_ids(**CALIB)
    dense = [block_state(model, i) for i in range(6)]
    sel = laco(model, 3, ids, threshold=-2.0, batch_size=4)  # accept the first candidate: l = H - C = 2
    assert sel.removed == [3, 4, 5]
    assert list(sel.replaced) == [2]
    assert_state_close(sel.replaced[2], rdsc(dense[2], dense[3:6]))
    assert [(m["into"], m["merged"]) for m in sel.scores["merges"]] == [(2, [3, 4, 5])]
    # the merge really changed block 2
    assert not torch.allclose(sel.replaced[2]["mlp.down_proj.weight"], dense[2]["mlp.down_proj.weight"])


def test_laco_merges_compound():
    model, ids = tiny_model("llama"), tiny_ids(**CALIB)
    d = [block_state(model, i) for i in range(6)]
    # C=3: first 4,5 -> 3 (l = 6-3); then l = 3 - I = 1 and positions 2,3 (dense 2 and merged 3) -> 1.
    sel = laco(model, 4, ids, merge_size=3, threshold=-2.0, batch_size=4)
    assert sel.removed == [2, 3, 4, 5]
    assert [(m["into"], m["merged"]) for m in sel.scores["merges"]] == [(3, [4, 5]), (1, [2, 3])]
    merged3 = rdsc(d[3], [d[4], d[5]])
    assert list(sel.replaced) == [1]  # block 3 absorbed others but was itself merged away
    assert_state_close(sel.replaced[1], rdsc(d[1], [d[2], merged3]))


def test_laco_interval_after_a_merge():
    model, ids = tiny_model("llama"), tiny_ids(**CALIB)
    d = [block_state(model, i) for i in range(6)]
    # C=2: 5 -> 4 (l = 6-2), then l = 4 - I = 2: 3 -> 2. Non-contiguous, two absorbing blocks.
    sel = laco(model, 2, ids, merge_size=2, threshold=-2.0, batch_size=4)
    assert sel.removed == [3, 5]
    assert [(m["into"], m["merged"]) for m in sel.scores["merges"]] == [(4, [5]), (2, [3])]
    assert sorted(sel.replaced) == [2, 4]
    assert_state_close(sel.replaced[4], rdsc(d[4], [d[5]]))
    assert_state_close(sel.replaced[2], rdsc(d[2], [d[3]]))
    sel1 = laco(model, 2, ids, merge_size=2, interval=1, threshold=-2.0, batch_size=4)
    assert sel1.removed == [4, 5]


def collapsed(model, sel):
    out = copy.deepcopy(model)
    for i, state in sel.replaced.items():
        decoder_layers(out)[i].load_state_dict(state)
    return remove_layers(out, sel.removed)


def final_similarity(model, dense, ids):
    with torch.no_grad():
        a = model(ids, output_hidden_states=True).hidden_states[-1]
        b = dense(ids, output_hidden_states=True).hidden_states[-1]
    return F.cosine_similarity(a.flatten(1), b.flatten(1), dim=1).mean().item()


# Tiny gemma3 blocks are [sliding, sliding, full] * 2 and qwen2 [full] * 3 + [sliding] * 3 with a
# window of 8 < 12 tokens: removing 2, 3 shifts the later blocks' positions, so the collapsed
# model is only right if each block keeps its own attention type.
LACO_CASES = {"top": dict(n_blocks=3), "middle": dict(n_blocks=2, merge_size=3, high=4, threshold=-2.0)}


@pytest.mark.parametrize("case", sorted(LACO_CASES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_laco_collapsed_model_matches_its_evaluation(arch, case):
    model, ids = tiny_model(arch), tiny_ids(**CALIB)
    kw = LACO_CASES[case]
    model.train()  # the criterion switches to eval and must switch back
    snap = snapshot(model)
    sel = laco(model, calibration=ids, batch_size=4, **kw)
    assert_unchanged(model, snap)
    model.eval()
    n = kw["n_blocks"]
    assert len(sel.removed) == n and len(set(sel.removed)) == n and 0 not in sel.removed
    if case == "middle":
        assert sel.removed == [2, 3] and list(sel.replaced) == [1]
    assert sel.replaced and set(sel.replaced).isdisjoint(sel.removed)

    # The pruned copy with the merged weights is the model LaCo scored last.
    merged = collapsed(model, sel)
    assert len(decoder_layers(merged)) == 6 - n
    last = sel.scores["merges"][-1]
    assert last["similarity"] > last["threshold"]
    assert final_similarity(merged, model, ids) == pytest.approx(last["similarity"], abs=1e-5)

    plain = remove_layers(copy.deepcopy(model), sel.removed)
    with torch.no_grad():
        logits, plain_logits = merged(ids).logits, plain(ids).logits
    assert torch.isfinite(logits).all()
    assert (logits - plain_logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("n", [1, 2, 4])
def test_laco_removes_exactly_n(n):
    model, ids = tiny_model("llama"), tiny_ids(**CALIB)
    sel = laco(model, n, ids, batch_size=4)
    assert len(sel.removed) == n
    assert sum(len(m["merged"]) for m in sel.scores["merges"]) == n


def test_laco_lowers_the_threshold_until_n_are_removed():
    model, ids = tiny_model("llama"), tiny_ids(**CALIB)
    sel = laco(model, 4, ids, threshold=1.5, threshold_step=0.25, batch_size=4)
    assert len(sel.removed) == 4
    merges = sel.scores["merges"]
    # cosine <= 1 < 1.25: nothing can pass before the threshold is lowered twice
    assert all(m["threshold"] <= 1.0 for m in merges)
    assert all(m["threshold"] in (1.0, 0.75, 0.5, 0.25, 0.0, -0.25, -0.5, -0.75, -1.0) for m in merges)
    assert all(m["similarity"] > m["threshold"] for m in merges)
    assert sel.scores["sweeps"] >= 3 and sel.scores["final_threshold"] == merges[-1]["threshold"]


def test_laco_errors():
    model, ids = tiny_model("llama"), tiny_ids()
    with pytest.raises(OverRepError, match="at most 4 of 6 blocks"):
        laco(model, 5, ids)
    with pytest.raises(OverRepError, match="at most 2 of 6 blocks"):
        laco(model, 3, ids, low=2, high=5)
    with pytest.raises(OverRepError, match="merge_size"):
        laco(model, 2, ids, merge_size=1)
    # Qwen3-MoE tiny model alternates dense-MLP and MoE blocks: nothing can merge.
    with pytest.raises(OverRepError, match="one structure"):
        laco(tiny_model("qwen3_moe"), 2, ids)
