"""Peak resident memory of a whole run against the model's size: the dense model loaded whole
(``cache.teacher: model``) against onloaded block by block (``cache.teacher: stream``).

Each case is one ``overrep run`` (prune -> features -> recover a few steps -> merge -> export
-> reload check) in a child process of its own, optionally under a memory cap:

* ``--cap-cgroup SIZE``: the child joins a cgroup-v1 memory group limited to SIZE (root on
  Linux; the kernel reclaims the memory-mapped safetensors pages under the cap and kills the
  child if its own memory passes it). The cap that proves the point.
* ``--cap-as SIZE``: ``RLIMIT_AS`` (``prlimit --as``). It caps *virtual* memory, which
  ``safe_open``'s whole-file memory maps and glibc's per-thread arenas inflate far beyond
  what is resident; docs/scaling.md says what it allows.

Before each case the model's files are dropped from the page cache (``posix_fadvise``
``DONTNEED``): a page already cached stays charged to whoever read it first, and the cap
would not see the run read it. Three peaks are reported: ``ru_maxrss`` (``os.wait4``; it
counts the memory-mapped safetensors pages the process touched, which the kernel drops under
pressure), and, sampled every 0.1 s from ``/proc/PID/status``, the anonymous resident memory
(``RssAnon``: what the run itself needs) and the file-backed part (``RssFile``), and the
peak virtual size (``VmSize``: what ``RLIMIT_AS`` limits). The model's
size is the bytes of its safetensors files. The table goes to stdout, one JSON line per case
after it.

Run:   .venv/bin/python benchmarks/bench_memory.py                                  (embedded, both ways)
       .venv/bin/python benchmarks/bench_memory.py --model /tmp/synthetic-llama --teacher stream \\
           --dtype auto --method plain --remove 16-23 --cap-cgroup 1.5GB
(``benchmarks/synthetic_model.py`` writes the synthetic model.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def model_bytes(spec: str) -> int:
    from overrep.model.onload import snapshot_folder

    folder, _ = snapshot_folder(spec)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def evict(spec: str) -> None:
    """Drop the model's files from the page cache."""
    from overrep.model.onload import snapshot_folder

    folder, _ = snapshot_folder(spec)
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sample(pid: int, peaks: dict, stop) -> None:
    while not stop.wait(0.1):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmRSS", "VmSize"):
                peaks[key] = max(peaks.get(key, 0), int(value.split()[0]) * 1024)


def run_case(a, teacher: str, out: Path) -> dict:
    sets = {"cache.teacher": teacher, "recovery.threads": a.threads, "recovery.batch_size": a.batch,
            "recovery.checkpoint_every": a.steps, "recovery.eval_every": a.steps, "recovery.time_budget": "null",
            "data.seq_len": a.seq_len, "data.train_sequences": a.rows, "data.heldout_sequences": a.heldout,
            "data.validation_sequences": 0, "eval.latency": False, "eval.domains": "null",
            "prune.calibration_sequences": a.batch, "model.dtype": a.dtype, "cache.dir": str(out / "cache")}
    cmd = [sys.executable, "-m", "overrep.app.cli", "run", "--model", a.model, "--max-steps", str(a.steps),
           "--method", a.method,
           "--output", str(out / teacher), "--overwrite", "--quiet"]
    cmd += ["--remove", a.remove] if a.remove else ["--ratio", str(a.ratio)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    group = None
    if a.cap_cgroup:
        group = CGROUP_ROOT / f"overrep-bench-{os.getpid()}"
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(_size(a.cap_cgroup)))
        if (group / "memory.memsw.limit_in_bytes").exists():  # no swap either
            (group / "memory.memsw.limit_in_bytes").write_text(str(_size(a.cap_cgroup)))

    def enter() -> None:  # in the child, before exec: the cap applies to the run only
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))
        if a.cap_as:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (_size(a.cap_as), _size(a.cap_as)))

    import threading

    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    evict(a.model)
    peaks: dict = {}
    stop = threading.Event()
    with open(out / f"{teacher}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=enter)
        sampler = threading.Thread(target=_sample, args=(proc.pid, peaks, stop), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
    stop.set()
    sampler.join()
    cgroup = {}
    if group is not None:
        cgroup = {k: int((group / f"memory.{k}").read_text()) for k in ("failcnt", "max_usage_in_bytes")}
        group.rmdir()
    metrics_file = out / teacher / "metrics.json"
    m = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    return {"model": a.model, "model_bytes": model_bytes(a.model), "teacher": teacher, "dtype": a.dtype,
            "method": a.method,
            "cap_cgroup": a.cap_cgroup, "cap_as": a.cap_as, "exit": os.waitstatus_to_exitcode(status),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "peak_rss_anon_bytes": peaks.get("RssAnon"),
            "peak_rss_file_bytes": peaks.get("RssFile"), "peak_virtual_bytes": peaks.get("VmSize"), "cgroup": cgroup,
            "steps": m.get("train_steps"), "removed": m.get("removed_layers"),
            "dense_ppl": m.get("dense_ppl"), "recovered_ppl": m.get("recovered_ppl"),
            "export_reload_max_abs_diff": m.get("export_reload_max_abs_diff"), "log": str(out / f"{teacher}.log")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--teacher", choices=("model", "stream", "both"), default="both")
    ap.add_argument("--remove", default=None, help="blocks removed (default: --ratio with the cosine criterion)")
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--rows", type=int, default=16, help="training sequences")
    ap.add_argument("--heldout", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="float32", help="model.dtype")
    ap.add_argument("--method", default="overrep", help="recovery.method (plain: the same blocks, no W or D: the "
                                                        "smallest training state)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cap-cgroup", help="memory cap through a cgroup-v1 memory group, e.g. 2GB")
    ap.add_argument("--cap-as", help="RLIMIT_AS cap, e.g. 6GB")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="bench-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_case(a, t, out) for t in (("model", "stream") if a.teacher == "both" else (a.teacher,))]
    print(f"{'model':28s} {'safetensors':>12s} {'teacher':8s} {'cap':>8s} {'exit':>4s} {'peak RSS':>10s} "
          f"{'RSS/model':>9s} {'anon RSS':>9s} {'anon/model':>10s} {'reload diff':>11s}")
    for r in rows:
        cap = r["cap_cgroup"] or (f"AS {r['cap_as']}" if r["cap_as"] else "-")
        diff = r["export_reload_max_abs_diff"]
        print(f"{Path(r['model']).name[:28]:28s} {r['model_bytes'] / 1e9:>10.2f}GB {r['teacher']:8s} {cap:>8s} "
              f"{r['exit']:>4d} {r['peak_rss_bytes'] / 1e9:>8.2f}GB {r['peak_rss_bytes'] / r['model_bytes']:>9.2f} "
              f"{(r['peak_rss_anon_bytes'] or 0) / 1e9:>7.2f}GB {(r['peak_rss_anon_bytes'] or 0) / r['model_bytes']:>10.2f} "
              f"{'-' if diff is None else f'{diff:.1e}':>11s}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
