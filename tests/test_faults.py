"""Fault injection: bad input and hostile conditions never destroy data, never train on the
wrong thing silently, and always end in one line with a non-zero exit.

Each test is one probe a user could hit: a typo next to ``--overwrite``, ``--remove 0``, a
run too short for a linear phase, a full disk, a read-only folder, a failure after the
model loaded, config values that are not numbers, a huge document.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from overrep.app.cli import main
from overrep.app.config import RunConfig
from overrep.errors import MergeRefused, OverRepError
from overrep.app.pipeline import Pipeline
from overrep.core.schedule import AlphaSchedule

from tiny import tiny_cfg

QUIET = dict(eval__perplexity=False, eval__latency=False)


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def finished_run(assets, out: Path) -> dict[str, bytes]:
    """A finished tiny run in ``out``; returns a snapshot of its files."""
    Pipeline(tiny_cfg(assets, out, recovery__steps=2, **QUIET), progress=False).run()
    return snapshot(out)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    """Temporary or partial files anywhere under ``folder`` (and hidden siblings of it)."""
    found = [str(p) for p in folder.rglob("*") if re.search(r"\.(tmp|partial|old)-|\.tmp$", p.name)]
    found += [str(p) for p in folder.parent.glob(f".{folder.name}.*")]
    return found


# ---- 1. --overwrite never destroys what it should not --------------------------------
@pytest.mark.parametrize("bad", [["--model", "typo-path"], ["--remove", "abc"], ["--set", "recovery.lr=nan"]])
def test_overwrite_with_a_bad_command_keeps_the_finished_run(assets, tmp_path, capsys, bad):
    out = tmp_path / "run"
    before = finished_run(assets, out)
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out).save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--overwrite", "--quiet", *bad)
    assert code == 2 and err.startswith("overrep: error:"), err
    assert snapshot(out) == before


def test_overwrite_refuses_a_folder_overrep_did_not_write(assets, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out).save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--overwrite", "--quiet")
    assert code == 2 and "thesis.tex" in err and "did not write" in err
    assert (out / "thesis.tex").read_text() == "years of work" and len(list(out.iterdir())) == 1


def test_overwrite_restores_the_old_run_when_the_new_one_fails_before_training(assets, tmp_path, monkeypatch):
    out = tmp_path / "run"
    before = finished_run(assets, out)

    def broken(self, *a, **k):
        raise OverRepError("simulated failure while setting up recovery")

    monkeypatch.setattr(Pipeline, "build_recovery", broken)
    with pytest.raises(OverRepError, match="simulated"):
        Pipeline(tiny_cfg(assets, out, recovery__steps=3, **QUIET), overwrite=True, progress=False).run()
    assert snapshot(out) == before and not leftovers(out)


def test_overwrite_replaces_the_old_run_once_the_new_one_finishes(assets, tmp_path):
    out = tmp_path / "run"
    finished_run(assets, out)
    m = Pipeline(tiny_cfg(assets, out, recovery__steps=3, **QUIET), overwrite=True, progress=False).run()
    assert m["train_steps"] == 3 and json.loads((out / "metrics.json").read_text())["train_steps"] == 3
    assert not leftovers(out)


# ---- 5. a failed start leaves nothing that blocks the corrected command ---------------
def test_failure_after_the_model_loads_leaves_nothing_behind(assets, tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = tiny_cfg(assets, out, recovery__steps=2, **QUIET)
    with monkeypatch.context() as m:
        m.setattr(Pipeline, "build_recovery", lambda self, *a, **k: (_ for _ in ()).throw(OverRepError("boom")))
        with pytest.raises(OverRepError, match="boom"):
            Pipeline(cfg, progress=False).run()
    assert not out.exists()
    Pipeline(cfg, progress=False).run()  # the corrected command needs no --overwrite
    assert (out / "metrics.json").is_file()


def test_a_bad_preset_fails_before_anything_is_written(assets, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out).save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--set", "recovery.preset=nope", "--quiet")
    assert code == 2 and "unknown preset 'nope'" in err and not out.exists()


# ---- 2. --remove 0: the module is trained on what it receives at inference -------------
def test_removing_block_0_trains_the_module_on_the_embeddings(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "r0", prune__remove="0", recovery__steps=2, **QUIET), progress=False)
    p.prepare_output()
    p.load()
    p.prune()
    (group,) = p.plan.groups
    assert group.input_layer == 0 and group.module_layers[0] == 1
    ids = p.train_ids[:2].to(p.device)
    feats = p.teacher.batch(ids)[0]
    embeddings = p.dense.get_input_embeddings()(ids)
    assert torch.equal(feats["inputs"].to(p.device), embeddings)
    # ... and that is what the compact model feeds its first block.
    seen = {}
    first = p.pruned.model.layers[0]

    def grab(module, args, kwargs):
        seen["h"] = args[0] if args else kwargs["hidden_states"]

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        p.pruned(input_ids=ids)
    handle.remove()
    assert torch.equal(seen["h"], feats["inputs"].to(p.device))


# ---- 3. the merge reproduces the trained function, and needs a linear phase -----------
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 50, 432])
def test_every_schedule_ends_with_a_linear_step(steps):
    s = AlphaSchedule(steps, 0.01, 0.2)
    assert s.alpha(steps - 1) == 0.0
    if steps >= 5:  # long enough for the paper's schedule: unchanged
        assert s.decay_end == pytest.approx(0.8 * steps)
        assert s.alpha(1) > 0


@pytest.mark.parametrize("ratio", ["0", "-0.1", "1.5"])
def test_a_schedule_without_a_linear_phase_is_refused(assets, tmp_path, capsys, ratio):
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out).save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--set", f"recovery.alpha_linear_ratio={ratio}",
                        "--quiet")
    assert code == 2 and "alpha_linear_ratio" in err and not out.exists()


def test_a_two_step_run_merges_the_function_it_trained(assets, tmp_path):
    out = tmp_path / "short"
    m = Pipeline(tiny_cfg(assets, out, recovery__steps=2, **QUIET), progress=False).run()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["alpha"] == 0.0  # the last step trained the (linear) function that is folded
    assert m["merge_max_rel_diff"] <= 1e-5


def test_trained_and_merged_modules_agree_independently(assets, tmp_path):
    """Recompute, outside the method's own check, the trained module's output at the alpha
    its last step used and compare it with the merged model's blocks."""
    p = Pipeline(tiny_cfg(assets, tmp_path / "x", recovery__steps=3, **QUIET), progress=False)
    p.prepare_output()
    p.load()
    p.prune()
    p.build_recovery()
    p.train()
    rec = p.recovery
    last_alpha = p.trainer.history[-1]["alpha"]
    for a in rec.objective.activations:
        a.set_alpha(last_alpha)
    for m in rec.modules:  # the trained weights' function in exact (fp32) arithmetic, as merged
        m.precision = "fp32"
    probe = p.teacher.batch(p.heldout_ids[:2])
    with torch.no_grad():
        trained = [m(f["inputs"], c).clone() for m, f, c in zip(rec.modules, probe, rec.contexts)]
        p.merge()
        merged = [m(f["inputs"], c) for m, f, c in zip(rec.modules, probe, rec.contexts)]
    for t, m in zip(trained, merged):
        assert (t - m).abs().max() <= 1e-5 * t.abs().max()


def test_merge_refused_is_a_one_line_user_error():
    from overrep.core.schedule import AnnealedActivation

    act = AnnealedActivation(torch.nn.functional.silu)
    act.set_alpha(0.3)
    with pytest.raises(OverRepError, match="alpha=0.3"):
        act.require_identity("a test module")
    assert issubclass(MergeRefused, OverRepError)


# ---- 4. a full disk: one line, nothing partial ----------------------------------------
@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` (needs root and mount); skips the test otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (the injected full-disk tests still run)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(fs: Path, leave_bytes: int) -> Path:
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    filler = fs / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
    return filler


def test_full_disk_under_the_output_folder(assets, tmp_path, capsys):
    with small_filesystem(tmp_path / "fs", "5m") as fs:
        out = fs / "run"
        cfg = tmp_path / "cfg.yaml"
        c = tiny_cfg(assets, out, recovery__steps=2, **QUIET)
        c.cache.dir = str(tmp_path / "cache")  # the cache lives elsewhere; the output disk is full
        c.save(cfg)
        filler = fill(fs, 16 * 1024)  # room for config and plan, not for a checkpoint
        code, err = run_cli(capsys, "run", "--config", str(cfg), "--quiet")
        assert code == 2 and "no space left on device" in err, err
        assert not out.exists() and not leftovers(out)  # nothing resumable existed: nothing left
        filler.unlink()
        code, err = run_cli(capsys, "run", "--config", str(cfg), "--quiet")
        assert code == 0, err


def test_full_disk_during_export_leaves_no_partial_folder(assets, tmp_path, monkeypatch):
    """Injected: the serialiser fails half-way with its own exception type (not OSError)."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def half_written(self, path, *a, **k):
        Path(path, "model.safetensors").write_bytes(b"\0" * 1000)
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    out = tmp_path / "run"
    monkeypatch.setattr("overrep.atomic._disk_is_full", lambda p: True)
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", half_written)
    with pytest.raises(OverRepError, match="no space left on device while writing the model folder"):
        Pipeline(tiny_cfg(assets, out, recovery__steps=2, **QUIET), progress=False).run()
    assert not (out / "model").exists() and not (out / "metrics.json").exists() and not leftovers(out)
    assert (out / "checkpoints").is_dir()  # the training is kept: `overrep export` finishes it later


def test_full_disk_during_a_checkpoint_leaves_no_temporary_file(assets, tmp_path, monkeypatch):
    """Injected: ``torch.save`` raises RuntimeError (not OSError) on a full disk."""
    import overrep.atomic

    real_save = torch.save

    def failing_save(obj, f, *a, **k):
        if "checkpoint" in str(Path(f).parent):
            Path(f).write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1234 vs 1000")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(overrep.atomic, "_disk_is_full", lambda p: True)
    out = tmp_path / "run"
    with pytest.raises(OverRepError, match="no space left on device while writing checkpoint"):
        Pipeline(tiny_cfg(assets, out, recovery__steps=2, **QUIET), progress=False).run()
    assert not out.exists() and not leftovers(out)


# ---- 6. config values and locations that are not what they should be ------------------
@pytest.mark.parametrize("setting,msg", [
    ("recovery.steps=abc", "recovery.steps' expects an integer"),
    ("recovery.steps=2.5", "recovery.steps' expects an integer"),
    ("recovery.epochs=nan", "finite"),
    ("recovery.lr=nan", "finite"),
    ("recovery.lr=inf", "finite"),
    ("recovery.alpha_linear_ratio=-0.1", "alpha_linear_ratio"),
    ("recovery.betas=[0.9]", "betas"),
    ("output=", "output"),
    ("prune.remove=abc", "cannot parse"),
    ("recovery.checkpoint_every=0", "checkpoint_every"),
    ("eval.precision=fp16", "eval.precision must be one of auto, fp32, bf16"),
])
def test_bad_config_values_fail_in_one_line(assets, tmp_path, capsys, setting, msg):
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out).save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--set", setting, "--quiet")
    assert code == 2 and err.startswith("overrep: error:") and msg in err, err
    assert not out.exists()


def test_empty_output_flag_and_numeric_cache_dir(assets, tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "run").save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--output", "", "--quiet")
    assert code == 2 and "output" in err
    assert RunConfig.load(cfg, ["cache.dir=123"]).cache.dir == "123"


def test_read_only_output_location(assets, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        ro.chmod(0o555)
    try:
        cfg = tmp_path / "cfg.yaml"
        tiny_cfg(assets, ro / "run", recovery__steps=2, **QUIET).save(cfg)
        code, err = run_cli(capsys, "run", "--config", str(cfg), "--quiet")
        assert code == 2 and re.search("read-only file system|permission denied", err), err
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)


# ---- 8. the smaller ones ---------------------------------------------------------------
def test_resume_needs_a_run_to_resume(assets, tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "empty").save(cfg)
    (tmp_path / "empty").mkdir()
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--resume", "--quiet")
    assert code == 2 and "nothing to resume" in err


@pytest.mark.parametrize("flag,setting", [(["--max-steps", "3"], "recovery.steps=5"),
                                          (["--output", "a"], "output=b")])
def test_a_flag_and_a_set_for_the_same_field_conflict(assets, tmp_path, capsys, flag, setting):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "run").save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), *flag, "--set", setting, "--quiet")
    assert code == 2 and "give one" in err


def test_checkpoints_load_without_unpickling_code(assets, tmp_path):
    """Resume uses ``weights_only=True``: a checkpoint carrying arbitrary objects is refused."""
    out = tmp_path / "run"
    cfg = tiny_cfg(assets, out, recovery__steps=4, **QUIET)
    p = Pipeline(cfg, progress=False)
    p.prepare_output()
    p.load()
    p.prune()
    p.build_recovery()
    t = p.make_trainer()
    t.save_checkpoint()
    path = t.latest_checkpoint()
    state = torch.load(path, weights_only=True)
    state["payload"] = Path("/etc")  # not a tensor or plain data
    torch.save(state, path)
    with pytest.raises(OverRepError, match="cannot be read"):
        t.resume()


def test_huge_documents_are_tokenised_piece_by_piece(assets, monkeypatch):
    from transformers import AutoTokenizer

    from overrep.data import text as data

    tok = AutoTokenizer.from_pretrained(assets / "tiny-llama")
    seen = []
    real = type(tok).__call__

    def spy(self, texts, *a, **k):
        seen.extend(len(t) for t in texts)
        return real(self, texts, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", spy)
    huge = ("alpha beta gamma " * 1_500_000).strip()  # ~25 MB, two of them
    rows = data.pack_documents([huge, huge], tok, 32, max_sequences=20, progress=False)
    assert rows.shape == (20, 32)
    assert max(seen) <= data.PIECE_CHARS and sum(seen) < 3 * data.PIECE_CHARS


# ---- a broken model, a folder two runs want, flags that contradict each other --------
def nan_model(assets, tmp_path) -> Path:
    """The tiny model with one NaN in a block every mask here keeps (block 1)."""
    from safetensors.torch import load_file, save_file

    import shutil

    folder = tmp_path / "nan-llama"
    shutil.copytree(assets / "tiny-llama", folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_nan_weight_is_refused_before_anything_is_written(assets, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out, model__source=str(nan_model(assets, tmp_path))).save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--max-steps", "2", "--quiet")
    assert code == 2 and "model.layers.1.mlp.down_proj.weight" in err and "non-finite" in err, err
    assert not out.exists() and not leftovers(out)


def test_a_non_finite_perplexity_is_an_error_not_a_result(assets, tmp_path):
    p = Pipeline(tiny_cfg(assets, tmp_path / "run", eval__latency=False), progress=False)
    p.load(create_output=False)
    p.prune()
    with torch.no_grad():
        p.pruned.lm_head.weight[0, 0] = float("inf")  # tied: the embedding row of token 0 too
    with pytest.raises(OverRepError, match="pruned model's perplexity .* not finite"):
        p.evaluate_model(p.pruned, "pruned")
    assert "pruned_ppl" not in p.metrics


def test_resume_and_overwrite_together_are_refused(assets, tmp_path, capsys):
    out = tmp_path / "run"
    before = finished_run(assets, out)
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out).save(cfg)
    code, err = run_cli(capsys, "run", "--config", str(cfg), "--resume", "--overwrite", "--quiet")
    assert code == 2 and err.startswith("overrep: error: --resume") and "give one" in err
    assert snapshot(out) == before


@pytest.mark.parametrize("args,word", [(["run", "--ratio", "0.2", "--remove", "3"], "not allowed with"),
                                       (["run", "--criterion", "cosine", "--remove", "3"], "--criterion"),
                                       (["eval", "embedded", "--perplexity", "--tasks", "arc_easy"], "--tasks"),
                                       (["eval", "embedded", "--seq-len", "64"], "--seq-len")])
def test_contradictory_flags_get_one_line(capsys, args, word):
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own checks exit directly, in overrep's one-line form
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("overrep: error:") and word in err[0], err


def test_the_output_lock_names_its_holder_and_is_taken_over_when_stale(tmp_path, caplog):
    from overrep.app.runlock import RunLock, lock_path

    folder = tmp_path / "run"
    first, second = RunLock(folder), RunLock(folder)
    first.acquire()
    with pytest.raises(OverRepError, match=rf"in use by another overrep run \(process {os.getpid()}"):
        second.acquire()
    first.release()
    assert not lock_path(folder).exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock_path(folder).write_text(json.dumps({"pid": dead.pid, "host": "x", "started": 0}))  # left by kill -9
    second.acquire()
    assert f"process {dead.pid}" in caplog.text and "no longer running" in caplog.text
    second.release()


def test_two_runs_into_one_folder_leave_one_finished_run(assets, tmp_path):
    """Started together: the second stops at once naming the first; the first finishes intact."""
    import sys
    import time

    out = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out, recovery__steps=4, **QUIET).save(cfg)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "overrep.app.cli", "run", "--config", str(cfg), "--quiet"]
    first = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    lock = out.with_name(f".{out.name}.lock")
    deadline = time.monotonic() + 120
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock.exists(), "the first run never took the folder"
    second = subprocess.run([*cmd, "--set", "recovery.lr=3e-4"], env=env, capture_output=True, text=True)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    err = second.stderr.strip().splitlines()
    assert second.returncode == 2 and f"in use by another overrep run (process {first.pid}" in err[-1], err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["lr"] == 1e-3 and RunConfig.load(out / "config.yaml").recovery.lr == 1e-3
    assert (out / "model" / "model.safetensors").is_file() and not leftovers(out)
