"""RankAdaptor (per-block LoRA ranks from a performance-model search) on the tiny model."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from overrep.app.pipeline import Pipeline
from overrep.errors import OverRepError
from overrep.recovery.methods import lora_params_per_rank
from overrep.recovery.methods.rankadaptor import PerformanceModel, RankSearch, RankSpace

from tiny import tiny_cfg

# a small search: 4 probes (uniform + 1 sampled offline, 2 proposed online) of 3 steps each
SEARCH = dict(recovery__method="rankadaptor", recovery__lora_rank=4, recovery__rankadaptor_probes=4,
              recovery__rankadaptor_probe_steps=3, recovery__rankadaptor_candidates=64,
              eval__perplexity=False, eval__latency=False)


def counting_probes(monkeypatch) -> list:
    calls = []
    original = RankSearch.probe

    def probe(self, config):
        calls.append(config)
        return original(self, config)

    monkeypatch.setattr(RankSearch, "probe", probe)
    return calls


def test_a_search_that_outgrows_its_share_of_the_budget_stops_at_plain_lora(assets, tmp_path, monkeypatch):
    """The search is part of the wall-clock: past its share of a time budget it measures no
    more probes, and with only the uniform one measured the ranks are plain LoRA's."""
    calls = counting_probes(monkeypatch)
    m = Pipeline(tiny_cfg(assets, tmp_path / "run", recovery__steps=None, recovery__time_budget="8s",
                          recovery__rankadaptor_budget_share=0.001, **SEARCH), progress=False).run()
    assert len(calls) == 1
    ra = m["rankadaptor"]
    assert ra["truncated"] is True and ra["performance_model"] is None
    assert list(ra["block_ranks"].values()) == [4, 4, 4, 4] and m["train_steps"] >= 1


def test_budgeted_run_searches_once_and_exports_a_compact_model(assets, tmp_path, monkeypatch):
    """Under a time budget the pipeline builds the recovery twice: the second build reads the
    search back; the exported model is the merged compact one."""
    calls = counting_probes(monkeypatch)
    monkeypatch.setattr(RankSearch, "out_of_time", lambda self: False)  # all 4 probes, however slow the machine
    out = tmp_path / "run"
    m = Pipeline(tiny_cfg(assets, out, recovery__steps=None, recovery__time_budget="8s", **SEARCH),
                 progress=False).run()
    assert len(calls) == 4  # one search, though the budget rebuilt the recovery
    ra = m["rankadaptor"]
    assert ra["search"] == "cached"  # the recovery that trained is the rebuilt one
    assert ra["search_seconds"] > 0 and m["timings_seconds"]["search"] == ra["search_seconds"]
    assert m["time_budget"]["used_seconds"] >= ra["search_seconds"]  # the search is paid from the budget
    ranks = ra["block_ranks"]
    assert list(ranks) == ["0", "1", "2", "3"] and ra["mean_rank"] == 4
    assert [p["ranks"] for p in ra["probes"]][0] == [4, 4, 4, 4]  # plain LoRA is always measured
    assert any(len(set(p["ranks"])) > 1 for p in ra["probes"])  # and configurations that are not uniform
    assert all(sum(p["ranks"]) == 16 and 2 <= min(p["ranks"]) and max(p["ranks"]) <= 8 for p in ra["probes"])
    best = min(ra["probes"], key=lambda p: p["val_loss"])
    assert list(ranks.values()) == best["ranks"] and ra["best_val_loss"] <= ra["uniform_val_loss"]
    assert [p["phase"] for p in ra["probes"]] == ["offline"] * 2 + ["online"] * 2
    assert all(p["predicted"] is not None for p in ra["probes"][2:])
    assert ra["performance_model"]["fitted_on"] == 4 and "loo_rmse" in ra["performance_model"]
    # the same trainable budget as plain LoRA at the mean rank (every block has one shape)
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert m["trainable_params"] == 4 * lora_params_per_rank(model)
    assert 0 <= m["merge_max_abs_diff"] < 1e-4 and m["export_reload_max_abs_diff"] < 1e-5
    assert model.config.num_hidden_layers == 4
    assert not any("lora" in k for k in load_file(out / "model" / "model.safetensors"))
    provenance = json.loads((out / "model" / "overrep.json").read_text())
    assert provenance["recovery"]["rankadaptor"]["block_ranks"] == ranks


def test_search_is_cached_seeded_and_leaves_the_random_state_alone(assets, tmp_path, monkeypatch):
    calls = counting_probes(monkeypatch)

    def build(name):
        p = Pipeline(tiny_cfg(assets, tmp_path / name, **SEARCH), progress=False)
        p.load(create_output=False)
        p.prune()
        torch.manual_seed(7)
        t0 = time.perf_counter()
        p.build_recovery()
        p.wall = time.perf_counter() - t0
        return p

    first = build("a")
    assert len(calls) == 4 and first.recovery.searched_now
    lora_a = {k: v.clone() for k, v in first.recovery.peft_model.state_dict().items() if "lora_A" in k}
    again = build("b")  # another run on the same inputs (a resume, a budget's rebuild): no probe
    assert len(calls) == 4 and not again.recovery.searched_now
    assert again.recovery.block_ranks == first.recovery.block_ranks
    assert again.recovery.search_seconds == first.recovery.search_seconds > 0
    # the adapters start from the same weights whether the search ran or was read back
    state = again.recovery.peft_model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in lora_a.items())
    blocks = again.recovery.block_ranks
    for i, layer in enumerate(again.recovery.peft_model.base_model.model.model.layers):
        assert layer.self_attn.q_proj.lora_A["default"].weight.shape[0] == blocks[i]
        assert layer.mlp.down_proj.lora_B["default"].weight.shape[1] == blocks[i]
    other = Pipeline(tiny_cfg(assets, tmp_path / "c", **{**SEARCH, "recovery__seed": 1}), progress=False)
    other.load(create_output=False)
    other.prune()
    other.build_recovery()  # another seed is another search
    assert len(calls) == 8


def test_without_data_it_neither_searches_nor_needs_a_search(assets, tmp_path, monkeypatch):
    calls = counting_probes(monkeypatch)
    p = Pipeline(tiny_cfg(assets, tmp_path / "plan", cache__dir=str(tmp_path / "empty-cache"), **SEARCH),
                 progress=False)
    p.load(create_output=False)
    p.prune()
    per_rank = lora_params_per_rank(p.pruned)
    p.build_recovery(with_data=False)  # overrep plan: uniform ranks, the same trainable count
    assert not calls and p.recovery.summary()["search"].startswith("not run")
    assert set(p.recovery.block_ranks.values()) == {4}
    assert p.recovery.trainable_params == 4 * per_rank


@pytest.mark.parametrize("field,value,message", [
    ("rankadaptor_probes", 1, "recovery.rankadaptor_probes must be >= 2, got 1"),
    ("rankadaptor_probe_steps", 0, "recovery.rankadaptor_probe_steps must be >= 1"),
    ("rankadaptor_candidates", 0, "recovery.rankadaptor_candidates must be >= 1"),
    ("rankadaptor_budget_share", 0, "recovery.rankadaptor_budget_share must be in (0, 1], got 0"),
    ("rankadaptor_val_sequences", 20, "rankadaptor_val_sequences=20 leaves 3 of the 24 training rows"),
])
def test_impossible_settings_are_one_line_errors(assets, tmp_path, field, value, message):
    with pytest.raises(OverRepError) as e:
        tiny_cfg(assets, tmp_path / "x", **{**SEARCH, f"recovery__{field}": value})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_rank_space_keeps_the_mean_and_the_range():
    rng = random.Random(0)
    space = RankSpace(19, 16)
    assert space.levels == [8, 16, 24, 32] and space.searchable
    for _ in range(200):
        c = space.sample(rng)
        moved = space.move(c, rng)
        for ranks in (c, moved):
            assert len(ranks) == 19 and sum(ranks) == 19 * 16 and 8 <= min(ranks) and max(ranks) <= 32
    assert len({space.sample(rng) for _ in range(50)}) > 40  # varied
    assert not RankSpace(5, 1).searchable and not RankSpace(1, 8).searchable  # only the uniform one fits
    odd = RankSpace(6, 3)
    assert odd.levels == [2, 3, 5, 6] and all(sum(odd.sample(rng)) == 18 for _ in range(50))


def test_performance_model_learns_which_blocks_want_rank():
    """On a synthetic quality function (block 0 gains most from rank) the fitted model ranks
    unseen configurations as the function does."""
    rng = random.Random(1)
    space = RankSpace(4, 4)

    def loss(c):
        return 3.0 - 0.05 * c[0] - 0.01 * c[1] + 0.002 * (c[0] - 4) ** 2

    seen = [space.sample(rng) for _ in range(12)]
    model = PerformanceModel(4)
    fit = model.fit(seen, [loss(c) for c in seen])
    assert fit["train_r2"] > 0.99 and fit["loo_r2"] > 0.9
    unseen = [space.sample(rng) for _ in range(30)]
    predicted = model.predict(unseen)
    best = min(range(30), key=lambda j: predicted[j])
    assert loss(unseen[best]) <= sorted(loss(c) for c in unseen)[2]  # among the true three best
