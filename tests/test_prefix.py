"""Scoring from the blocks models share (overrep.model.prefix): the same per-token losses as
the whole forward, on every architecture, and the whole forward wherever the two would differ."""

import copy
import logging

import pytest
import torch

from overrep.model.arch import decoder_layers
from overrep.model.perplexity import row_token_nll
from overrep.model.prefix import SharedPrefix, _TailScorer, first_changed_block
from overrep.model.surgery import plan_pruning, remove_layers
from tiny import ARCHS, HYBRIDS, tiny_ids, tiny_model


def pruned_and_trained(dense):
    """Blocks 3-4 of 6 removed and block 2 changed, as a warm-started recovery leaves them."""
    model = remove_layers(copy.deepcopy(dense), [3, 4])
    with torch.no_grad():
        for p in decoder_layers(model)[2].parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("arch", ARCHS + HYBRIDS)
def test_shared_prefix_scores_as_the_whole_forward(arch):
    dense = tiny_model(arch)
    ids = tiny_ids(batch=5, seq=24)
    prefix = SharedPrefix(dense, first_changed_block(plan_pruning(6, [3, 4], blocks=2)))
    assert prefix.start == 2
    whole_dense = row_token_nll(dense, ids, batch_size=2)
    assert torch.equal(row_token_nll(dense, ids, batch_size=2, prefix=prefix), whole_dense)  # captures
    rows, states = next(iter(prefix.states.values()))
    assert torch.equal(rows, ids) and states.shape[:2] == ids.shape
    model = pruned_and_trained(dense)
    assert prefix.shares(model)
    assert isinstance(prefix.scorer(model, ids), _TailScorer)
    got = row_token_nll(model, ids, batch_size=2, prefix=prefix)
    assert torch.allclose(got, row_token_nll(model, ids, batch_size=2), atol=1e-5, rtol=0)
    assert not prefix.refused
    assert not torch.allclose(got, whole_dense)  # a different model, scored as itself


def test_a_model_that_changed_its_first_blocks_is_scored_whole():
    dense = tiny_model("llama")
    ids = tiny_ids(batch=3, seq=16)
    prefix = SharedPrefix(dense, 2)
    row_token_nll(dense, ids, prefix=prefix)
    tuned = copy.deepcopy(dense)  # e.g. LoRA merged into every block
    with torch.no_grad():
        decoder_layers(tuned)[0].mlp.down_proj.weight.mul_(1.1)
    assert not prefix.shares(tuned)
    assert torch.equal(row_token_nll(tuned, ids, prefix=prefix), row_token_nll(tuned, ids))
    assert not SharedPrefix(dense, 0).shares(dense)  # width pruning: nothing shared


def test_rows_not_seen_before_are_captured_by_the_first_model_that_shares_them():
    dense = tiny_model("llama")
    prefix = SharedPrefix(dense, 2)
    a, b = tiny_ids(batch=3, seq=16, seed=1), tiny_ids(batch=3, seq=16, seed=2)
    model = pruned_and_trained(dense)
    row_token_nll(dense, a, prefix=prefix)
    want = row_token_nll(model, b)
    assert torch.equal(row_token_nll(model, b, prefix=prefix), want)  # b: captured by this model itself
    assert len(prefix.states) == 2


def test_a_forward_that_does_more_than_its_blocks_is_scored_whole(caplog):
    dense = tiny_model("llama")
    ids = tiny_ids(batch=4, seq=16)
    prefix = SharedPrefix(dense, 2)
    row_token_nll(dense, ids, prefix=prefix)
    model = pruned_and_trained(dense)
    forward = model.forward

    def scaled(*args, **kwargs):  # an architecture that scales its logits outside the head
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = scaled
    with caplog.at_level(logging.WARNING, logger="overrep.model.prefix"):
        got = row_token_nll(model, ids, batch_size=2, prefix=prefix)
    assert "scored whole" in caplog.text
    assert torch.equal(got, row_token_nll(model, ids, batch_size=2))
    assert not prefix.shares(model)


def test_the_first_rows_of_kept_ones_and_another_precision():
    """A validation timed on a sample reads the first rows of its kept states; states kept in
    fp32 never serve a forward under bf16 autocast."""
    dense = tiny_model("llama")
    ids = tiny_ids(batch=6, seq=16)
    prefix = SharedPrefix(dense, 2)
    row_token_nll(dense, ids, prefix=prefix)
    model = pruned_and_trained(dense)
    assert isinstance(prefix.scorer(model, ids[:3]), _TailScorer)
    assert torch.equal(row_token_nll(model, ids[:3], prefix=prefix), row_token_nll(model, ids[:3]))
    assert not isinstance(prefix.scorer(model, ids[1:4]), _TailScorer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not isinstance(prefix.scorer(model, ids), _TailScorer)
        row_token_nll(dense, ids, prefix=prefix)  # kept again, under bf16
        assert isinstance(prefix.scorer(model, ids), _TailScorer)
        assert torch.equal(row_token_nll(model, ids, prefix=prefix), row_token_nll(model, ids))
    assert len(prefix.states) == 2


def test_rows_whose_states_would_not_fit_are_scored_whole(monkeypatch):
    import overrep.model.prefix as prefix_module

    dense = tiny_model("llama")
    ids = tiny_ids(batch=4, seq=16)
    monkeypatch.setattr(prefix_module, "MAX_STATE_BYTES", ids.numel() * dense.get_input_embeddings().embedding_dim * 4 - 1)
    prefix = SharedPrefix(dense, 2)
    assert torch.equal(row_token_nll(dense, ids, prefix=prefix), row_token_nll(dense, ids))
    assert not prefix.states
