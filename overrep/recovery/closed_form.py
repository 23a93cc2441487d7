"""Training-free replacement of removed blocks: ReplaceMe's linear map, fitted in closed form.

For a removed run ``[a, b]`` let L = a-1 be the last kept block before it. On calibration
rows, in the *compact* model, L computes ``Y = H + M`` (H: the residual after L's
attention, M: the output of L's MLP ``down_proj``); the dense model's output of the last
removed block is ``X*``. ReplaceMe (Shopkhoev et al., 2025, ``lstsq.py``) looks for the
map T (d x d) with

    Y' = H + M T  ~  X*        i.e.  T = argmin_T  sum_t w_t || m_t T - r_t ||^2,   r_t = x*_t - h_t

    T = (M^T W M + lambda I)^-1 M^T W R        (normal equations, accumulated in float64)

and folds it into L's ``down_proj`` (``W <- T^T W``, ``b <- T^T b``): the compact model keeps
the stock architecture. The published fit has ``w_t = 1`` for every token and
``lambda = 0``. On a model with *massive activations* (SmolLM2: the residual RMS of the
first token is ~100x that of the others) the unweighted fit spends itself on those few
positions and ends worse than no map at all (docs/closed-forms.md). ``tokens`` chooses
the weights ``w_t`` (:func:`token_weights`): ``balanced`` (the default) counts every token and
weights the attention sinks (the first token, and any token whose RMS is above ``SINK_FACTOR``
x its row's median) so that together they weigh ``SINK_BALANCE`` times the other tokens
(:func:`balance_sinks`); the others leave out the first token or every sink, and/or divide
each row by the target's RMS (``w_t = 1 / rms(x*_t)^2``). The ridge is relative:
``lambda = ridge * tr(M^T W M) / d``.

The cosine variant (ReplaceMe's ``cosine`` mode) starts T at the identity and minimises
``mean_t 1 - cos(h_t + m_t T, x*_t)`` with Adam, on the calibration tokens held in memory
(3 x tokens x d floats), for ``cos_steps`` steps or ``cos_seconds``.

Non-contiguous masks get one map per run, fitted in order so that each fit sees the
earlier runs already replaced. Rows stream through the models in batches: the least-squares
fit keeps only the d x d sums, never the activations. With ``precision`` ``bf16`` the
calibration forwards run under bf16 autocast, as the layer-wise methods' feature teacher
does (the sums, the solve and the fold stay in float64; the fold check runs in the model's
own dtype).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from ..core.precision import autocast
from ..errors import OverRepError
from ..model.arch import block_parts, decoder_layers
from ..model.hooks import StopForward, run_hooked
from ..model.placement import input_device
from ..model.prefix import same_prefix
from ..model.surgery import PrunePlan, contiguous_runs

#: a token whose residual RMS is this many times the row's median is an attention sink
SINK_FACTOR = 10.0


def sink_mask(rms: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the tokens whose residual RMS (``rms``: ``[B, T]``) is over ``SINK_FACTOR``
    times their row's median -- the attention sinks that carry a model's massive activations."""
    return rms > SINK_FACTOR * rms.median(dim=1, keepdim=True).values


#: the token selections and weightings ``tokens`` may combine with "+" ("all" alone: every token, weight 1;
#: "balanced" alone: every token, the sinks reweighted by :func:`balance_sinks`)
TOKEN_PARTS = ("all", "balanced", "skip-first", "sinks", "rms")
#: ``tokens: balanced``: the attention sinks' weighted squared residual is this many times the other
#: tokens' together, batch by batch. Chosen on validation rows (SmolLM2, the cosine mask, 64 rows:
#: 267 with 0.1, 202 with 1, 195 with 3, 315 with 10) and checked on four other samples of rows
#: (197-207, where leaving the first token out ranged over 195-279; docs/closed-forms.md)
SINK_BALANCE = 3.0
ALONE = ("all", "balanced")


@dataclass(frozen=True)
class FitOptions:
    """How the map is fitted (``recovery.closed_*`` in the configuration)."""

    rows: int = 64  # calibration rows (training rows, never held-out or validation rows)
    tokens: str = "balanced"  # which tokens count and how much: "all", "balanced" or a "+"-joined subset of the rest of TOKEN_PARTS
    ridge: float = 1e-4  # relative ridge: lambda = ridge * mean diagonal of M^T W M
    sink_balance: float = SINK_BALANCE  # tokens "balanced": the sinks' share, times the other tokens'
    batch: int = 8  # rows per forward pass
    cos_steps: int = 300  # cosine variant: Adam steps
    cos_lr: float = 1e-3  # cosine variant: Adam learning rate
    cos_seconds: float | None = None  # cosine variant: stop after this many seconds (None: steps only)
    cos_tokens: int = 4096  # cosine variant: tokens per Adam step
    precision: str = "fp32"  # the calibration forwards': "bf16" runs them under bf16 autocast (recovery.precision)


def check_tokens(spec: str) -> set[str]:
    parts = {p.strip() for p in str(spec).split("+") if p.strip()}
    bad = sorted(parts - set(TOKEN_PARTS))
    if bad or not parts or (parts & set(ALONE) and len(parts) > 1):
        raise OverRepError(f"recovery.closed_tokens '{spec}': use 'all', 'balanced' or a '+'-joined subset of "
                           f"{', '.join(p for p in TOKEN_PARTS if p not in ALONE)}")
    return parts


def token_weights(target: torch.Tensor, spec: str) -> torch.Tensor:
    """Per-token weights ``[B, T]`` (float64) from the target hidden states ``[B, T, d]``.

    ``balanced`` gives the sinks (the first token and :func:`sink_mask`'s) weight 0 here, so a
    fit that only selects tokens (the cosine fit, Prune&Comp's means) leaves them out; the
    least-squares fit then weights them in with :func:`balance_sinks`."""
    parts = check_tokens(spec)
    rms = target.double().pow(2).mean(-1).sqrt()
    w = torch.ones_like(rms)
    if "skip-first" in parts or "balanced" in parts:
        w[:, 0] = 0
    if "sinks" in parts or "balanced" in parts:
        w[sink_mask(rms)] = 0
    if "rms" in parts:
        w = w / rms.clamp_min(1e-12).pow(2)
    return w


def balance_sinks(w: torch.Tensor, residual: torch.Tensor, balance: float = SINK_BALANCE) -> torch.Tensor:
    """``token_weights(..., "balanced")`` with its sinks (the tokens it gave weight 0) weighted in so
    that their weighted squared residual is ``balance`` times the other tokens' together.

    Unweighted, a sink's residual (SmolLM2: norm ~23,000 against ~150; the sink grows inside
    the removed blocks) outweighs every other token and the map is spent on it; left out, the
    map never learns to grow the sink the later blocks read. Both measured worse than counting
    the sinks as a fixed share (docs/closed-forms.md, "Which calibration rows")."""
    sinks = w == 0
    size = residual.double().pow(2).sum(-1)
    if sinks.all() or size[sinks].sum() <= 0:
        return w
    w = w.clone()
    w[sinks] = balance * (size * w)[~sinks].sum() / size[sinks].sum()
    return w


class NormalEquations:
    """Streaming sums ``A = M^T W M`` ``[d, d]`` and ``B = M^T W R`` ``[d, e]`` in float64."""

    def __init__(self, d: int, e: int, device=None):
        self.A = torch.zeros(d, d, dtype=torch.float64, device=device)
        self.B = torch.zeros(d, e, dtype=torch.float64, device=device)
        self.tokens = 0.0

    def add(self, m: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> None:
        """``m [N, d]``, ``r [N, e]``, ``w [N]`` (tokens of weight 0 add nothing)."""
        keep = w > 0
        m, r, w = m[keep].double(), r[keep].double(), w[keep].double()
        mw = m * w[:, None]
        self.A += mw.T @ m
        self.B += mw.T @ r
        self.tokens += float(keep.sum())

    def solve(self, ridge: float) -> torch.Tensor:
        d = self.A.shape[0]
        if self.tokens == 0:
            raise OverRepError("closed-form fit: no calibration token has a non-zero weight")
        lam = ridge * self.A.diagonal().mean().clamp_min(1e-300)
        a = self.A + lam * torch.eye(d, dtype=self.A.dtype, device=self.A.device)
        try:
            return torch.linalg.solve(a, self.B)
        except RuntimeError:  # singular without a ridge (fewer tokens than d): least norm
            return torch.linalg.lstsq(a.cpu(), self.B.cpu(), driver="gelsd").solution.to(a.device)


def _down_or_why(layer: nn.Module, index: int) -> tuple[nn.Linear | None, str | None]:
    """The projection writing block ``index``'s MLP output, or why the block has none."""
    parts = block_parts(layer, index)
    if "down" not in parts.projections:
        return None, f"block {index} has " + ("a mixture of experts" if parts.experts is not None
                                              else "no feed-forward part")
    parent, attr = parts.projections["down"]
    return getattr(parent, attr), None


def down_projection(layer: nn.Module, index: int) -> nn.Linear:
    """The projection writing block ``index``'s MLP output, or a one-line error where there is none."""
    down, why = _down_or_why(layer, index)
    if down is None:
        raise OverRepError(f"closed-form fit: {why}; ReplaceMe's map folds into a dense MLP's "
                           "down projection (use a method that trains, or another mask)")
    return down


@torch.no_grad()
def _block_output(model: nn.Module, index: int, ids: torch.Tensor, down: nn.Linear | None = None,
                  before: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block ``index``'s output (its input with ``before``) on ``ids`` and the output of
    ``down`` in that forward; the rest of the model is skipped."""
    got: dict = {}
    layers = decoder_layers(model)

    def out_hook(module, args, kwargs, out=None):
        h = kwargs.get("hidden_states", args[0] if args else None) if before else out
        got["out"] = (h[0] if isinstance(h, tuple) else h).detach()
        raise StopForward

    handles = []
    if down is not None:
        handles.append(down.register_forward_hook(lambda m, a, o: got.__setitem__("m", o.detach())))
    if before:
        handles.append(layers[index].register_forward_pre_hook(out_hook, with_kwargs=True))
    else:
        handles.append(layers[index].register_forward_hook(out_hook, with_kwargs=True))
    run_hooked(model, handles, input_ids=ids.to(input_device(model)), use_cache=False)
    return got["out"], got.get("m")


def gap_batches(pruned: nn.Module, dense: nn.Module, plan: PrunePlan, run: tuple[int, int], ids: torch.Tensor,
                batch: int, precision: str = "fp32"):
    """Per batch of rows: ``(H, M, X*)``, each ``[B, T, d]`` (float32): the residual after the
    compact block before ``run`` minus its MLP output, that output, and the dense target
    (the forwards under ``precision``'s autocast)."""
    a, b = run
    if a == 0:
        raise OverRepError(f"closed-form fit: the run {a}-{b} starts at block 0; there is no block before it "
                           "to hold the map")
    ci = plan.compact_index(a - 1)
    down = down_projection(decoder_layers(pruned)[ci], a - 1)
    # where the pruned model's blocks up to the one before the run are still the dense model's
    # (a mask's first run, nothing folded yet), one dense forward gives all three
    one_pass = ci == a - 1 and same_prefix(pruned, dense, a)
    dense_down = down_projection(decoder_layers(dense)[a - 1], a - 1) if one_pass else None
    for i in range(0, ids.shape[0], batch):
        rows = ids[i:i + batch]
        with autocast(precision, input_device(pruned)):
            if one_pass:
                y, m, x = _dense_gap(dense, a - 1, b, rows, dense_down)
            else:
                y, m = _block_output(pruned, ci, rows, down)
                x, _ = _block_output(dense, b, rows)
        yield (y - m).float(), m.float(), x.float().to(y.device)


def _dense_gap(dense: nn.Module, last: int, end: int, ids: torch.Tensor, down: nn.Linear):
    """From one forward of ``dense`` (stopped after block ``end``): block ``last``'s output,
    its MLP output (``down``'s) and block ``end``'s output."""
    got: dict = {}
    layers = decoder_layers(dense)

    def grab(name: str, stop: bool = False):
        def hook(module, args, kwargs, out):
            got[name] = (out[0] if isinstance(out, tuple) else out).detach()
            if stop:
                raise StopForward
        return hook

    handles = [down.register_forward_hook(lambda m, a, o: got.__setitem__("m", o.detach())),
               layers[last].register_forward_hook(grab("y"), with_kwargs=True),
               layers[end].register_forward_hook(grab("x", stop=True), with_kwargs=True)]
    run_hooked(dense, handles, input_ids=ids.to(input_device(dense)), use_cache=False)
    return got["y"], got["m"], got["x"]


def fit_lstsq(pruned, dense, plan, run, ids, opts: FitOptions) -> tuple[torch.Tensor, dict]:
    """T ``[d, d]`` (float64) for one run by weighted, ridged least squares."""
    eq = None
    balanced = "balanced" in check_tokens(opts.tokens)
    for h, m, x in gap_batches(pruned, dense, plan, run, ids, opts.batch, opts.precision):
        r = x - h
        w = token_weights(x, opts.tokens)
        if balanced:
            w = balance_sinks(w, r, opts.sink_balance)
        d = m.shape[-1]
        eq = eq or NormalEquations(d, d, m.device)
        eq.add(m.reshape(-1, d), r.reshape(-1, d), w.flatten())
    t = eq.solve(opts.ridge)
    return t, {"tokens": int(eq.tokens)}


def fit_cosine(pruned, dense, plan, run, ids, opts: FitOptions) -> tuple[torch.Tensor, dict]:
    """T from the identity by Adam on ``1 - cos(h + m T, x*)`` over the kept tokens."""
    hs, ms, xs = [], [], []
    for h, m, x in gap_batches(pruned, dense, plan, run, ids, opts.batch, opts.precision):
        keep = token_weights(x, opts.tokens).flatten() > 0  # cosine is scale-free: only the selection counts
        d = m.shape[-1]
        hs.append(h.reshape(-1, d)[keep])
        ms.append(m.reshape(-1, d)[keep])
        xs.append(x.reshape(-1, d)[keep])
    h, m, x = torch.cat(hs), torch.cat(ms), torch.cat(xs)
    if h.shape[0] == 0:
        raise OverRepError("closed-form fit: no calibration token has a non-zero weight")
    t = torch.eye(m.shape[1], device=m.device, requires_grad=True)
    opt = torch.optim.Adam([t], lr=opts.cos_lr)
    g = torch.Generator(device="cpu").manual_seed(0)
    start, steps, loss = time.perf_counter(), 0, float("nan")
    with torch.enable_grad():
        while steps < opts.cos_steps:
            if opts.cos_seconds is not None and time.perf_counter() - start > opts.cos_seconds:
                break
            idx = torch.randint(0, h.shape[0], (min(opts.cos_tokens, h.shape[0]),), generator=g).to(h.device)
            pred = h[idx] + m[idx] @ t
            step_loss = (1 - nn.functional.cosine_similarity(pred, x[idx], dim=-1)).mean()
            opt.zero_grad()
            step_loss.backward()
            opt.step()
            steps, loss = steps + 1, step_loss.item()
    return t.detach().double(), {"tokens": int(h.shape[0]), "steps": steps, "final_loss": loss}


@torch.no_grad()
def fold_map(down: nn.Linear, t: torch.Tensor) -> None:
    """``down`` now computes ``down(z) @ T``: ``W <- T^T W``, ``b <- T^T b`` (in float64)."""
    t = t.double().to(down.weight.device)
    down.weight.copy_((t.T @ down.weight.double()).to(down.weight.dtype))
    if down.bias is not None:
        down.bias.copy_((down.bias.double() @ t).to(down.bias.dtype))


@torch.no_grad()
def _check_fold(pruned, plan, run, ids, h, m, t) -> None:
    """The folded block must output ``H + M T``, to the rounding of the model's dtype (1e-4 of
    the largest value in float32, 4 ulps of it in bfloat16 or float16); a block whose MLP
    output is not added to the residual as it is (Gemma's post-feed-forward norm) fails here."""
    ci = plan.compact_index(run[0] - 1)
    y, _ = _block_output(pruned, ci, ids)
    rel = 1e-4 if torch.finfo(y.dtype).bits >= 32 else 4 * torch.finfo(y.dtype).eps
    want = h.double() + m.double() @ t.to(m.device)
    err = (y.double() - want).abs().max().item()
    if not err <= rel * want.abs().max().item():
        raise OverRepError(f"closed-form fit: block {run[0] - 1}'s output is not its residual plus its MLP output "
                           f"(fold off by {err:.3g}); ReplaceMe's map does not fold into this architecture")


def fit_and_fold(pruned: nn.Module, dense: nn.Module, plan: PrunePlan, ids: torch.Tensor, opts: FitOptions,
                 kind: str = "lstsq") -> dict:
    """Fit one map per removed run (``kind``: ``lstsq`` | ``cosine``) and fold each into the
    ``down_proj`` of the block before its run, in place; what was fitted."""
    if kind not in ("lstsq", "cosine"):
        raise ValueError(kind)
    ids = ids[:opts.rows]
    was = pruned.training
    pruned.eval()
    out = []
    for run in contiguous_runs(plan.removed):
        t0 = time.perf_counter()
        fit = fit_lstsq if kind == "lstsq" else fit_cosine
        t, info = fit(pruned, dense, plan, run, ids, opts)
        down = down_projection(decoder_layers(pruned)[plan.compact_index(run[0] - 1)], run[0] - 1)
        probe = ids[:1]
        h, m, _ = next(gap_batches(pruned, dense, plan, run, probe, 1))
        saved = [p.detach().clone() for p in down.parameters()]
        fold_map(down, t)
        try:
            _check_fold(pruned, plan, run, probe, h, m, t)
        except OverRepError:
            with torch.no_grad():
                for p, s in zip(down.parameters(), saved):
                    p.copy_(s)
            raise
        eye = torch.eye(t.shape[0], dtype=t.dtype, device=t.device)
        out.append({"run": list(run), "block": run[0] - 1, "seconds": time.perf_counter() - t0,
                    "distance_from_identity": ((t - eye).norm() / eye.norm()).item(), **info})
    pruned.train(was)
    balance = {"sink_balance": opts.sink_balance} if "balanced" in check_tokens(opts.tokens) else {}
    return {"kind": kind, "rows": int(ids.shape[0]), "tokens_spec": opts.tokens, "ridge": opts.ridge, **balance,
            "precision": opts.precision, "runs": out}


@torch.no_grad()
def fold_blocker(model: nn.Module, removed: list[int], ids: torch.Tensor) -> str | None:
    """Why ReplaceMe's map cannot fold into ``model`` for the removed blocks ``removed``
    (None: it can), found without fitting: a run starting at block 0, a block before a run
    with experts or no feed-forward part, or one whose MLP output is not added to the
    residual as it is (checked on ``ids``: a shift of the ``down_proj`` output must shift the
    block's output by exactly as much; Gemma's post-feed-forward norm does not)."""
    layers = decoder_layers(model)
    for a, b in contiguous_runs(removed):
        if a == 0:
            return f"the removed run {a}-{b} starts at block 0"
        down, why = _down_or_why(layers[a - 1], a - 1)
        if down is None:
            return why
        y, m = _block_output(model, a - 1, ids, down)
        shift = torch.randn(m.shape, generator=torch.Generator().manual_seed(0)).to(m) * y.float().abs().max()
        handle = down.register_forward_hook(lambda mod, args, out: out + shift)
        try:
            shifted, _ = _block_output(model, a - 1, ids)
        finally:
            handle.remove()
        if not (shifted.float() - y.float() - shift.float()).abs().max() <= 0.05 * shift.float().abs().max():
            return f"block {a - 1}'s MLP output is not added to its residual as it is"
    return None
