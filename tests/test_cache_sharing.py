"""Runs that share feature caches: one builds while another waits (no feature computed twice,
no shard deleted under its writer), and ``overrep cache --clean`` removes the caches a larger
one of the same rows serves, never one a run holds."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_cache import FP, H, N, T, Producer, build_rows, make_data

from overrep.app.cli import main
from overrep.data.cache import build_or_open
from overrep.data.cache.lock import CacheLock, lock_file
from overrep.data.cache.prefix import clean


class SlowProducer(Producer):
    def __call__(self, rows: range):
        time.sleep(0.05)
        return super().__call__(rows)


def test_two_runs_wanting_one_cache_build_it_once(tmp_path):
    data, got, producers = make_data(), {}, [SlowProducer(make_data()), SlowProducer(make_data())]

    def run(i):
        got[i] = build_or_open(tmp_path / "c", fingerprint=FP, num_samples=N, seq_len=T, hidden_size=H,
                               dtype=torch.float32, produce=producers[i], shard_size=2, progress=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # the first has the lock
    for t in threads:
        t.join(timeout=30)
    assert sorted(len(p.calls) for p in producers) == [0, 5]  # one built all five shards, the other none
    for fc in got.values():
        assert torch.equal(fc.get(list(range(N)))["targets"], data["targets"])


def test_a_reader_holds_its_cache_shared(tmp_path):
    fc, _ = build_rows(tmp_path / "c", make_data(), N)
    other = CacheLock(tmp_path / "c")
    assert not other.exclusive(wait=False)  # the reader's shared lock keeps a cleaner out
    assert other.shared(wait=False)  # and lets other readers in
    other.release()
    view = fc.first(4)
    del fc  # a view of the first rows keeps the lock too
    assert not CacheLock(tmp_path / "c").exclusive(wait=False)
    del view
    assert CacheLock(tmp_path / "c").exclusive(wait=False)


def test_clean_removes_the_caches_a_larger_one_serves_and_keeps_the_rest(tmp_path):
    data = make_data()
    root = tmp_path / "features"
    build_rows(root / "six", data, 6)
    build_rows(root / "eight", data, 8, rebuild="always")  # (rebuild: not fed from six, a cache of its own)
    build_rows(root / "other", make_data(seed=1), 6, fingerprint={**FP, "data": "zzz"})  # other rows: kept
    whole, _ = build_rows(root / "whole", data, N, rebuild="always")
    del whole
    partial = root / "partial"
    partial.mkdir()
    (partial / "fingerprint.json").write_text("{}")
    held, _ = build_rows(root / "eight", data, 8)  # a run reading it
    lock_file(root / "gone").touch()  # the lock of a folder removed by hand

    assert {d["folder"].rsplit("/", 1)[1]: d["action"] for d in clean(root, "rows", dry_run=True)} == {
        "six": "would remove", "eight": "kept", "partial": "kept"}
    assert (root / "six").is_dir() and lock_file(root / "gone").exists()
    done = {d["folder"].rsplit("/", 1)[1]: d for d in clean(root, "rows")}
    assert done["six"]["action"] == "removed" and "first of the 10" in done["six"]["why"]
    assert done["eight"]["why"] == "in use by a run" and "partial build" in done["partial"]["why"]
    assert sorted(p.name for p in root.iterdir()) == [".eight.lock", ".other.lock", ".whole.lock", "eight",
                                                       "other", "partial", "whole"]
    del held
    assert [d["action"] for d in clean(root, "rows") if d["folder"].endswith("eight")] == ["removed"]
    assert not (root / "eight").exists() and not lock_file(root / "eight").exists()
    fc, producer = build_rows(root / "six", data, 6)  # what it held is served by the largest
    assert producer.calls == [] and fc.path == root / "whole"


def test_clean_keeps_what_a_corrupt_larger_cache_would_serve(tmp_path):
    data = make_data()
    build_rows(tmp_path / "six", data, 6)
    build_rows(tmp_path / "whole", data, N, rebuild="always")
    shard = tmp_path / "whole" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    (d,) = clean(tmp_path, "rows")
    assert d["action"] == "kept" and "fails its check" in d["why"] and (tmp_path / "six").is_dir()


def test_cache_clean_on_the_command_line(tmp_path, capsys):
    data = make_data()
    build_rows(tmp_path / "features" / "six", data, 6)
    build_rows(tmp_path / "features" / "whole", data, N, rebuild="always")
    assert main(["cache", "--clean", "--dry-run", "--set", f"cache.dir={tmp_path}"]) == 0
    assert "would remove" in capsys.readouterr().out and (tmp_path / "features" / "six").is_dir()
    assert main(["cache", "--clean", "--set", f"cache.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "removed" in out and "freed" in out and not (tmp_path / "features" / "six").exists()
    assert main(["cache", "--dry-run", "--set", f"cache.dir={tmp_path}"]) == 2
    assert "--dry-run goes with --clean" in capsys.readouterr().err


@pytest.mark.parametrize("first", ["exclusive", "shared"])
def test_a_lock_waits_for_a_builder(tmp_path, first):
    builder = CacheLock(tmp_path / "c")
    builder.exclusive()
    assert not getattr(CacheLock(tmp_path / "c"), first)(wait=False)
    waiter, took = CacheLock(tmp_path / "c"), []
    t = threading.Thread(target=lambda: took.append(getattr(waiter, first)()))
    t.start()
    time.sleep(0.1)
    assert not took
    builder.release()
    t.join(timeout=10)
    assert took == [True]


def test_a_filesystem_without_flock_is_a_one_line_error(tmp_path, monkeypatch):
    import errno

    from overrep.data.cache import lock as lock_mod
    from overrep.errors import OverRepError

    def no_flock(fd, mode):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_mod.fcntl, "flock", no_flock)
    with pytest.raises(OverRepError, match="cannot lock the feature cache .*No locks available.*cache.dir"):
        build_rows(tmp_path / "c", make_data(), N)
    assert not (tmp_path / "c").exists()


def test_a_process_rebuilding_a_cache_it_reads_does_not_wait_for_itself(tmp_path):
    data = make_data()
    first, _ = build_rows(tmp_path / "c", data, N)
    again, producer = build_rows(tmp_path / "c", data, N, rebuild="always")  # `first` still alive
    assert len(producer.calls) == 3 and torch.equal(again.get([9])["inputs"], data["inputs"][9:10])


def test_two_processes_that_want_one_cache_build_it_once(assets, tmp_path):
    """Held by another process while both start: both wait, then one builds it and the other reads it."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tiny import tiny_cfg

    cfg = tmp_path / "cfg.yaml"
    tiny_cfg(assets, tmp_path / "run", eval__perplexity=False, eval__latency=False).save(cfg)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}

    def cache(name):
        log = (tmp_path / f"{name}.err").open("w")
        return subprocess.Popen([sys.executable, "-m", "overrep.app.cli", "cache", "--config", str(cfg), "--quiet",
                                 "--output", str(tmp_path / name)], env=env, stdout=subprocess.PIPE, stderr=log,
                                text=True)

    def path_of(stdout):
        return json.loads(stdout[stdout.index("{"):])["path"]

    first = cache("probe")
    folder = Path(path_of(first.communicate(timeout=300)[0]))
    assert first.returncode == 0, (tmp_path / "probe.err").read_text()
    shutil.rmtree(folder)
    holder = CacheLock(folder)
    holder.exclusive()
    runs, deadline = [cache("a"), cache("b")], time.monotonic() + 240
    while time.monotonic() < deadline and not all("waiting for it" in (tmp_path / f"{n}.err").read_text()
                                                  for n in "ab"):
        assert all(r.poll() is None for r in runs), "a run did not wait for the cache's holder"
        time.sleep(0.2)
    holder.release()
    outs = [r.communicate(timeout=300)[0] for r in runs]
    errs = [(tmp_path / f"{n}.err").read_text() for n in "ab"]
    assert [r.returncode for r in runs] == [0, 0], errs
    assert all("waiting for it" in e for e in errs)
    assert sum("building feature cache" in e for e in errs) == 1  # one built it, the other read it
    assert {path_of(o) for o in outs} == {str(folder)}
