"""How a run ran: its ranks, their devices and threads, the sharding and how the model was held.

:func:`how_it_ran` is called by every rank (it gathers each rank's host, device and thread
count to rank 0 with one ``all_gather_object`` under ``torchrun``); the result goes into
``metrics.json`` (``run``) and the report's first lines, so that a two-rank run says so.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import resource
import time
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


def _cpu_sample(stat: str | None = None) -> tuple[float, int, float, float, float] | None:
    """(wall clock, CPUs, seconds every CPU was busy, of which stolen by the hypervisor, this
    process's and its waited-for children's CPU seconds), from ``/proc/stat``; None elsewhere."""
    try:
        if stat is None:
            with open("/proc/stat") as f:
                stat = f.read()
        lines = stat.splitlines()
        ticks = [int(v) for v in lines[0].split()[1:]]
        cpus = sum(line.startswith("cpu") and line[3:4].isdigit() for line in lines)
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return time.monotonic(), max(cpus, 1), (user + nice + system + irq + softirq) / hz, steal / hz, own


class CpuMeter:
    """What the rest of the machine took of its CPUs while a stretch of this run ran: the other
    processes' share (every CPU's busy time, less this process's and its children's) and the
    hypervisor's (steal). A time budget buys its steps on the CPU it gets, so a timed run or
    grid cell that shared the machine trained fewer steps; ``metrics.json``'s ``cpu_shared``
    and the report say so. One process only (the ranks of a ``torchrun`` run are each other's
    "others"); Linux only (``/proc/stat``): None elsewhere."""

    def __init__(self) -> None:
        self.start = _cpu_sample()

    def read(self) -> dict | None:
        end = _cpu_sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        wall, cpus = end[0] - self.start[0], end[1]
        others = max(0.0, (end[2] - self.start[2]) - (end[4] - self.start[4]))
        return {"seconds": round(wall, 1), "cpus": cpus, "others_share": round(min(1.0, others / (wall * cpus)), 3),
                "steal_share": round(min(1.0, (end[3] - self.start[3]) / (wall * cpus)), 3)}


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
