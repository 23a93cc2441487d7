"""A run's evaluation figures of one model, with intervals, and the cache that spares a
repeated run the dense and unrecovered ones.

What one model is scored on (:class:`EvalData`, built once per run by :func:`eval_data`):

* the **validation** rows (perplexity only; the rows every choice reads),
* the **test** rows of the training domains (perplexity overall and per domain),
* the **unseen** corpora (test-only text from other domains),
* the **generation check** (:mod:`overrep.eval.generation`): LAMBADA last-word accuracy and
  distinct-n of greedy continuations of test-document starts.

Scores are kept per document (:class:`overrep.eval.intervals.Scored`), so every perplexity
gets its bootstrap interval and the pruned and recovered models a paired comparison with the
dense one. The dense and the unrecovered model's scores depend only on (model, mask, data,
protocol): :func:`model_figures` caches them under the cache root (``eval/``) keyed by those,
so a second run with the same model, mask and data reads them back.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..core.precision import autocast
from ..errors import OverRepError
from ..memo import digest, memoised, tensor_digest
from ..model.placement import input_device
from ..model.prefix import SharedPrefix
from ..model.runtime import model_fingerprint
from .generation import document_starts, lambada_passages, last_word_accuracy, repetition
from .heldout import row_strata, score_rows
from .intervals import RESAMPLES, Scored, paired_ratio, perplexity_interval

PROTOCOL = "splits-v1: document-level bootstrap (1000, 95%), rows scored alone, fp32 logits"
"""What a cached figure means; changing how figures are computed must change this string."""


@dataclass
class EvalData:
    """Everything a model is scored on in a run (see the module docstring)."""

    test: torch.Tensor
    test_units: torch.Tensor
    validation: torch.Tensor
    validation_units: torch.Tensor
    components: list[dict] | None = None
    unseen: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    lambada: int = 0  # LAMBADA passages (0: no generation check)
    prompts: int = 16
    prompt_tokens: int = 16
    new_tokens: int = 32

    def baseline(self) -> "EvalData":
        """The rows an unrecovered model is scored on by ``eval.unrecovered: test``: test and
        validation, no unseen corpora and no generation check."""
        return replace(self, unseen={}, lambada=0)

    def validation_only(self) -> "EvalData":
        """The validation rows alone (``eval.unrecovered: validation``; ``auto`` where scoring the
        test rows would cut the run's time budget): what the report's recovery check reads."""
        return replace(self.baseline(), test=self.test[:0], test_units=self.test_units[:0])

    def rows_tokens(self) -> int:
        """Tokens of every perplexity row: test, validation and the unseen corpora."""
        return self.test.numel() + self.validation.numel() + sum(rows.numel() for rows, _ in self.unseen.values())

    def fingerprint(self) -> dict:
        return {"test": tensor_digest(self.test), "test_units": tensor_digest(self.test_units),
                "validation": tensor_digest(self.validation),
                "unseen": {k: tensor_digest(v[0]) for k, v in self.unseen.items()},
                "generation": [self.lambada, self.prompts, self.prompt_tokens, self.new_tokens]}


def eval_data(splits, unseen: dict, ev) -> EvalData:
    """The run's :class:`EvalData` from its :class:`~overrep.data.splits.Splits`, unseen rows
    and ``eval`` config section."""
    return EvalData(splits.test, splits.units["test"], splits.validation, splits.units["validation"],
                    splits.info.get("components"), unseen, ev.lambada_passages if ev.generation else 0,
                    ev.generation_prompts, 16, ev.generation_tokens)


def score(model, tokenizer, data: EvalData, *, desc: str = "", progress: bool = False,
          precision: str = "fp32", prefix: SharedPrefix | None = None) -> dict:
    """Per-document scores of ``model`` (savable: tensors and plain values), its forward in
    ``precision`` ("fp32", or "bf16": autocast; logits and sums stay fp32 either way);
    ``prefix``: the first blocks it shares with a model scored before on the same rows, which
    it then does not run again (:mod:`overrep.model.prefix`; the same figures)."""
    with autocast(precision, input_device(model)):
        return _score(model, tokenizer, data, desc, progress, prefix)


def _score(model, tokenizer, data: EvalData, desc: str, progress: bool, prefix: SharedPrefix | None) -> dict:
    t0 = time.perf_counter()
    out = {}
    if data.test.shape[0]:  # (none: EvalData.validation_only)
        strata, _ = row_strata(data.components, "test_rows", data.test.shape[0])
        out["test"] = score_rows(model, data.test, data.test_units, strata, desc=f"test {desc}",
                                 progress=progress, prefix=prefix).to_state()
    if data.validation.shape[0]:
        vstrata, _ = row_strata(data.components, "validation_rows", data.validation.shape[0])
        out["validation"] = score_rows(model, data.validation, data.validation_units, vstrata,
                                       desc=f"validation {desc}", progress=progress, prefix=prefix).to_state()
    out["unseen"] = {name: score_rows(model, rows, units, desc=f"{name} {desc}", progress=progress,
                                      prefix=prefix).to_state()
                     for name, (rows, units) in data.unseen.items()}
    # the rows a later model of the run scores from the shared prefix (recovery.run_limit's prediction)
    out["seconds_rows"] = time.perf_counter() - t0
    if data.lambada:
        prompts = document_starts(data.test, data.test_units, data.prompts, data.prompt_tokens)
        out["generation"] = {"lambada_last_word": last_word_accuracy(model, tokenizer, lambada_passages(data.lambada)),
                             **repetition(model, tokenizer, prompts, data.new_tokens)}
    return out


def model_figures(model, tokenizer, data: EvalData, *, tag: str, source: str, mask: dict | None,
                  root: Path | None, dense: dict | None = None, progress: bool = False,
                  precision: str = "fp32", prefix: SharedPrefix | None = None,
                  shipped: Callable[[], dict | None] | None = None) -> tuple[dict, dict, bool]:
    """``(metrics entries, scores, scored_here)`` of one model; scores are read from / written to ``root``
    (``None``: never cached, e.g. a recovered model) keyed by model, mask, data, precision and
    protocol. Models paired with ``dense`` should be scored in the dense scores' precision.
    ``prefix``: see :func:`score`.

    Metrics entries: ``{tag}_ppl`` (test perplexity), ``{tag}_ppl_domains`` (per test domain
    and unseen corpus), ``{tag}_perplexity`` (``validation`` and ``test`` as ``{value, low,
    high, tokens, documents}``, ``domains``, ``unseen`` and, given the dense scores,
    ``test_vs_dense``: the paired ratio and difference, ``domains_vs_dense`` and ``unseen_vs_dense``:
    the paired ratio per test domain and unseen corpus) and ``{tag}_generation``. Scores carry
    ``seconds``, what computing them cost, and ``seconds_rows``, the part spent on the
    perplexity rows, which a model sharing the first blocks scores from them (both read back
    with a cached entry; absent from entries older than those fields). ``shipped``: where
    ``root`` has no entry, what gives the scores without scoring every row, or None (the
    package's entry checked on a few rows, :func:`overrep.eval.reference.shipped_scores`),
    called before any row is scored; such scores carry ``reference``. ``scored_here``: whether
    this call scored the rows (so that ``seconds`` timed this machine now), not read them back
    from ``root`` or the package.
    """
    def compute() -> dict:
        if shipped is not None and (got := shipped()) is not None:
            return got
        t0 = time.perf_counter()
        scores = score(model, tokenizer, data, desc=tag, progress=progress, precision=precision, prefix=prefix)
        scores["seconds"] = time.perf_counter() - t0  # what scoring cost, kept with a cached entry
        return scores

    if root is None:  # (nothing shipped is read for a model never cached)
        shipped = None
        scores, found = compute(), False
    else:
        path = figures_path(model, data, tag=tag, source=source, mask=mask, root=root, precision=precision)
        scores, found = memoised(path, compute, f"{tag} evaluation")
    scored_here = not found and "reference" not in scores
    test = Scored.from_state(scores["test"]) if "test" in scores else None
    _, names = row_strata(data.components, "test_rows", data.test.shape[0]) if test is not None else (None, [])
    validation = scores.get("validation")
    fig = {"test": perplexity_interval(test) if test is not None else None,
           "validation": perplexity_interval(Scored.from_state(validation)) if validation is not None else None,
           "domains": {n: perplexity_interval(test.select(i)) for i, n in enumerate(names)},
           "unseen": {n: perplexity_interval(Scored.from_state(s)) for n, s in scores["unseen"].items()}}
    if dense is not None and test is not None:
        dense_test = Scored.from_state(dense["test"])
        fig["test_vs_dense"] = paired_ratio(test, dense_test)
        fig["domains_vs_dense"] = {n: paired_ratio(test.select(i), dense_test.select(i))["ratio"]
                                   for i, n in enumerate(names)}
        fig["unseen_vs_dense"] = {n: paired_ratio(Scored.from_state(s), Scored.from_state(dense["unseen"][n]))["ratio"]
                                  for n, s in scores["unseen"].items() if n in dense.get("unseen", {})}
    require_finite(fig, tag)
    out = {f"{tag}_ppl": fig["test"]["value"] if test is not None else None, f"{tag}_perplexity": fig}
    if fig["domains"] or fig["unseen"]:
        out[f"{tag}_ppl_domains"] = {n: f["value"] for n, f in {**fig["domains"], **fig["unseen"]}.items()}
    if "generation" in scores:
        out[f"{tag}_generation"] = scores["generation"]
    return out, scores, scored_here


def figures_path(model, data: EvalData, *, tag: str, source: str, mask: dict | None, root: Path,
                 precision: str = "fp32", portable: bool = False) -> Path:
    """Where :func:`model_figures` caches ``model``'s scores on ``data`` under ``root``
    (``portable``: the model keyed without the folder it was loaded from, :func:`model_fingerprint`)."""
    key = {"model": model_fingerprint(model, source, portable), "mask": mask, "dtype": str(model.dtype),
           "precision": precision, "data": data.fingerprint(), "protocol": PROTOCOL, "resamples": RESAMPLES}
    return Path(root) / "eval" / f"{tag}-{digest(key)}.pt"


def require_finite(fig: dict, tag: str) -> None:
    """A one-line error when any perplexity of ``fig`` is NaN or infinite: a run never
    finishes with a NaN in its figures."""
    named = [("test rows", fig["test"]), ("validation rows", fig["validation"]), *fig["domains"].items(),
             *fig["unseen"].items()]
    for name, f in named:
        if f is not None and not math.isfinite(f["value"]):
            raise OverRepError(f"the {tag} model's perplexity on {name} is {f['value']}: its outputs are not finite")


def model_benchmarks(model, tokenizer, *, tasks, limit, output: Path, source: str, mask: dict | None,
                     root: Path | None, progress: bool = False) -> dict:
    """:func:`overrep.eval.lmeval.evaluate_benchmarks` of one model, written to ``output``;
    read back from ``root`` (``None``: never cached) when the same model, mask, tasks, limit
    and library versions were scored before (``results["seconds"]``: what scoring them cost)."""
    import json

    from .harness import library_versions
    from .lmeval import evaluate_benchmarks, write_results

    def compute() -> dict:
        return {"json": json.dumps(evaluate_benchmarks(model, tokenizer, tasks=tasks, limit=limit, output=output,
                                                       progress=progress))}

    if root is None:
        return json.loads(compute()["json"])
    key = {"model": model_fingerprint(model, source), "mask": mask, "dtype": str(model.dtype), "tasks": tasks,
           "limit": limit, "versions": library_versions()}
    results = json.loads(memoised(Path(root) / "eval" / f"benchmarks-{digest(key)}.pt", compute, "benchmarks")[0]["json"])
    if not Path(output).is_file():  # read back from the cache: the run folder still gets its file
        write_results(output, {**results, "output": str(output)})
    return results
