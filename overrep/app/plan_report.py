"""The text ``overrep plan`` prints: :func:`format_plan` of a :func:`~overrep.app.planner.make_plan` dict.

Counts in M (10^6) / B (10^9), bytes in decimal GB / TB, FLOPs in scientific notation.
"""

from __future__ import annotations


def count(n: float) -> str:
    """``650.1M``, ``8.03B``."""
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def size(b: float) -> str:
    """``35.0 GB``, ``4.03 TB`` (decimal units)."""
    return f"{b / 1e12:,.2f} TB" if b >= 1e12 else f"{b / 1e9:,.1f} GB" if b >= 1e8 else f"{b / 1e6:,.1f} MB"


def flops(f: float) -> str:
    return f"{f:.3g}".replace("e+", "e")


def ranges(indices: list[int]) -> str:
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _removal_lines(p: dict) -> list[str]:
    r = p["removal"]
    others = ", ".join(f"{k} blocks {v:.1%}" for k, v in r["neighbours"].items())
    lines = [f"removed      {r['num_removed']} of {r['num_layers']} blocks: {ranges(r['removed'])} ({r['how']})",
             f"             = {r['counted_fraction']:.1%} of the counted parameters ({count(r['params_per_block'])} a "
             f"block, head counted){'; ' + others if others else ''}",
             f"layers left  {r['layers_left']}"]
    if r["how"].startswith("--ratio"):
        lines.append("             (criterion 'last' needs no weights; block-influence, cosine and laco score the "
                     "real model: `overrep inspect --criterion ...`)")
    for g in p["groups"]:
        stitch = "".join(f", block {k} stitched from {v}" for k, v in g["stitch"].items())
        lines.append(f"recovery     blocks {','.join(map(str, g['module_layers']))}{stitch}: learns h_in({g['input_layer']}) "
                     f"-> {'normed ' if g['final_norm'] else ''}h_out({g['target_layer']})")
    return lines


def _preset_lines(p: dict) -> list[str]:
    o = p["options"]
    lines = [f"{'preset':22s} {'trainable':>10s} {'module':>10s} {'train state':>12s} {'train FLOPs/token':>18s}"]
    for r in p["presets"]:
        name = r["preset"] + (f" (blocks={r['blocks']})" if r["blocks"] != o["blocks"] else "")
        mark = " *" if r["selected"] else ""
        lines.append(f"{name + mark:22s} {count(r['trainable_params']):>10s} {count(r['module_params']):>10s} "
                     f"{size(r['train_state_bytes']):>12s} {flops(r['train_flops_per_token']):>18s}")
    w = 4 if o["dtype"] == "float32" else 2
    copy = " + 2 B autocast bf16 copy per module parameter" if o["precision"] == "bf16" and w == 4 else ""
    lines.append(f"train state = AdamW: {w} B weight + {w} B gradient + 8 B moments per trainable parameter, "
                 f"{w} B per frozen module parameter{copy} ({o['dtype']} weights, {o['precision']} compute); "
                 "activations not included")
    lines.append("(plain-full with blocks=1 is the single replacement block Streamline trains; * = --preset)")
    return lines


def format_plan(p: dict) -> str:
    """The plan as the lines ``overrep plan`` prints."""
    d, c, t, tr, lay = p["data"], p["cache"], p["teacher"], p["training"], p["layout"]
    o = p["options"]
    head = "tied (counted again as the head)" if p["tied_head"] else "untied"
    out = [f"model        {p['source']}: {p['architecture']}, {p['num_layers']} blocks, hidden {p['hidden_size']}, "
           f"vocab {p['vocab_size']}, head {head}",
           f"parameters   dense {count(p['dense_params'])} -> compact {count(p['compact_params'])}",
           *_removal_lines(p), "", *_preset_lines(p), "",
           f"data         {d['sequences']:,} sequences x {d['seq_len']:,} tokens = {count(d['tokens'])} tokens; "
           f"batch {d['batch']}, {d['epochs']:g} epochs = {d['steps']:,.0f} steps",
           f"cache        {size(c['bytes'])} on disk = {c['groups']} group(s) x (inputs + targets) x {count(d['tokens'])} "
           f"tokens x hidden {p['hidden_size']} x {4 if c['dtype'] == 'float32' else 2} B ({c['dtype']})",
           f"teacher      dense blocks 0-{t['last_block']}: {flops(t['flops_per_token'])} FLOPs/token; building the cache "
           f"{flops(t['cache_build_flops'])} FLOPs (once); live: {flops(t['live_flops_per_step'])} per step, "
           f"the same again every epoch",
           f"training     {tr['preset']}: {flops(tr['train_flops_per_token'])} FLOPs/token, "
           f"{flops(tr['train_flops_per_sequence'])} per sequence, {flops(tr['train_flops_per_step'])} per step "
           f"(batch {d['batch']}), {flops(tr['run_flops'])} for the run (forward + backward = 3 x forward)",
           "",
           f"layout       {o['gpus']} GPU(s) of {size(lay['gpu_bytes'])}, disk {size(lay['disk_bytes'])}, preset {tr['preset']}:",
           f"  teacher    {lay['teacher']}: the cache ({size(c['bytes'])}) "
           f"{'fits' if lay['teacher'] == 'cache' else 'exceeds'} --disk {size(lay['disk_bytes'])}"
           + ("" if lay["teacher"] == "cache" else f"; its weights ({size(t['weight_bytes'])}) stay resident"
              if lay["teacher_weights"] == "model" else "; its blocks are read again every step (onloaded)"),
           f"  ranks      {lay['ranks']} (DDP), {lay['sequences_per_rank_step']:g} sequence(s) each per step"
           + (f"; {lay['idle_gpus']} GPU(s) idle (raise --batch to use them)" if lay["idle_gpus"] else ""),
           f"  FSDP       {'yes' if lay['fsdp'] else 'no'}: resident {size(lay['resident_bytes'])}"
           f"{' / ' + str(lay['ranks']) + ' ranks = ' + size(lay['per_rank_bytes']) if lay['fsdp'] else ''} per rank, "
           f"budget {size(lay['budget_bytes'])} ({lay['state_fraction']:.0%} of one GPU)"]
    if not lay["fits"]:
        out.append(f"  DOES NOT FIT: needs at least {lay['gpus_needed']} GPUs of this size (FSDP over them)")
    how = ("dense + compact models whole" if lay["teacher_weights"] == "model" else
           "onloaded (cache.teacher: stream): embeddings and head + one block")
    out.append(f"  weights    {how}: {size(lay['weights_bytes'])} ({o['model_dtype']}: {o['dtype']}) + state "
               f"{size(lay['state_per_rank_bytes'])} = {size(lay['per_rank_total_bytes'])} per rank, "
               f"{'within' if lay['per_rank_total_bytes'] <= lay['memory_budget_bytes'] else 'OVER'} "
               f"{size(lay['memory_budget_bytes'])} ({lay['memory_fraction']:.0%} of one GPU)")
    if lay["teacher_weights"] == "stream":
        out.append(f"             (whole, they would take {size(lay['single_process_bytes'])} a rank)")
    if lay["teacher"] == "live" and lay["teacher_weights"] == "stream":
        out.append(f"  warning    a live onloaded teacher reads the dense blocks 0-{t['last_block']} from disk every step; "
                   f"room for the cache (--disk {size(c['bytes'])}, or --cache-dtype bfloat16) makes it a one-off")
    out.append(f"  lr         {lay['lr']:g}: {o['batch']} sequences a step, square-root scaled from 1e-3 at batch 8")
    out += ["rules        teacher: cache when the cache fits --disk, else live; ranks: min(gpus, batch); FSDP: when "
            f"the resident state exceeds {lay['state_fraction']:.0%} of one GPU's memory; weights: whole when they "
            f"and the state fit {lay['memory_fraction']:.0%} of one GPU, else onloaded block by block"]
    if o["run_model"] == "MODEL":
        out.append("command      (MODEL: the model folder or hub id this config belongs to; --run-model sets it)")
    out.append(lay["command"])
    return "\n".join(out)
