"""What a run's evaluation costs and how wide its intervals are, part by part, for one model.

    OMP_NUM_THREADS=1 python scripts/eval_cost.py [MODEL [REMOVE]] > cost.json

Builds the default run's evaluation data (``RunConfig()``: data splits, unseen corpora,
generation check) and scores MODEL (default ``embedded``) on each part on one thread,
printing the CPU seconds of the process for each (``time.process_time``: a shared machine
disturbs it far less than wall-clock time) and each figure with its 95% interval. With
REMOVE (blocks, e.g. ``9-19``), the model with those blocks removed (no recovery) is scored
on the test rows too, with its paired ratio to MODEL overall and per domain.
"""

import json
import sys
import time

import torch

from overrep.app.config import RunConfig
from overrep.data.text import token_splits
from overrep.eval.figures import eval_data
from overrep.eval.generation import document_starts, lambada_passages, last_word_accuracy, repetition
from overrep.eval.heldout import row_strata, score_rows, unseen_domain_rows
from overrep.eval.intervals import perplexity_interval
from overrep.model.loading import load_model


def main(model_spec: str = "embedded", remove: str | None = None) -> dict:
    torch.set_num_threads(1)
    cfg = RunConfig.load()
    d, ev = cfg.data, cfg.eval
    model, tok, _ = load_model(model_spec)
    s = token_splits(d.source, tok, seq_len=d.seq_len, train_sequences=d.train_sequences,
                     test_sequences=d.heldout_sequences, validation_sequences=d.validation_sequences, seed=d.seed,
                     progress=False)
    unseen = unseen_domain_rows(ev.domains, tok, training_source=d.source, seq_len=d.seq_len,
                                rows=ev.domain_sequences, seed=d.seed)
    data = eval_data(s, unseen, ev)
    out = {"model": model_spec, "data": {k: v for k, v in s.info.items() if not isinstance(v, (list, dict))}}

    def timed(name, f):
        start = time.process_time()
        result = f()
        out[f"{name}_cpu_seconds"] = time.process_time() - start
        return result

    strata, names = row_strata(data.components, "test_rows", data.test.shape[0])
    test = timed("test", lambda: score_rows(model, data.test, data.test_units, strata))
    out["test"] = perplexity_interval(test)
    out["domains"] = {n: perplexity_interval(test.select(i)) for i, n in enumerate(names)}
    vstrata, _ = row_strata(data.components, "validation_rows", data.validation.shape[0])
    out["validation"] = perplexity_interval(timed("validation", lambda: score_rows(
        model, data.validation, data.validation_units, vstrata)))
    for name, (rows, units) in unseen.items():
        out[name] = perplexity_interval(timed(name, lambda: score_rows(model, rows, units)))
    out["lambada_last_word"] = timed("lambada_last_word", lambda: last_word_accuracy(
        model, tok, lambada_passages(data.lambada)))
    prompts = document_starts(data.test, data.test_units, data.prompts, data.prompt_tokens)
    out["repetition"] = timed("repetition", lambda: repetition(model, tok, prompts, data.new_tokens))
    if remove:
        import copy

        from overrep.eval.intervals import paired_ratio
        from overrep.model.presets import get_preset
        from overrep.model.surgery import parse_layers, prune
        from overrep.model.wrap import plan_recovery

        plan = plan_recovery(model, parse_layers(remove), get_preset("hybrid"), blocks=1)
        pruned = prune(copy.deepcopy(model), plan)
        scored = timed("pruned_test", lambda: score_rows(pruned, data.test, data.test_units, strata))
        out["pruned_test"] = perplexity_interval(scored)
        out["pruned_vs_dense"] = {"all": paired_ratio(scored, test), **{
            n: paired_ratio(scored.select(i), test.select(i)) for i, n in enumerate(names)}}
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:]), indent=1))
