"""The pipeline and CLI end to end on a tiny model (seconds), and on the real embedded model (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from overrep.app.cli import main
from overrep.app.config import RunConfig
from overrep.errors import OverRepError
from overrep.core.precision import resolve_precision
from overrep.app.pipeline import Pipeline
from overrep.recovery.objectives import Layerwise

from tiny import run_killed_at, tiny_cfg

def test_run_end_to_end(assets, tmp_path):
    out = tmp_path / "run"
    m = Pipeline(tiny_cfg(assets, out), progress=False).run()
    saved = json.loads((out / "metrics.json").read_text())
    for key in ("dense_ppl", "pruned_ppl", "recovered_ppl", "merge_max_abs_diff", "removed_layers",
                "num_layers_before", "num_layers_after", "trainable_params", "train_seconds",
                "train_tokens_per_second"):
        assert saved[key] is not None, key
    assert saved["removed_layers"] == [3, 4] and saved["num_layers_after"] == 4
    assert saved["merge_max_abs_diff"] <= 1e-4
    assert saved["recovered_params"] == saved["pruned_params"] < saved["dense_params"]
    assert m["train_steps"] == 8 and m["train_tokens"] == 8 * 4 * 32
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.config.num_hidden_layers == 4
    assert (out / "model" / "overrep.json").is_file() and (out / "model" / "tokenizer.json").is_file()
    ids = torch.tensor([[1, 2, 3]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)
    assert (out / "report.md").read_text().count("perplexity") >= 1
    assert (out / "plots" / "training.png").stat().st_size > 1000
    assert set(saved["recovered_ppl_domains"]) == {"lambada", "sciq"}  # unseen domains, by default
    assert "| lambada |" in (out / "report.md").read_text()
    assert RunConfig.load(out / "config.yaml").to_dict() == tiny_cfg(assets, out).to_dict()
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 8
    shared = saved["cpu_shared"]  # what the rest of the machine took while it recovered (runinfo.CpuMeter)
    assert shared["cpus"] >= 1 and 0 <= shared["others_share"] <= 1 and 0 <= shared["steal_share"] <= 1
    line = [ln for ln in (out / "report.md").read_text().splitlines() if "while the run recovered" in ln]
    assert len(line) == 1 and "other processes" in line[0]  # idle or shared (a parallel test worker is "others")
    check = saved["recovery_check"]  # recovered against no recovery, on validation
    assert check["split"] == "validation" and check["worse_than_unrecovered"] == (check["recovered"] > check["unrecovered"])


def test_a_recovery_worse_than_none_is_said_loudly(caplog):
    from overrep.app.report import _check_lines, recovery_check

    # the figures of a real failure (docs/losses.md, "Attention sinks")
    m = {"recovered_perplexity": {"validation": {"value": 3799.5}, "test": {"value": 4073.5}},
         "pruned_perplexity": {"validation": {"value": 491.9}, "test": {"value": 510.4}}}
    check = recovery_check(m)
    assert check == {"split": "validation", "recovered": 3799.5, "unrecovered": 491.9, "worse_than_unrecovered": True}
    assert "recovery failed" in caplog.text and "The recovery failed" in _check_lines(check)[0]
    m["recovered_perplexity"]["validation"]["value"] = 77.5
    assert not recovery_check(m)["worse_than_unrecovered"] and _check_lines(recovery_check(m)) == []
    assert recovery_check({}) == {}


def _weights(out: Path) -> dict:
    return load_file(out / "model" / "model.safetensors")


def test_resume_after_a_kill_reaches_the_same_weights(assets, tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    Pipeline(tiny_cfg(assets, ref, eval__perplexity=False, eval__latency=False), progress=False).run()

    out = tmp_path / "killed"
    cfg = tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False)
    run_killed_at(monkeypatch, cfg, 5)  # no graceful checkpoint: the last one is step 4
    assert not (out / "metrics.json").exists() and not (out / "model").exists()
    assert sorted(p.name for p in (out / "checkpoints").glob("*.pt")) == ["step-000002.pt", "step-000004.pt"]
    with pytest.raises(OverRepError, match="unfinished run"):
        Pipeline(cfg, progress=False).run()
    Pipeline(cfg, resume=True, progress=False).run()
    a, b = _weights(ref), _weights(out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k


def test_live_teacher_trains_like_the_cache(assets, tmp_path):
    kw = dict(eval__perplexity=False, eval__latency=False)
    Pipeline(tiny_cfg(assets, tmp_path / "disk", **kw), progress=False).run()
    Pipeline(tiny_cfg(assets, tmp_path / "live", cache__mode="live", **kw), progress=False).run()
    a, b = _weights(tmp_path / "disk"), _weights(tmp_path / "live")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), k


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_checkpoint(assets, tmp_path, monkeypatch):
    original = Layerwise.loss
    calls = []

    def nan_at_step_3(self, idx):  # one call per step (no accumulation): the 4th call is step 3
        calls.append(idx)
        loss = original(self, idx)
        return loss * float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(Layerwise, "loss", nan_at_step_3)
    out = tmp_path / "nan"
    with pytest.raises(OverRepError, match="loss became nan at step 3.*step-000002.pt"):
        Pipeline(tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False), progress=False).run()
    assert not (out / "metrics.json").exists() and not (out / "model").exists()


def test_finished_output_is_not_overwritten_silently(assets, tmp_path):
    cfg = tiny_cfg(assets, tmp_path / "done", eval__perplexity=False, eval__latency=False, recovery__steps=2)
    Pipeline(cfg, progress=False).run()
    with pytest.raises(OverRepError, match="finished run"):
        Pipeline(cfg, progress=False).run()
    Pipeline(cfg, overwrite=True, progress=False).run()


def test_corrupt_cache_is_rebuilt_or_refused(assets, tmp_path):
    kw = dict(eval__perplexity=False, eval__latency=False, recovery__steps=2)
    p = Pipeline(tiny_cfg(assets, tmp_path / "a", **kw), progress=False)
    p.run()
    shard = next(Path(p.metrics["cache"]["path"]).glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(OverRepError, match="corrupt|sha256|differs"):
        Pipeline(tiny_cfg(assets, tmp_path / "b", cache__rebuild="never", **kw), progress=False).run()
    Pipeline(tiny_cfg(assets, tmp_path / "c", **kw), progress=False).run()  # auto: rebuilt


def cli(*args) -> int:
    return main(list(args))


@pytest.mark.parametrize("extra,msg", [
    (["--model", "/no/such/model"], "does not exist"),
    (["--ratio", "1.5"], "between 0 and 1"),
    (["--ratio", "0.999"], "leaving none|removes"),
    (["--remove", "40-45"], "out of range"),
    (["--remove", "0-5"], "leaves no block"),
    (["--set", "recovery.nope=1"], "unknown config field"),
    (["--set", "data.source=hf:HuggingFaceFW/fineweb-edu:sample-10BT"], "hub"),
    (["--config", "/no/such.yaml"], "does not exist"),
    (["--set", "model.device=cuda:99"], "CUDA is not available|has [0-9]+ GPU"),
])
def test_cli_bad_inputs_fail_in_one_line(assets, tmp_path, capsys, extra, msg, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "bad"
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, out).save(cfg)
    code = cli("run", "--config", str(cfg), "--quiet", *extra) if "--config" not in extra else cli(
        "run", "--quiet", *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("overrep: error:") and __import__("re").search(msg, err[-1]), err[-1]
    assert not out.exists()  # nothing left behind: the corrected command can use the same folder


def test_cli_run_and_inspect(assets, tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "cli", recovery__steps=2).save(cfg)
    assert cli("run", "--config", str(cfg), "--quiet", "--max-steps", "2") == 0
    assert json.loads((tmp_path / "cli" / "metrics.json").read_text())["train_steps"] == 2
    capsys.readouterr()
    assert cli("inspect", "--config", str(cfg), "--remove", "2-3") == 0
    acc = json.loads(capsys.readouterr().out)
    assert acc["removed_layers"] == [2, 3] and acc["trainable_params"] > 0
    assert cli("prune", "--config", str(cfg), "--remove", "1,3", "--output", str(tmp_path / "pr"), "--quiet") == 0
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "pr" / "pruned-model")
    assert pruned.config.num_hidden_layers == 4


@pytest.mark.slow
def test_real_embedded_model_few_steps(tmp_path):
    """The default model and corpus, a few steps: loads, prunes 25%, recovers, exports."""
    cfg = RunConfig.load(overrides={
        "recovery": {"steps": 12, "batch_size": 4, "checkpoint_every": 12, "eval_every": 12},
        "prune": {"criterion": "last"},  # the paper's mask: block 17 alone learns the run (final_block off)
        "data": {"seq_len": 64, "train_sequences": 16, "heldout_sequences": 4, "validation_sequences": 4},
        "cache": {"dir": str(tmp_path / "cache")},
        "eval": {"latency": False, "domain_sequences": 4, "lambada_passages": 16, "generation_prompts": 4},
        "output": str(tmp_path / "out")})
    m = Pipeline(cfg, progress=False).run()
    assert m["num_layers_before"] == 30 and m["removed_layers"] == list(range(18, 29))
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert [g["module_layers"] for g in plan["groups"]] == [[17]]
    # the fold is exact to fp32 rounding; the logits' scale (no final norm between the module and
    # block 29's massive activations) makes the absolute difference 1e-2, the relative one 1e-6
    assert m["merge_max_rel_diff"] <= 1e-5
    assert m["dense_ppl"] < 100 < m["pruned_ppl"]
    assert m["recovered_ppl"] < m["pruned_ppl"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert model.config.num_hidden_layers == 19


def test_cli_cache_then_export_from_checkpoints(assets, tmp_path, capsys):
    import shutil
    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "st", recovery__steps=2).save(cfg)
    assert cli("cache", "--config", str(cfg), "--quiet") == 0
    assert json.loads(capsys.readouterr().out)["bytes"] > 0
    assert cli("recover", "--config", str(cfg), "--quiet", "--overwrite") == 0
    before = _weights(tmp_path / "st")
    shutil.rmtree(tmp_path / "st" / "model")
    (tmp_path / "st" / "metrics.json").unlink()
    assert cli("export", str(tmp_path / "st"), "--quiet") == 0
    after = _weights(tmp_path / "st")
    for k in before:
        assert torch.allclose(before[k], after[k], atol=1e-6, rtol=0), k


def test_benchmarks_inside_the_run_report(assets, tmp_path, caplog):
    cfg = tiny_cfg(assets, tmp_path / "bench", eval__latency=False, recovery__steps=2,
                   eval__benchmarks="arc_easy,winogrande", eval__benchmark_limit=2)
    m = Pipeline(cfg, progress=False).run()
    assert set(m["benchmarks"]) == {"dense", "pruned", "recovered"}
    assert set(m["benchmarks"]["dense"]) == {"arc_easy", "winogrande"}
    assert set(m["retained_performance"]) == {"pruned", "recovered"}
    assert (tmp_path / "bench" / "benchmarks" / "recovered.json").is_file()
    report = (tmp_path / "bench" / "report.md").read_text()
    assert "## Benchmarks" in report and "| arc_easy |" in report
    # the dense and unrecovered results are cached: a second run reads them back (and still writes its files)
    caplog.set_level("INFO", logger="overrep.memo")
    again = Pipeline(tiny_cfg(assets, tmp_path / "again", eval__latency=False, recovery__steps=2,
                              eval__benchmarks="arc_easy,winogrande", eval__benchmark_limit=2), progress=False).run()
    assert sum("benchmarks: reusing" in r.getMessage() for r in caplog.records) == 2
    assert again["benchmarks"]["dense"] == m["benchmarks"]["dense"]
    assert (tmp_path / "again" / "benchmarks" / "dense.json").is_file()


def test_a_run_default_module_ends_before_the_final_block(assets, tmp_path):
    """recovery.final_block: false (the default) on the paper's mask trains block 1 alone, and the
    parameter account (which sizes lora-iso) counts that module."""
    from overrep.model.accounting import recovery_account

    assert RunConfig().recovery.final_block is False
    m = Pipeline(tiny_cfg(assets, tmp_path / "o", prune__remove="3-4", recovery__final_block=False,
                          eval__perplexity=False, eval__latency=False), progress=False).run()
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert [g["module_layers"] for g in plan["groups"]] == [[2]] and m["train_steps"] > 0
    paper = Pipeline(tiny_cfg(assets, tmp_path / "p", prune__remove="3-4", recovery__final_block=True,
                              eval__perplexity=False, eval__latency=False), progress=False).run()
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert [g["module_layers"] for g in plan["groups"]] == [[2, 5]]
    assert paper["trainable_params"] > m["trainable_params"]
    config = str(assets / "tiny-llama")
    assert recovery_account(config, [3, 4], final_block=False)["trainable_params"] == m["trainable_params"]
    assert recovery_account(config, [3, 4])["trainable_params"] == paper["trainable_params"]


def test_the_unrecovered_model_gets_every_figure_with_eval_unrecovered_all(assets, tmp_path):
    m = Pipeline(tiny_cfg(assets, tmp_path / "run", eval__latency=False, eval__unrecovered="all"),
                 progress=False).run()
    assert set(m["pruned_perplexity"]["unseen"]) == {"lambada", "sciq"} and "lambada_last_word" in m["pruned_generation"]


def test_metrics_carry_validation_and_test_intervals_and_three_fingerprints(assets, tmp_path, caplog):
    out = tmp_path / "run"
    Pipeline(tiny_cfg(assets, out, eval__latency=False), progress=False).run()
    m = json.loads((out / "metrics.json").read_text())
    for tag in ("dense", "pruned", "recovered"):
        fig = m[f"{tag}_perplexity"]
        for split in ("validation", "test"):
            f = fig[split]
            assert f["low"] <= f["value"] <= f["high"] and f["tokens"] > 0, (tag, split)
        assert fig["test"]["value"] == m[f"{tag}_ppl"]
        if tag == "pruned":  # eval.unrecovered: test -- the baseline on test and validation rows only
            assert fig["unseen"] == {} and "pruned_generation" not in m
            continue
        assert set(fig["unseen"]) == {"lambada", "sciq"}
        gen = m[f"{tag}_generation"]
        assert 0 <= gen["lambada_last_word"]["value"] <= 1 and gen["lambada_last_word"]["n"] == 8
        assert 0 < gen["distinct_2"] <= 1
    pair = m["recovered_perplexity"]["test_vs_dense"]["ratio"]
    assert pair["low"] <= pair["value"] <= pair["high"]
    assert pair["value"] == pytest.approx(m["recovered_ppl"] / m["dense_ppl"])
    rec = m["recovered_perplexity"]  # per domain and unseen corpus: paired with the dense model too
    for where in ("domains", "unseen"):
        for n, r in rec[f"{where}_vs_dense"].items():
            assert r["low"] <= r["value"] <= r["high"], (where, n)
            assert r["value"] == pytest.approx(rec[where][n]["value"] / m["dense_perplexity"][where][n]["value"])
    assert set(rec["unseen_vs_dense"]) == {"lambada", "sciq"} and set(rec["domains_vs_dense"]) == set(rec["domains"])
    assert m["pruned_perplexity"]["unseen_vs_dense"] == {}  # scored on no unseen corpus
    fps = [m["data"][f"{k}_fingerprint"] for k in ("train", "validation", "test")]
    assert len(set(fps)) == 3
    assert "[" in (out / "report.md").read_text()  # intervals in the report
    assert m["eval_precision"] == resolve_precision("auto", "cpu")  # eval.precision: auto
    # a second run with the same model, mask and data reads the dense and unrecovered figures back
    caplog.set_level("INFO", logger="overrep.memo")
    again = Pipeline(tiny_cfg(assets, tmp_path / "again", eval__latency=False), progress=False).run()
    reused = {r.getMessage().split(":")[0] for r in caplog.records if "reusing" in r.getMessage()}
    assert {"dense evaluation", "pruned evaluation"} <= reused
    assert again["dense_perplexity"] == m["dense_perplexity"] and again["pruned_ppl"] == m["pruned_ppl"]
    assert len(list((tmp_path / "cache" / "eval").glob("*.pt"))) == 2  # a recovered model's are never cached


def test_training_never_reads_the_test_rows(assets, tmp_path):
    """Poison the test rows with token ids outside the vocabulary: any forward pass on them
    fails. Recovery (features, training, probes, merge, export) still runs, and ends at the
    same weights as with the real test rows."""
    def stages(out, poison):
        p = Pipeline(tiny_cfg(assets, out, eval__perplexity=False, eval__latency=False), progress=False)
        p.prepare_output()
        p.load()
        if poison:
            p.heldout_ids = torch.full_like(p.heldout_ids, p.dense.config.vocab_size + 7)
            p.eval_data.test = p.heldout_ids
            with pytest.raises(IndexError):  # the poison bites when the rows are read
                p.dense(input_ids=p.heldout_ids[:1])
        p.prune()
        p.build_recovery()
        p.train()
        p.merge()
        p.export()
        return _weights(out)

    clean, poisoned = stages(tmp_path / "clean", False), stages(tmp_path / "poisoned", True)
    for k in clean:
        assert torch.equal(clean[k], poisoned[k]), k


def test_evaluation_sizes_are_checked_before_anything_loads():
    with pytest.raises(OverRepError, match="eval.domain_sequences, lambada_passages"):
        RunConfig.load(overrides={"eval": {"lambada_passages": 0}})
    cfg = RunConfig()
    # the protocol's sizes: >= 48k test tokens, >= 16k per unseen corpus, 32 validation rows
    assert cfg.data.heldout_sequences * cfg.data.seq_len >= 48_000
    assert cfg.eval.domain_sequences * cfg.data.seq_len >= 16_000 and cfg.data.validation_sequences >= 32


def test_scoring_precision_applies_to_every_figure_and_keys_the_cache(assets, tmp_path, caplog):
    """eval.precision: bf16 runs the forward under autocast (the figures move, slightly), fp32
    does not; the cache keeps the two apart, so a dense figure is never paired across precisions."""
    from overrep.eval.figures import model_figures

    p = Pipeline(tiny_cfg(assets, tmp_path / "run"), progress=False)
    p.load(create_output=False)
    caplog.set_level("INFO", logger="overrep.memo")
    figs = {}
    for precision in ("fp32", "bf16", "fp32"):
        found, _, _ = model_figures(p.dense, p.tokenizer, p.eval_data, tag="dense", source="tiny", mask=False,
                                 root=tmp_path / "cache", precision=precision)
        figs.setdefault(precision, found["dense_perplexity"])
    assert len(list((tmp_path / "cache" / "eval").glob("dense-*.pt"))) == 2
    assert sum("reusing" in r.getMessage() for r in caplog.records) == 1  # the second fp32 call
    fp32, bf16 = figs["fp32"], figs["bf16"]
    for split in ("test", "validation"):
        assert bf16[split]["value"] != fp32[split]["value"]  # the autocast is really on
        assert bf16[split]["value"] == pytest.approx(fp32[split]["value"], rel=0.02)
    for name in fp32["unseen"]:
        assert bf16["unseen"][name]["value"] == pytest.approx(fp32["unseen"][name]["value"], rel=0.02)
