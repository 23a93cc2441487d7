"""How a run ran: its ranks, their devices and threads, the sharding and how the model was held.

:func:`how_it_ran` is called by every rank (it gathers each rank's host, device and thread
count to rank 0 with one ``all_gather_object`` under ``torchrun``); the result goes into
``metrics.json`` (``run``) and the report's first lines, so that a two-rank run says so.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

import torch

from ..distributed import World


def how_it_ran(world: World, device: torch.device, shard: str, teacher: str, dtype: torch.dtype) -> dict:
    me = {"rank": world.rank, "local_rank": world.local_rank, "host": platform.node(), "device": str(device),
          "threads": torch.get_num_threads()}
    ranks = [me]
    if world.distributed:
        ranks = [None] * world.size
        torch.distributed.all_gather_object(ranks, me)
    backend = torch.distributed.get_backend() if world.distributed else None
    return {"world_size": world.size, "nodes": len({r["host"] for r in ranks}), "backend": backend,
            "sharding": shard if world.distributed else "none", "teacher": teacher,
            "model_dtype": str(dtype).removeprefix("torch."), "ranks": ranks}


def describe(run: dict) -> str:
    """One line for the report, e.g. ``2 ranks (gloo) on 1 machine: cpu x2, 1 thread each; ...``."""
    ranks = run["ranks"]
    devices = sorted({r["device"] for r in ranks})
    threads = sorted({r["threads"] for r in ranks})
    where = ", ".join(f"{d} x{sum(r['device'] == d for r in ranks)}" for d in devices)
    head = (f"{run['world_size']} ranks ({run['backend']}) on {run['nodes']} machine(s)" if run["world_size"] > 1
            else "1 process")
    return (f"{head}: {where}, {'/'.join(map(str, threads))} thread(s) each; sharding {run['sharding']}; "
            f"dense model {'onloaded block by block' if run['teacher'] == 'stream' else 'loaded whole'}, "
            f"{run['model_dtype']} weights")


def processor(device: torch.device) -> str:
    """The machine a figure came from, e.g. ``AMD EPYC (x86_64, family 25 model 17, AVX512-BF16)``
    or the GPU's name: timings and step counts compare only between runs on the same one."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return describe_cpu(f.read(), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def describe_cpu(cpuinfo: str, arch: str) -> str:
    """:func:`processor` from the text of ``/proc/cpuinfo``. Two CPUs can share a model name: two
    2-core ``AMD EPYC`` machines, family 25 model 17 and family 26 model 2, both with AVX512-BF16,
    ran the same 12-minute default at steps 1.5-1.8x apart (docs/results-log.md), so the family and
    model numbers are part of the name where the kernel gives them (x86)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's entry
            fields[key.strip()] = value.strip()
    name = fields.get("model name") or platform.processor() or arch
    if "flags" not in fields:
        return name
    flags = set(fields["flags"].split())
    bf16 = "AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "no bf16 instructions"
    family = f"family {fields['cpu family']} model {fields['model']}, " if "cpu family" in fields and "model" in fields \
        else ""
    return f"{name} ({arch}, {family}{bf16})"


def environment(device: torch.device) -> dict:
    """``metrics.json["environment"]``: versions, code, threads and the machine."""
    from .. import __version__

    return {"overrep": __version__, "code": code_fingerprint(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(), "machine": processor(device)}


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A digest of this installation's Python sources (12 hex digits): two runs with the same
    one ran the same code, whether installed from a wheel or a checkout. A comparison grid
    reads it to flag cells written by different versions (:mod:`overrep.app.compare_report`)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


code_fingerprint()  # at import: the code this process loaded, even if the files change while it runs
