"""lm-eval's own CoQA prompt, target and scoring functions, importable under transformers 5.

``lm_eval/tasks/coqa/utils.py`` imports a transformers module removed in transformers 5;
:mod:`overrep.eval.tasks.squad_metrics` stands in for it, and the functions below are
lm-eval's, unchanged. The offline ``coqa_local`` task points its ``!function`` fields here.
"""

from ..tasks import squad_metrics

squad_metrics.install()

from lm_eval.tasks.coqa.utils import doc_to_target, doc_to_text, process_results  # noqa: E402

__all__ = ["doc_to_text", "doc_to_target", "process_results"]
