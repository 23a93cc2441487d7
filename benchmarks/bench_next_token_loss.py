"""Seconds of a next-token loss step with the logits materialised and without them, in one run.

Two places train on the next-token loss through a frozen LM head: the ``ce`` phase of the
default ``normed>ce`` (the recovery module's output run through the frozen tail of the pruned
model: :meth:`overrep.recovery.losses.Tail.next_token_loss`) and the whole-model methods
(full fine-tuning, ``overrep-lm``, and LoRA: PEFT adapters of rank ``--lora-rank`` on every
projection, :class:`overrep.model.lm_loss.CausalLMLoss`). Each is
timed, forward and backward, on the same rows of the default training text, once the plain way
(the batch's logits in fp32, then ``cross_entropy``: what the model's own ``labels=`` loss does)
and once fused (:func:`overrep.core.linear_ce.head_cross_entropy`), the two alternating
``--repeats`` times so that a drift of the machine hits both; it prints the median, the fastest
and the slowest step of each, the ratio of the medians, and how far the two losses and
gradients are apart (and, in bf16, how far each gradient is from the plain fp32 one). The tail
is also timed without its LM head (the final norm's output through a fixed projection as the
loss), alternating with the other two, so that the head's share of a ``ce`` step is known
(``head_share``: what a loss on fewer positions, or a cheaper head, could save at most).

Run:   .venv/bin/python benchmarks/bench_next_token_loss.py                 (embedded SmolLM2-135M)
       .venv/bin/python benchmarks/bench_next_token_loss.py --remove 9-19 --batch 8 --repeats 12
The JSON result goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _summary(seconds: list[float]) -> dict:
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds), "steps": len(seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="'embedded' or a local Hugging Face folder")
    ap.add_argument("--remove", default="9-19", help="blocks removed (default: the default run's cosine mask)")
    ap.add_argument("--batch", type=int, default=8, help="rows of 256 tokens a step (the default run's batch)")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps of each kind (after one warm-up each)")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lora-rank", type=int, default=118,
                    help="rank of the LoRA case's adapters on every projection (118: what lora-iso picks on the default)")
    ap.add_argument("--chunk-logits", type=int, default=None,
                    help="logits held at once by the fused loss (default overrep.core.linear_ce.CHUNK_LOGITS)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from overrep.core import linear_ce

    if args.chunk_logits:
        linear_ce.CHUNK_LOGITS = args.chunk_logits

    from overrep.app.runinfo import processor
    from overrep.core.linear_ce import head_cross_entropy
    from overrep.core.precision import autocast, resolve_precision
    from overrep.data.splits import split_source
    from overrep.model.arch import decoder_layers, final_norm
    from overrep.model.hooks import capture_layer_context, run_to_hidden, run_to_logits
    from overrep.model.lm_loss import CausalLMLoss
    from overrep.model.loading import load_model
    from overrep.model.surgery import parse_layers, plan_pruning, prune

    precision = resolve_precision(args.precision, "cpu")
    model, tokenizer, _ = load_model(None if args.model == "embedded" else args.model)
    plan = plan_pruning(len(decoder_layers(model)), parse_layers(args.remove), blocks=1)
    model = prune(model, plan).eval()
    model.requires_grad_(False)
    ids = split_source("embedded", tokenizer, seq_len=256, train_sequences=args.batch, test_sequences=1,
                       progress=False).train[:args.batch]
    layers, cut = decoder_layers(model), plan.removed[0]  # the module ends at compact block cut - 1
    ctx = capture_layer_context(model, ids.shape[1])
    tail = [(layers[i], ctx[i]) for i in range(cut, len(layers))]
    norm, head = final_norm(model), model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    with torch.no_grad():
        h0 = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[cut].float()
    labels = ids[:, 1:].flatten()

    def tail_plain(h):
        logits = run_to_logits(h, tail, norm, head, softcap)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels)

    def tail_fused(h):
        x = run_to_hidden(h, tail, norm)
        return head_cross_entropy(x[:, :-1].flatten(0, 1), head, labels, softcap)

    probe = torch.randn(h0.shape[-1], generator=torch.Generator().manual_seed(0))

    def tail_no_head(h):  # the same frozen blocks and final norm, no LM head: what the head costs is the rest
        return (run_to_hidden(h, tail, norm).float() @ probe).mean()

    def tail_step(fn, at=None):
        h = h0.clone().requires_grad_()
        t = time.perf_counter()
        with autocast(at or precision, "cpu"):
            loss = fn(h)
        loss.backward()
        return time.perf_counter() - t, loss.item(), h.grad

    for layer in layers:  # the whole-model case trains every retained block (full fine-tuning's gradients)
        layer.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    fused_loss = CausalLMLoss(model)

    def whole_step(fn, at=None):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        with autocast(at or precision, "cpu"):
            loss = fn(ids)
        loss.backward()
        return time.perf_counter() - t, loss.item(), params[0].grad

    cases = {"tail": (tail_step, tail_plain, tail_fused),
             "whole_model": (whole_step, lambda x: model(input_ids=x, labels=x, use_cache=False).loss, fused_loss),
             "lora": None}  # built when its turn comes: PEFT wraps the model's projections in place
    out: dict = {"cpu": processor(torch.device("cpu")), "threads": torch.get_num_threads(), "precision": precision,
                 "batch": args.batch, "seq_len": ids.shape[1], "remove": args.remove,
                 "vocab": head.weight.shape[0], "chunk_logits": linear_ce.CHUNK_LOGITS, "cases": {}}
    for name, case in cases.items():
        for layer in layers:  # the tail is frozen; the whole model trains its blocks
            layer.requires_grad_(name == "whole_model")
        if name == "lora":
            from peft import LoraConfig, get_peft_model

            from overrep.recovery.methods.adapters import projection_names

            peft = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                                    target_modules=projection_names(model), task_type="CAUSAL_LM"))
            torch.manual_seed(0)
            for n, p in peft.named_parameters():
                if "lora_B" in n:  # adapters as after some training (B = 0 at the start gives A no gradient)
                    torch.nn.init.normal_(p, std=1e-3)
            params[:] = [p for p in peft.parameters() if p.requires_grad]
            case = (whole_step, lambda x: peft(input_ids=x, labels=x, use_cache=False).loss, CausalLMLoss(peft))
        step, plain, fused = case
        kinds = [("plain", plain), ("fused", fused)] + ([("no_head", tail_no_head)] if name == "tail" else [])
        times: dict = {kind: [] for kind, _ in kinds}
        for _, fn in kinds:  # warm-up
            step(fn)
        for _ in range(args.repeats):
            for kind, fn in kinds:
                seconds, loss, grad = step(fn)
                times[kind].append(seconds)
                if kind == "plain":
                    ref = (loss, grad.clone())
                elif kind == "fused":
                    diff = {"loss": abs(loss - ref[0]) / abs(ref[0]),
                            "gradient": ((grad - ref[1]).norm() / ref[1].norm()).item()}
        res = {k: _summary(v) for k, v in times.items()}
        if precision != "fp32":  # each way's gradient against the plain one in fp32: is the fused one worse?
            exact = step(plain, "fp32")[2].clone()
            res["gradient_error_vs_fp32"] = {kind: ((step(fn)[2] - exact).norm() / exact.norm()).item()
                                             for kind, fn in (("plain", plain), ("fused", fused))}
        res["plain_over_fused"] = res["plain"]["median"] / res["fused"]["median"]
        if "no_head" in res:  # the share of a fused tail step the LM head and its cross-entropy take
            res["head_share"] = 1 - res["no_head"]["median"] / res["fused"]["median"]
        res["relative_difference"] = diff
        if name != "tail":
            res["fused_used"] = fused.parts is not None
        out["cases"][name] = res
        print(f"{name}: plain {res['plain']['median']:.3f} s [{res['plain']['min']:.3f}, {res['plain']['max']:.3f}], "
              f"fused {res['fused']['median']:.3f} s [{res['fused']['min']:.3f}, {res['fused']['max']:.3f}]: "
              f"{res['plain_over_fused']:.2f}x"
              + (f"; without the head {res['no_head']['median']:.3f} s (the head {res['head_share']:.0%} of the fused step)"
                 if "no_head" in res else ""), file=sys.stderr)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
