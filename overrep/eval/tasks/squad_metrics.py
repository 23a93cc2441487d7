"""SQuAD 2.0 answer normalisation, exact match and token F1.

lm-eval 0.4.13's CoQA task imports ``transformers.data.metrics.squad_metrics``, a module
that transformers 5 no longer ships. This module provides the four functions that task
uses, with the semantics of the official SQuAD 2.0 evaluation script (which the removed
transformers module reproduced): lower-case, strip punctuation and the articles
a/an/the, collapse whitespace; F1 over the bags of normalised tokens.
:func:`install` registers it under the old import path when transformers lacks it.
"""

from __future__ import annotations

import collections
import re
import string
import sys
import types

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def get_tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def compute_exact(a_gold: str, a_pred: str) -> int:
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    gold, pred = get_tokens(a_gold), get_tokens(a_pred)
    if not gold or not pred:  # a no-answer on either side: 1 if both are empty
        return int(gold == pred)
    same = sum((collections.Counter(gold) & collections.Counter(pred)).values())
    if same == 0:
        return 0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


MODULE = "transformers.data.metrics.squad_metrics"


def install() -> None:
    """Make ``import transformers.data.metrics.squad_metrics`` work (a no-op where it already does)."""
    try:
        __import__(MODULE)
        return
    except ImportError:
        pass
    import transformers.data

    package = sys.modules.get("transformers.data.metrics")
    if package is None:
        package = types.ModuleType("transformers.data.metrics")
        package.__path__ = []  # a package, so the submodule import resolves
        sys.modules["transformers.data.metrics"] = package
        transformers.data.metrics = package
    sys.modules[MODULE] = sys.modules[__name__]
    package.squad_metrics = sys.modules[__name__]
