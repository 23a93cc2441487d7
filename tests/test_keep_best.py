"""``recovery.keep_best``: the run ends at its best foldable validation step, chosen on
validation rows the report never scores, and a resumed run chooses the same step."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from overrep.app.pipeline import Pipeline
from overrep.recovery.objectives import Objective
from overrep.recovery.trainer import Trainer

from tiny import run_killed_at, tiny_cfg


@pytest.fixture
def scripted(monkeypatch):
    """Every objective's validation perplexity follows ``script[step]`` (the step just
    trained), and the trainable tensors at each scored step are kept in ``seen``."""
    state = {"step": 0, "script": {}, "seen": {}}
    step = Trainer._step

    def stepping(self):
        out = step(self)
        state["step"] = self.step + 1
        return out

    def validation_ppl(self):
        state["seen"][state["step"]] = [p.detach().clone() for p in self.parameters()]
        return state["script"][state["step"]]

    monkeypatch.setattr(Trainer, "_step", stepping)
    for cls in (Objective, *_subclasses(Objective)):
        if "validation_ppl" in cls.__dict__:
            monkeypatch.setattr(cls, "validation_ppl", validation_ppl)
    return state


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _trained(cfg):
    pipe = Pipeline(cfg, progress=False)
    pipe.load(create_output=False)
    pipe.prune()
    pipe.build_recovery()
    trainer = pipe.make_trainer()
    trainer.run()
    return trainer


def test_a_method_without_annealing_ends_at_its_best_step(assets, tmp_path, scripted):
    scripted["script"] = {1: 9.0, 2: 4.0, 3: 6.0, 4: 7.0, 5: 8.0, 6: 8.5}
    trainer = _trained(tiny_cfg(assets, tmp_path / "p", recovery__method="plain", recovery__steps=6,
                                recovery__eval_every=1, recovery__warm_start="none"))
    assert trainer.selected == {"step": 2, "val_ppl": 4.0, "last_step": 6, "last_val_ppl": 8.5}
    for p, kept in zip(trainer.objective.parameters(), scripted["seen"][2]):
        assert torch.equal(p, kept)
    assert not torch.equal(scripted["seen"][2][0], scripted["seen"][6][0])  # training did move them


def test_overrep_chooses_only_among_steps_that_fold_exactly(assets, tmp_path, scripted):
    # the lowest perplexity is at step 2, while the annealed activation is non-linear
    scripted["script"] = {s: (1.0 if s == 2 else 20.0 - s) for s in range(1, 11)}
    scripted["script"][9] = 5.0
    trainer = _trained(tiny_cfg(assets, tmp_path / "o", recovery__steps=10, recovery__eval_every=1,
                                recovery__warm_start="none"))  # cold: the annealed preset
    alpha = {h["step"]: h["alpha"] for h in trainer.history}
    assert alpha[2] > 0 and alpha[9] == 0
    assert trainer.selected["step"] == 9 and trainer.selected["last_val_ppl"] == 10.0
    for p, kept in zip(trainer.objective.parameters(), scripted["seen"][9]):
        assert torch.equal(p, kept)


def test_off_or_best_at_the_end_keeps_the_last_step(assets, tmp_path, scripted):
    scripted["script"] = {1: 9.0, 2: 4.0, 3: 6.0, 4: 7.0}
    off = _trained(tiny_cfg(assets, tmp_path / "off", recovery__method="plain", recovery__steps=4,
                            recovery__eval_every=1, recovery__keep_best=False, recovery__warm_start="none"))
    assert off.selected is None
    for p, last in zip(off.objective.parameters(), scripted["seen"][4]):
        assert torch.equal(p, last)
    scripted["script"] = {1: 9.0, 2: 4.0, 3: 6.0, 4: 3.0}
    on = _trained(tiny_cfg(assets, tmp_path / "on", recovery__method="plain", recovery__steps=4,
                           recovery__eval_every=1, recovery__warm_start="none"))
    assert on.selected["step"] == on.selected["last_step"] == 4


def test_a_last_step_left_unvalidated_is_not_given_an_earlier_steps_score(assets, tmp_path, monkeypatch, scripted):
    # a budgeted run leaves out a validation that would end past its deadline: the last step
    # then has no score of its own, and the record must not lend it the last one taken
    scripted["script"] = {1: 9.0, 2: 4.0, 3: 6.0}
    monkeypatch.setattr(Trainer, "room_to_validate", lambda self: self.step != self.total)
    trainer = _trained(tiny_cfg(assets, tmp_path / "u", recovery__method="plain", recovery__steps=4,
                                recovery__eval_every=1, recovery__warm_start="none"))
    assert trainer.selected == {"step": 4, "val_ppl": None, "last_step": 4, "last_val_ppl": None,
                                "validated_step": 3, "validated_ppl": 6.0}
    from overrep.app.report import _selection_line
    assert "not validated" in _selection_line(trainer.selected)[0] and "step 3" in _selection_line(trainer.selected)[0]


def test_the_choice_survives_a_kill_and_resume(assets, tmp_path, monkeypatch, scripted):
    scripted["script"] = {2: 9.0, 4: 4.0, 6: 6.0, 8: 7.0}  # best at 4, killed at 7 (last checkpoint 6)
    kw = dict(recovery__method="plain", recovery__eval_every=2, eval__latency=False, recovery__warm_start="none")
    ref = tmp_path / "ref"
    Pipeline(tiny_cfg(assets, ref, **kw), progress=False).run()
    out = tmp_path / "out"
    cfg = tiny_cfg(assets, out, **kw)
    run_killed_at(monkeypatch, cfg, 7)
    Pipeline(cfg, resume=True, progress=False).run()
    m = json.loads((out / "metrics.json").read_text())
    assert m["keep_best"]["step"] == 4 and m["keep_best"]["last_step"] == 8
    assert "kept step 4" in (out / "report.md").read_text()
    a, b = load_file(ref / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k


def test_validation_rows_are_not_the_held_out_rows(assets, tmp_path):
    pipe = Pipeline(tiny_cfg(assets, tmp_path / "v", data__validation_sequences=3), progress=False)
    pipe.load(create_output=False)
    assert pipe.val_ids.shape == (3, 32)
    rows = {tuple(r) for r in pipe.heldout_ids.tolist()} | {tuple(r) for r in pipe.train_ids.tolist()}
    assert not rows & {tuple(r) for r in pipe.val_ids.tolist()}


def test_export_from_checkpoints_keeps_the_chosen_step(assets, tmp_path, scripted):
    import shutil

    from overrep.app.cli import main

    scripted["script"] = {2: 9.0, 4: 4.0, 6: 6.0, 8: 7.0}
    out = tmp_path / "run"
    m = Pipeline(tiny_cfg(assets, out, recovery__method="plain", recovery__eval_every=2, eval__latency=False,
                          recovery__warm_start="none"),
                 progress=False).run()
    assert m["keep_best"]["step"] == 4
    before = load_file(out / "model" / "model.safetensors")
    shutil.rmtree(out / "model")
    (out / "metrics.json").unlink()
    assert main(["export", "--output", str(out), "--quiet"]) == 0
    after = load_file(out / "model" / "model.safetensors")
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_a_warm_start_can_end_at_the_closed_form_it_started_from(assets, tmp_path, scripted):
    # training that never beats the closed form on validation ships the closed form itself
    scripted["script"] = {0: 3.0, **{s: 10.0 - s / 10 for s in range(1, 7)}}
    out = tmp_path / "w"
    m = Pipeline(tiny_cfg(assets, out, recovery__steps=6, recovery__eval_every=2, recovery__warm_start="replaceme",
                          eval__latency=False), progress=False).run()
    assert m["warm_start"]["used"] == "replaceme"
    assert m["keep_best"].pop("start_val_seconds") >= 0  # scoring the closed form is timed, inside the budget
    assert m["keep_best"] == {"step": 0, "val_ppl": 3.0, "last_step": 6, "last_val_ppl": 9.4, "start_val_ppl": 3.0}
    assert "kept the closed form it started from" in (out / "report.md").read_text()
    closed = tmp_path / "c"  # the same closed form, fitted with no training at all
    Pipeline(tiny_cfg(assets, closed, recovery__method="replaceme", eval__latency=False), progress=False).run()
    a, b = load_file(closed / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), k


def test_training_that_passes_the_closed_form_keeps_its_step_and_says_what_it_beat(assets, tmp_path, scripted):
    scripted["script"] = {0: 9.0, 2: 8.0, 4: 5.0, 6: 6.0}
    m = Pipeline(tiny_cfg(assets, tmp_path / "p", recovery__method="plain", recovery__steps=6, recovery__eval_every=2,
                          recovery__warm_start="replaceme", eval__latency=False), progress=False).run()
    assert m["keep_best"].pop("start_val_seconds") >= 0
    assert m["keep_best"] == {"step": 4, "val_ppl": 5.0, "last_step": 6, "last_val_ppl": 6.0, "start_val_ppl": 9.0}
    assert "the closed form it started from: 9" in (tmp_path / "p" / "report.md").read_text()


def test_a_cold_start_does_not_score_its_start(assets, tmp_path, scripted):
    scripted["script"] = {2: 8.0, 4: 5.0}
    m = Pipeline(tiny_cfg(assets, tmp_path / "c", recovery__steps=4, recovery__eval_every=2,
                          recovery__warm_start="none", eval__latency=False), progress=False).run()
    assert 0 not in scripted["seen"] and "start_val_ppl" not in m["keep_best"] and "start_val_seconds" not in m["keep_best"]
