"""The training benchmark script runs end to end on a tiny model and reports sane figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from overrep.core.precision import resolve_precision
from tiny import make_tiny_model_dir

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_training.py"
WORDS = "alpha beta gamma delta river mountain city music science history language animal planet ocean".split()


def _docs(n: int = 200) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [f"Document {d}. " + " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (30,), generator=g).tolist())
            for d in range(n)]


def _numbers(obj, where=""):
    """(path, value) of every number in ``obj`` (bools excluded)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{where}.{k}")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield where, obj


def test_bench_script_tiny(tmp_path):
    docs = _docs()
    model = make_tiny_model_dir(tmp_path / "tiny-llama", docs)
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(model), "--data", str(data), "--remove", "2-3",
           "--steps", "1", "--warmup", "0", "--batch", "2", "--seq-len", "16", "--threads", "1",
           "--json-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # a loaded 2-core machine took over 120 s
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report

    s = report["settings"]
    assert s["removed_layers"] == [2, 3] and s["batch"] == 2 and s["seq_len"] == 16 and s["steps"] == 1
    assert s["threads"] == 1 and s["torch"] == torch.__version__ and s["cpu"]
    assert set(report["cases"]) == {"overrep_cached", "overrep_live", "plain_cached", "full_backprop"}
    # the interleaved variants: both precisions, both alpha phases, folded and reference linear phase
    v = report["variants"]
    assert set(v) == {"plain_fp32", "plain_bf16", "overrep_fp32", "overrep_bf16", "overrep_fp32_linear_ref",
                      "overrep_fp32_linear", "overrep_bf16_linear", "narrow_bf16", "narrow_bf16_linear"}
    assert v["narrow_bf16"]["preset"] == "hybrid-narrow"
    assert all(x["seconds_per_step_median"] > 0 and x["tokens_per_second"] > 0 for x in v.values())
    assert 0 < v["overrep_bf16"]["alpha"] < 1 and "alpha" not in v["overrep_bf16_linear"]
    assert v["overrep_fp32_linear"]["folded_linear_forward"] and not v["overrep_fp32_linear_ref"]["folded_linear_forward"]
    r = report["variant_ratios"]
    for key in ("overrep_vs_plain_step_time_fp32", "overrep_vs_plain_step_time_bf16",
                "overrep_schedule_vs_plain_step_time_bf16", "overrep_bf16_vs_plain_fp32_step_time",
                "overrep_bf16_schedule_tokens_per_second_vs_fp32_today", "overrep_fp32_linear_fold_speedup",
                "narrow_schedule_vs_plain_step_time_bf16"):
        assert key in r, key
    assert "torch_compile" in report and s["precision"] == resolve_precision("auto", "cpu")  # the default
    # the whole-model methods in both precisions, side by side
    w = report["whole_model"]
    for method in ("lora-iso", "overrep-kd"):
        assert w[f"{method}_fp32"]["seconds_per_step_median"] > 0 and w[f"{method}_bf16"]["tokens_per_second"] > 0
        assert w[f"{method}_bf16_speedup"] > 0
    for case in report["cases"].values():
        for key in ("seconds_per_step", "tokens_per_second", "peak_rss_mb", "flops_per_step",
                    "achieved_flops_per_second", "trainable_params"):
            assert key in case, key
    for key in ("cache_build_tokens_per_second", "matmul_flops_per_second", "overrep_flops_fraction_of_matmul",
                "overrep_vs_plain_step_time", "full_backprop_vs_overrep_step_time", "live_vs_cached_step_time"):
        assert key in report, key

    figures = [(k, v) for k, v in _numbers(report) if not k.startswith(".settings")]
    assert len(figures) > 30
    for key, value in figures:
        assert math.isfinite(value) and value > 0, (key, value)
    # W and D add parameters to the same blocks; every block of the pruned model is more still
    c = report["cases"]
    assert c["plain_cached"]["trainable_params"] < c["overrep_cached"]["trainable_params"]
    assert c["plain_cached"]["trainable_params"] < c["full_backprop"]["trainable_params"]
    assert 0 < c["overrep_cached"]["alpha"] < 1 and "alpha" not in c["plain_cached"]


def test_feature_bench_reports_both_precisions(tmp_path):
    """benchmarks/bench_features.py times the teacher in fp32 and bf16 on the same rows and
    says how far apart their features are, and does the same for the closed-form fit."""
    model = make_tiny_model_dir(tmp_path / "tiny-llama", _docs())
    script = SCRIPT.parent / "bench_features.py"
    done = subprocess.run([sys.executable, str(script), "--model", str(model), "--rows", "8", "--remove", "2-3",
                           "--repeats", "1", "--threads", "1", "--fit-rows", "4"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert set(out["cases"]) == {"fp32", "bf16"} and out["speedup_bf16"] > 0
    assert all(c["rows_per_second"] > 0 for c in out["cases"].values())
    fit = out["fit"]  # the closed-form fit in both precisions: the bf16 map near the fp32 one, not equal to it
    assert fit["rows"] == 4 and all(s > 0 for s in fit["seconds"].values())
    assert 0 < fit["bf16_map_relative_difference"] < 0.1
    for k in ("inputs", "targets"):
        err = out[f"bf16_relative_error_{k}"]
        assert 0 < err["median"] <= err["p99"] < 0.1, (k, err)


def test_the_gpu_check_knows_each_board_by_its_name():
    """The GPU check's share of peak rests on the board's name: the H100 SXM reports itself as
    "H100 80GB HBM3" (no "SXM"), the PCIe card as "H100 PCIe"; an unknown board has no peak."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == gpu_check.peak_flops("NVIDIA H200") == 989e12
    assert gpu_check.peak_flops("NVIDIA H100 PCIe") == 756e12 and gpu_check.peak_flops("NVIDIA H100 NVL") == 835e12
    assert gpu_check.peak_flops("NVIDIA L40S") == 362e12 and gpu_check.peak_flops("Some Future GPU") is None


def test_next_token_loss_bench_times_both_ways_and_they_agree(tmp_path):
    """benchmarks/bench_next_token_loss.py times the tail's and the whole model's next-token loss
    with the logits materialised and fused, on the same rows, and the two agree."""
    model = make_tiny_model_dir(tmp_path / "tiny-llama", _docs())
    script = SCRIPT.parent / "bench_next_token_loss.py"
    done = subprocess.run([sys.executable, str(script), "--model", str(model), "--remove", "2-3", "--batch", "2",
                           "--repeats", "2", "--threads", "1", "--precision", "fp32", "--chunk-logits", "1000", "--lora-rank", "4"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert set(out["cases"]) == {"tail", "whole_model", "lora"} and out["precision"] == "fp32" and out["chunk_logits"] == 1000
    for case in out["cases"].values():
        assert all(case[k]["steps"] == 2 and 0 < case[k]["min"] <= case[k]["median"] <= case[k]["max"]
                   for k in ("plain", "fused"))
        assert case["plain_over_fused"] > 0
        assert case["relative_difference"]["loss"] < 1e-5 and case["relative_difference"]["gradient"] < 1e-4
    assert out["cases"]["whole_model"]["fused_used"] and out["cases"]["lora"]["fused_used"]
    tail = out["cases"]["tail"]  # the tail alone is timed too: the head's share of a ce step
    assert tail["no_head"]["steps"] == 2 and tail["head_share"] == 1 - tail["no_head"]["median"] / tail["fused"]["median"]
    assert "no_head" not in out["cases"]["lora"] and "head_share" not in out["cases"]["whole_model"]


def test_the_probe_bench_times_the_probe_and_the_run_in_one_process(assets, tmp_path):
    """benchmarks/bench_probe.py: the probe's steps (as many as asked), the run's own first-phase
    steps, a second probe and the two trainers interleaved, each against the run's median."""
    sets = [f"model.source={assets / 'tiny-llama'}", "prune.remove=3-4", f"data.source={assets / 'corpus.jsonl'}",
            "data.seq_len=32", "data.train_sequences=24", "data.heldout_sequences=4", "data.validation_sequences=4",
            f"cache.dir={tmp_path / 'cache'}", "recovery.time_budget=30s", "recovery.batch_size=4",
            "recovery.warm_start=none"]
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, str(SCRIPT.parent / "bench_probe.py"), "--probe-steps", "3", "--run-steps",
                           "8", "--interleave", "3", "--json-out", str(out), *(a for s in sets for a in ("--set", s))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert json.loads(out.read_text()) == got and got["cpu"]
    assert 3 <= len(got["run_steps"]) <= 8 and got["run_median_2_21"] > 0
    for name in ("probe", "probe_again"):
        assert len(got[name]["timed"]) == 3 and got[name]["fastest_x_run"] > 0, name
    side = got["interleaved"]
    assert len(side["probe"]) == len(side["run"]) == 3 and side["probe_median_x_run_median"] > 0
