"""Retained performance (RP), recovery ratio (RR) and strided perplexity.

* **RP** (paper): per suite, the pruned model's average of the paper's metric divided by
  the dense model's, times 100. :func:`retained_performance` takes two benchmark results
  (dicts or files from :func:`overrep.eval.lmeval.evaluate_benchmarks`), averages only over
  benchmarks that both evaluated *on the same footing* -- same documents (``data_id``),
  same few-shot count and source, same number of documents -- and lists every benchmark
  it leaves out, with the reason.
* **RR** = trainable recovery parameters / parameters of the pruned model x 100, from a
  pipeline output's ``metrics.json`` (:func:`recovery_ratio`).
* **Perplexity** with a sliding window (:func:`perplexity`): windows of ``seq_len``
  tokens advance by ``stride``; each token is scored once, by the first window that
  holds it as a prediction target, with the rest of that window as context. With
  ``stride == seq_len`` the windows do not overlap and the result equals
  :func:`overrep.eval.measure.perplexity` on the same rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..errors import OverRepError
from .benchmarks import BENCHMARKS, SUITES
from .results import load_results


# --------------------------------------------------------------------------- RP


def _footing(record: dict) -> tuple:
    """What must match for two results of one benchmark to be comparable."""
    shots = record.get("num_fewshot") or 0
    return (record.get("data_id"), shots, record.get("fewshot_split") if shots else None, record.get("n_samples"))


def _describe_mismatch(p: dict, d: dict) -> str:
    names = ("documents (data_id)", "few-shot count", "few-shot source", "number of documents")
    diffs = [f"{n}: {a!r} vs {b!r}" for n, a, b in zip(names, _footing(p), _footing(d)) if a != b]
    return "not comparable (pruned vs dense " + "; ".join(diffs) + ")"


def retained_performance(pruned_results, dense_results) -> dict:
    """RP per suite: pruned average / dense average x 100 over the benchmarks both evaluated.

    Each benchmark contributes the paper's metric (:attr:`overrep.eval.benchmarks.Benchmark.metric`; the
    value stored in the results). Averages are in points (0-100).

    Returns ``{suite: {"rp", "pruned_average", "dense_average", "tasks": {benchmark:
    {"pruned", "dense", "retained", "metric"}}, "excluded": {benchmark: reason}}}`` for each
    suite with at least one benchmark in either file; ``rp`` is ``None`` when no benchmark
    is comparable (or the dense average is 0).
    """
    pruned, dense = load_results(pruned_results), load_results(dense_results)
    out = {}
    for suite, names in SUITES.items():
        present = [b for b in names if b in pruned["tasks"] or b in dense["tasks"]]
        if not present:
            continue
        used, excluded = {}, {}
        for b in present:
            p, d = pruned["tasks"].get(b), dense["tasks"].get(b)
            if p is None or d is None:
                excluded[b] = f"evaluated only for the {'dense' if p is None else 'pruned'} model"
            elif p.get("status") != "ok" or d.get("status") != "ok":
                which = "pruned" if p.get("status") != "ok" else "dense"
                rec = p if which == "pruned" else d
                excluded[b] = f"{rec.get('status')} for the {which} model: {rec.get('reason', '')}".rstrip(": ")
            elif p.get("value") is None or d.get("value") is None:
                excluded[b] = f"no {BENCHMARKS[b].metric} value"
            elif _footing(p) != _footing(d):
                excluded[b] = _describe_mismatch(p, d)
            else:
                pv, dv = 100 * float(p["value"]), 100 * float(d["value"])
                used[b] = {"pruned": pv, "dense": dv, "retained": (100 * pv / dv) if dv else None,
                           "metric": p.get("metric") or BENCHMARKS[b].metric}
        pa = sum(v["pruned"] for v in used.values()) / len(used) if used else None
        da = sum(v["dense"] for v in used.values()) / len(used) if used else None
        out[suite] = {"rp": (100 * pa / da) if used and da else None, "pruned_average": pa, "dense_average": da,
                      "tasks": used, "excluded": excluded}
    return out


def evaluate_retained(pruned, dense, *, tokenizer=None, dense_tokenizer=None, output_dir=None, **settings) -> dict:
    """Evaluate a pruned and a dense model with the same settings and compute RP.

    ``pruned`` / ``dense``: model specs or in-memory models (then pass ``tokenizer`` /
    ``dense_tokenizer``; the dense one defaults to ``tokenizer``). ``settings`` go to
    :func:`overrep.eval.lmeval.evaluate_benchmarks` (``tasks``, ``limit``, ``batch_size``, ...).
    Results are written to ``output_dir/pruned.json`` and ``output_dir/dense.json``
    (default: the current folder's ``overrep-eval/``).

    Returns ``{"pruned": results, "dense": results, "retained": retained_performance(...)}``.
    """
    from .lmeval import evaluate_benchmarks

    out = Path(output_dir) if output_dir is not None else Path("overrep-eval")
    dense_res = evaluate_benchmarks(dense, dense_tokenizer or tokenizer, output=out / "dense.json", **settings)
    pruned_res = evaluate_benchmarks(pruned, tokenizer, output=out / "pruned.json", **settings)
    return {"pruned": pruned_res, "dense": dense_res, "retained": retained_performance(pruned_res, dense_res)}


def format_retained(rp: dict) -> str:
    lines = [f"{'benchmark':14s} {'metric':24s} {'pruned':>7s} {'dense':>7s} {'RP %':>7s}"]
    for suite, s in rp.items():
        for b, v in s["tasks"].items():
            ret = "-" if v["retained"] is None else f"{v['retained']:.1f}"
            lines.append(f"{b:14s} {v['metric']:24s} {v['pruned']:7.1f} {v['dense']:7.1f} {ret:>7s}")
        if s["rp"] is None:
            lines.append(f"{suite}: RP undefined (no comparable benchmark)")
        else:
            lines.append(f"{suite}: pruned {s['pruned_average']:.1f} / dense {s['dense_average']:.1f} -> "
                         f"RP {s['rp']:.1f}% over {len(s['tasks'])} benchmark(s)")
        for b, why in s["excluded"].items():
            lines.append(f"  left out {b}: {why}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- RR


def recovery_ratio(metrics) -> dict:
    """RR = trainable recovery parameters / pruned-model parameters x 100.

    ``metrics``: a pipeline ``metrics.json`` (path), its output folder, or the dict itself;
    it must hold ``trainable_params`` and ``pruned_params``.
    """
    if not isinstance(metrics, dict):
        path = Path(metrics)
        if path.is_dir():
            path = path / "metrics.json"
        if not path.is_file():
            raise OverRepError(f"no metrics.json at '{path}' (is the pipeline run finished?)")
        try:
            metrics = json.loads(path.read_text())
        except ValueError as error:
            raise OverRepError(f"'{path}' is not valid JSON ({error})") from error
    missing = [k for k in ("trainable_params", "pruned_params") if metrics.get(k) is None]
    if missing:
        raise OverRepError(f"metrics lack {' and '.join(missing)}; RR needs a pipeline run's metrics.json")
    trainable, pruned = int(metrics["trainable_params"]), int(metrics["pruned_params"])
    if pruned <= 0:
        raise OverRepError(f"pruned_params must be positive, got {pruned}")
    return {"trainable_params": trainable, "pruned_params": pruned, "rr": 100.0 * trainable / pruned}


# --------------------------------------------------------------------------- perplexity


def sliding_windows(length: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_target)`` of each window over a row of ``length`` tokens.

    Window ``k`` covers tokens ``[k*stride, k*stride + seq_len)`` (clipped to the row) and
    scores the targets in ``[first_target, end)`` not scored by an earlier window; token 0
    has no context and is never scored.
    """
    if seq_len < 2:
        raise OverRepError(f"seq_len must be at least 2, got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise OverRepError(f"stride must be between 1 and seq_len ({seq_len}), got {stride}")
    windows, scored_to, begin = [], 1, 0
    while True:
        end = min(begin + seq_len, length)
        first = max(scored_to, begin + 1)
        if end > first:
            windows.append((begin, end, first))
        scored_to = max(scored_to, end)
        if end >= length:
            return windows
        begin += stride


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int, stride: int | None = None, *, batch_size: int = 8,
               progress: bool = False) -> dict:
    """Sliding-window perplexity of ``model`` on ``ids``.

    Args:
        ids: one token stream ``[T]`` or independent rows ``[N, T]`` (no context crosses rows).
        seq_len: tokens per window (the model's context for the scored tokens).
        stride: how far windows advance (default ``seq_len``: no overlap). A smaller stride
            gives each scored token more context: token ``t`` of a window sees at least
            ``seq_len - stride`` earlier tokens, except in the first window.
        batch_size: windows per forward pass.

    Returns:
        ``{"perplexity", "nll" (mean, nats/token), "tokens" (scored), "windows", "seq_len", "stride"}``.
    """
    stride = seq_len if stride is None else int(stride)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise OverRepError(f"ids must be [T] or [N, T] with T >= 2, got shape {tuple(ids.shape)}")
    ids = ids.long()
    jobs = [(r, w) for r in range(ids.shape[0]) for w in sliding_windows(ids.shape[1], seq_len, stride)]
    by_len: dict[int, list] = {}
    for r, (b, e, f) in jobs:
        by_len.setdefault(e - b, []).append((r, b, e, f))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="perplexity", unit="window", disable=not progress, leave=False)
        for length, group in by_len.items():
            for i in range(0, len(group), batch_size):
                chunk = group[i:i + batch_size]
                x = torch.stack([ids[r, b:e] for r, b, e, _ in chunk]).to(device)
                logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), dim=-1)
                for j, (r, b, e, f) in enumerate(chunk):
                    pos = torch.arange(f - b - 1, e - b - 1, device=device)  # positions predicting f..e-1
                    tgt = x[j, f - b:e - b]
                    total_nll -= logp[j, pos, tgt].double().sum().item()
                    total_tokens += e - f
                bar.update(len(chunk))
        bar.close()
    finally:
        model.train(was_training)
    mean = total_nll / total_tokens
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": total_tokens, "windows": len(jobs),
            "seq_len": seq_len, "stride": stride}


def heldout_perplexity(model, tokenizer, *, source: str | None = None, seq_len: int = 256,
                       stride: int | None = None, tokens: int = 256 * 48, seed: int = 42,
                       progress: bool = False) -> dict:
    """Perplexity on held-out text: ``tokens`` tokens of the held-out side of ``source``
    (default: the embedded corpus) as one stream, scored with windows of ``seq_len``
    advancing by ``stride`` (see :func:`perplexity`)."""
    from ..data.text import EMBEDDED, token_splits

    rows = max(1, math.ceil(tokens / seq_len))
    _, held, info = token_splits(source or EMBEDDED, tokenizer, seq_len=seq_len, train_sequences=1,
                                 heldout_sequences=rows, seed=seed, progress=progress)
    stream = held.reshape(-1)[:tokens]
    out = perplexity(model, stream, seq_len, stride, progress=progress)
    out.update({"source": source or EMBEDDED, "heldout_fingerprint": info.get("heldout_fingerprint")})
    return out
