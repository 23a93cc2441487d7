"""The benchmark table: one :class:`Benchmark` row per task of the paper's protocol.

The paper (appendix "Implementation Details") evaluates with ``lm-eval-harness``:
**reasoning**, zero-shot (``acc_norm`` for HellaSwag, ARC-Challenge, MathQA, PIQA and
OpenBookQA, ``acc`` for the others) and **generation** (CoQA zero-shot F1, GSM8K 8-shot
and TriviaQA 5-shot exact match). Everything :mod:`overrep.eval.lmeval` and
:mod:`overrep.eval.tasks` know about a benchmark is read from its row here; adding a
benchmark is adding a row (plus, if it has an offline copy, its builder function in
:mod:`overrep.eval.tasks.builders`, which the row names).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..registry import Registry


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: lm-eval's stock task (or group) of the same name, and how the paper scores it."""

    name: str
    """lm-eval's stock task or group name (``arc_easy``, ``mmlu``)."""
    suite: str
    """``reasoning`` or ``generation``."""
    description: str
    metric: str
    """The paper's metric. For ``exact_match`` the best of lm-eval's filters is used (GSM8K:
    strict-match / flexible-extract), as the reference score script does."""
    fewshot: int
    """The paper's few-shot count."""
    hub_data_id: str
    """Identity of the stock task's documents; an offline copy of the same documents carries
    the same id, so results from either are comparable."""
    stock_yaml: str
    """The stock YAML (relative to ``lm_eval/tasks``) that describes the hub data."""
    offline: str | None = None
    """Entry point ``module:function`` that builds the offline copy (a ``LocalTask``) from a
    ``Builder``, or ``None`` when there is none."""
    subtasks: int = 1
    """Leaf tasks of a group (MMLU: 57 subjects); limits are spread over them."""
    dataset_name: str | None = None
    """Overrides the stock YAML's ``dataset_name`` where the YAML is shared (ARC-Challenge)."""

    def offline_builder(self) -> Callable | None:
        if self.offline is None:
            return None
        module, _, function = self.offline.partition(":")
        return getattr(importlib.import_module(module), function)


BENCHMARKS: Registry[Benchmark] = Registry("benchmark")

_OFFLINE = "overrep.eval.tasks.builders:"


def _row(name, suite, description, metric, fewshot, hub_data_id, stock_yaml, **extra) -> None:
    BENCHMARKS.register(Benchmark(name, suite, description, metric, fewshot, hub_data_id, stock_yaml,
                                  offline=extra.pop("offline", _OFFLINE + name), **extra))


_row("arc_easy", "reasoning", "ARC-Easy science questions", "acc", 0, "ai2_arc/ARC-Easy/test", "arc/arc_easy.yaml")
_row("arc_challenge", "reasoning", "ARC-Challenge science questions", "acc_norm", 0, "ai2_arc/ARC-Challenge/test",
     "arc/arc_easy.yaml", dataset_name="ARC-Challenge")
_row("boolq", "reasoning", "BoolQ yes/no questions", "acc", 0, "boolq/validation", "super_glue/boolq/default.yaml")
_row("hellaswag", "reasoning", "HellaSwag sentence completion", "acc_norm", 0, "hellaswag/validation",
     "hellaswag/hellaswag.yaml")
_row("mathqa", "reasoning", "MathQA math word problems", "acc_norm", 0, "math_qa/test", "mathqa/mathqa.yaml")
_row("mmlu", "reasoning", "MMLU, 57 subjects", "acc", 0, "mmlu/test", "mmlu/default/_default_template_yaml",
     subtasks=57)
_row("openbookqa", "reasoning", "OpenBookQA science questions", "acc_norm", 0, "openbookqa/main/test",
     "openbookqa/openbookqa.yaml")
_row("piqa", "reasoning", "PIQA physical commonsense", "acc_norm", 0, "piqa/validation", "piqa/piqa.yaml")
_row("race", "reasoning", "RACE reading comprehension", "acc", 0, "race/high/test", "race/race.yaml")
_row("winogrande", "reasoning", "WinoGrande pronoun resolution", "acc", 0, "winogrande/winogrande_xl/validation",
     "winogrande/default.yaml")
_row("coqa", "generation", "CoQA conversational QA (F1)", "f1", 0, "coqa/validation", "coqa/default.yaml")
_row("gsm8k", "generation", "GSM8K grade-school math (exact match)", "exact_match", 8, "gsm8k/main/test",
     "gsm8k/gsm8k.yaml")
_row("triviaqa", "generation", "TriviaQA open-domain QA (exact match)", "exact_match", 5,
     "trivia_qa/rc.nocontext/validation", "triviaqa/default.yaml")

# Beyond the paper's suites: tasks on which a small model is above chance (docs/evaluation.md).
_row("sciq", "extra", "SciQ science questions with a support paragraph", "acc", 0, "sciq/test", "sciq/sciq.yaml")
_row("lambada_openai", "extra", "LAMBADA last-word prediction (OpenAI version; greedy accuracy)", "acc", 0,
     "lambada_openai/test", "lambada/lambada_openai.yaml")

SUITES: dict[str, list[str]] = {}
for _b in BENCHMARKS.values():
    SUITES.setdefault(_b.suite, []).append(_b.name)
"""The paper's benchmark suites, in table order (``reasoning``, ``generation``), and ``extra``."""

SELECTIONS: dict[str, tuple[list[str], int]] = {
    "rp": (["arc_easy", "hellaswag", "piqa", "sciq", "lambada_openai"], 1200),
}
"""Named task sets across suites, with their default documents per task. ``rp``: the tasks
on which the dense embedded model (SmolLM2-135M) is clearly above chance, at a size whose
standard error is at most 1.5 points (p(1-p)/n <= 0.015^2 needs n >= 1,112 at p = 0.5;
SciQ has 1,000 offline documents, scored all, with p near 0.8) -- measured in
docs/evaluation.md. RP over it is the retained performance the project reports."""
