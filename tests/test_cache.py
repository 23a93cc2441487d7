"""Tests for the feature cache (overrep.data): round trips, random access, resume, staleness, corruption, ENOSPC."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest
import torch

from overrep.data.cache import writer as cache_mod  # its `os`, to fake a full disk / count preadv calls
from overrep.data.cache import (
    FeatureCache,
    FeatureCacheCorrupt,
    FeatureCacheMismatch,
    FeatureCacheWriter,
    build_or_open,
)
from overrep.recovery.sampler import epoch_batches
from overrep.errors import OverRepError

N, T, H = 10, 4, 6
FP = {"model": "tiny", "segment": [3, 5], "data": "abc123"}


def make_data(n=N, dtype=torch.float32, seed=0):
    """Deterministic fake features: {"inputs": [n, T, H], "targets": [n, T, H]}."""
    g = torch.Generator().manual_seed(seed)
    return {
        "inputs": torch.randn(n, T, H, generator=g).to(dtype),
        "targets": torch.randn(n, T, H, generator=g).to(dtype),
    }


class Producer:
    """produce() callback that records which sample ranges it was asked for."""

    def __init__(self, data):
        self.data = data
        self.calls: list[range] = []

    def __call__(self, rows: range):
        self.calls.append(rows)
        return {k: v[rows.start:rows.stop].clone() for k, v in self.data.items()}


def build(path, data, *, fingerprint=FP, dtype=torch.float32, shard_size=4, rebuild="auto"):
    producer = Producer(data)
    fc = build_or_open(path, fingerprint=fingerprint, num_samples=len(data["inputs"]), seq_len=T, hidden_size=H,
                       dtype=dtype, produce=producer, shard_size=shard_size, rebuild=rebuild, progress=False)
    return fc, producer


def stray_files(path):
    return sorted(p.name for p in path.iterdir() if ".tmp-" in p.name)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_exact(tmp_path, dtype):
    data = make_data(dtype=dtype)
    fc, producer = build(tmp_path / "c", data, dtype=dtype)
    assert len(fc) == N and fc.dtype == dtype
    assert [len(r) for r in producer.calls] == [4, 4, 2]  # last shard is short
    out = fc.get(range(N))
    for name in ("inputs", "targets"):
        assert out[name].dtype == dtype and out[name].shape == (N, T, H)
        assert torch.equal(out[name], data[name])
    # Reopened from disk with full verification: identical again.
    fc2 = FeatureCache.open(tmp_path / "c", fingerprint=FP)
    assert torch.equal(fc2.get([7])["targets"], data["targets"][7:8])
    assert fc2.nbytes == sum(p.stat().st_size for p in (tmp_path / "c").glob("shard-*.safetensors"))
    m = fc2.manifest
    assert m["fingerprint"] == FP and m["layout"]["dtype"] == str(dtype).removeprefix("torch.")
    assert m["shapes"]["inputs"] == [N, T, H] and len(m["shards"]) == 3
    assert all(len(s["sha256"]) == 64 and s["size"] > 0 for s in m["shards"])
    # what building it cost stays with it: a reopened (reused) cache still states it
    assert all(s["seconds"] >= 0 for s in m["shards"]) and fc2.build_seconds == pytest.approx(fc.build_seconds)
    assert fc2.build_seconds == pytest.approx(sum(s["seconds"] for s in m["shards"]))


def test_written_shards_are_valid_safetensors(tmp_path):
    from safetensors.torch import load_file

    data = make_data()
    build(tmp_path, data)
    loaded = load_file(str(tmp_path / "shard-00001.safetensors"))
    assert torch.equal(loaded["inputs"], data["inputs"][4:8])


def test_get_arbitrary_order_and_duplicates(tmp_path):
    data = make_data()
    fc, _ = build(tmp_path, data)
    idx = [9, 0, 5, 4, 6, 5, 3, 1, 9, 2]  # crosses shards, non-contiguous, repeats
    out = fc.get(idx)
    assert torch.equal(out["inputs"], data["inputs"][idx])
    assert torch.equal(out["targets"], data["targets"][idx])
    assert fc.get([])["inputs"].shape == (0, T, H)
    with pytest.raises(IndexError):
        fc.get([N])


def test_reader_pickles_and_reopens_handles(tmp_path):
    import pickle

    data = make_data()
    fc, _ = build(tmp_path, data)
    fc.get([1, 8])  # opens handles
    clone = pickle.loads(pickle.dumps(fc))
    assert torch.equal(clone.get([8])["inputs"], data["inputs"][8:9])


def test_handle_lru_is_bounded(tmp_path, monkeypatch):
    data = make_data()
    fc, _ = build(tmp_path, data, shard_size=2)
    monkeypatch.setattr(fc, "max_open_shards", 2)
    out = fc.get([0, 2, 4, 6, 8, 1])
    assert len(fc._files) == 2
    assert torch.equal(out["inputs"], data["inputs"][[0, 2, 4, 6, 8, 1]])


# --------------------------------------------------------------------------- reuse / resume


def test_existing_cache_is_reused(tmp_path):
    data = make_data()
    build(tmp_path, data)
    fc, producer = build(tmp_path, data)
    assert producer.calls == []
    assert torch.equal(fc.get([3])["inputs"], data["inputs"][3:4])


def test_resume_after_kill_produces_only_missing(tmp_path):
    data = make_data()
    # Simulated kill: two shards written, never finalized, plus a leftover temp file.
    w = FeatureCacheWriter(tmp_path, fingerprint=FP, num_samples=N, seq_len=T, hidden_size=H, shard_size=4)
    for s in (0, 2):
        r = w.shard_range(s)
        w.write_shard(s, inputs=data["inputs"][r.start:r.stop], targets=data["targets"][r.start:r.stop])
    (tmp_path / ".shard-00001.safetensors.tmp-deadbeef").write_bytes(b"partial")
    assert not (tmp_path / "manifest.json").exists()
    assert (tmp_path / "fingerprint.json").exists()

    fc, producer = build(tmp_path, data)
    assert producer.calls == [range(4, 8)]
    assert stray_files(tmp_path) == []
    assert torch.equal(fc.get(range(N))["inputs"], data["inputs"])


def test_shard_without_sidecar_is_rewritten(tmp_path):
    """Killed between the shard rename and its sidecar: the shard is not trusted."""
    data = make_data()
    build(tmp_path, data)
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "shard-00001.json").unlink()
    fc, producer = build(tmp_path, data)
    assert producer.calls == [range(4, 8)]
    assert torch.equal(fc.get(range(N))["targets"], data["targets"])


def test_writer_missing_shards_and_finalize_incomplete(tmp_path):
    w = FeatureCacheWriter(tmp_path, fingerprint=FP, num_samples=N, seq_len=T, hidden_size=H, shard_size=4)
    assert w.missing_shards() == [0, 1, 2]
    assert w.shard_range(2) == range(8, 10)
    with pytest.raises(OverRepError, match="incomplete"):
        w.finalize()
    with pytest.raises(OverRepError, match="shape"):
        w.write_shard(0, inputs=torch.zeros(3, T, H), targets=torch.zeros(3, T, H))
    with pytest.raises(OverRepError, match="tensors"):
        w.write_shard(0, inputs=torch.zeros(4, T, H))


# --------------------------------------------------------------------------- staleness


def test_fingerprint_mismatch_rebuilds_with_auto(tmp_path, caplog):
    build(tmp_path, make_data(seed=0))
    (tmp_path / "unrelated.txt").write_text("keep me")
    new_fp = {**FP, "segment": [4, 6]}
    new_data = make_data(seed=1)
    with caplog.at_level(logging.WARNING, logger="overrep.data.cache"):
        fc, producer = build(tmp_path, new_data, fingerprint=new_fp)
    assert "field 'segment' differs" in caplog.text
    assert len(producer.calls) == 3
    assert fc.manifest["fingerprint"] == new_fp
    assert torch.equal(fc.get(range(N))["inputs"], new_data["inputs"])
    assert (tmp_path / "unrelated.txt").read_text() == "keep me"  # only our files are deleted


def test_fingerprint_mismatch_raises_with_never(tmp_path):
    build(tmp_path, make_data())
    with pytest.raises(OverRepError) as exc:
        build(tmp_path, make_data(), fingerprint={**FP, "segment": [4, 6]}, rebuild="never")
    msg = str(exc.value)
    assert "different model/segment/data" in msg and "'segment'" in msg and "cache.rebuild: auto" in msg
    assert str(tmp_path) in msg and "\n" not in msg
    assert FeatureCache.open(tmp_path, fingerprint=FP)  # untouched


def test_partial_build_with_other_fingerprint_is_discarded(tmp_path):
    w = FeatureCacheWriter(tmp_path, fingerprint=FP, num_samples=N, seq_len=T, hidden_size=H, shard_size=4)
    w.write_shard(0, **{k: v[:4] for k, v in make_data().items()})
    with pytest.raises(OverRepError, match="'data' differs"):
        build(tmp_path, make_data(), fingerprint={**FP, "data": "zzz"}, rebuild="never")
    fc, producer = build(tmp_path, make_data(), fingerprint={**FP, "data": "zzz"})
    assert len(producer.calls) == 3


def test_layout_change_is_a_mismatch(tmp_path):
    build(tmp_path, make_data())
    with pytest.raises(OverRepError, match="'dtype'"):
        build(tmp_path, make_data(dtype=torch.bfloat16), dtype=torch.bfloat16, rebuild="never")


def test_open_with_other_fingerprint_raises(tmp_path):
    build(tmp_path, make_data())
    with pytest.raises(FeatureCacheMismatch, match="'model' differs"):
        FeatureCache.open(tmp_path, fingerprint={**FP, "model": "other"})
    with pytest.raises(FeatureCacheCorrupt, match="manifest.json is missing"):
        FeatureCache.open(tmp_path / "nowhere")


# --------------------------------------------------------------------------- corruption


def test_truncated_shard_detected(tmp_path):
    build(tmp_path, make_data())
    shard = tmp_path / "shard-00001.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 16)
    for verify in (True, False):  # size check runs even without hashing
        with pytest.raises(FeatureCacheCorrupt, match="shard-00001.safetensors"):
            FeatureCache.open(tmp_path, verify=verify)


def test_flipped_byte_detected(tmp_path):
    build(tmp_path, make_data())
    shard = tmp_path / "shard-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01  # inside the tensor data: header still parses, size unchanged
    shard.write_bytes(bytes(raw))
    with pytest.raises(FeatureCacheCorrupt, match="shard-00002.safetensors.*sha256"):
        FeatureCache.open(tmp_path)
    FeatureCache.open(tmp_path, verify=False)  # hashing skipped: not detected, by design


def test_corrupt_shard_rebuilt_with_auto_raises_with_never(tmp_path):
    data = make_data()
    build(tmp_path, data)
    shard = tmp_path / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(OverRepError, match="shard-00000.safetensors.*cache.rebuild: auto"):
        build(tmp_path, data, rebuild="never")
    fc, producer = build(tmp_path, data)
    assert producer.calls == [range(0, 4)]  # only the bad shard is produced again
    assert torch.equal(fc.get(range(N))["inputs"], data["inputs"])


def test_malformed_manifest_is_rebuilt(tmp_path):
    data = make_data()
    build(tmp_path, data)
    (tmp_path / "manifest.json").write_text("{not json")
    fc, producer = build(tmp_path, data)
    assert producer.calls == []  # shards were fine; only the manifest is rewritten
    assert torch.equal(fc.get([2])["inputs"], data["inputs"][2:3])


# --------------------------------------------------------------------------- ENOSPC


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc to map fds to files")
@pytest.mark.parametrize("failing_file", [".shard-00001.safetensors.tmp-", ".shard-00001.json.tmp-"])
def test_enospc_raises_and_leaves_no_stray_files(tmp_path, monkeypatch, failing_file):
    """The disk fills up while flushing the shard data, or its sidecar after the shard's rename."""
    data = make_data()
    w = FeatureCacheWriter(tmp_path, fingerprint=FP, num_samples=N, seq_len=T, hidden_size=H, shard_size=4)
    w.write_shard(0, **{k: v[:4] for k, v in data.items()})
    before = sorted(p.name for p in tmp_path.iterdir())

    real_fsync, failed = os.fsync, []

    def full_disk_fsync(fd):
        if failing_file in os.readlink(f"/proc/self/fd/{fd}"):
            failed.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(cache_mod.os, "fsync", full_disk_fsync)
    with pytest.raises(OverRepError, match="no space left on device.*cache.mode: live") as exc:
        w.write_shard(1, **{k: v[4:8] for k, v in data.items()})
    assert str(tmp_path) in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp file, no half shard
    assert failed and w.missing_shards() == [1, 2]


# --------------------------------------------------------------------------- batches


def test_epoch_batches_deterministic():
    a = epoch_batches(103, 8, seed=1, epoch=3)
    assert a == epoch_batches(103, 8, seed=1, epoch=3)
    assert a != epoch_batches(103, 8, seed=1, epoch=4)
    assert a != epoch_batches(103, 8, seed=2, epoch=3)
    assert len(a) == 12 and all(len(b) == 8 for b in a)
    flat = [i for b in a for i in b]
    assert len(set(flat)) == len(flat)

    full = epoch_batches(103, 8, seed=1, epoch=3, drop_last=False)
    assert full[:12] == a and len(full[-1]) == 7
    assert sorted(i for b in full for i in b) == list(range(103))


def test_epoch_batches_errors():
    with pytest.raises(OverRepError, match="batch_size"):
        epoch_batches(10, 0, seed=0, epoch=0)
    with pytest.raises(OverRepError, match="no full batch"):
        epoch_batches(3, 8, seed=0, epoch=0)


def test_manifest_is_last_and_json(tmp_path):
    build(tmp_path, make_data())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["format"] == "overrep-feature-cache" and manifest["version"] == 1
    assert json.loads((tmp_path / "fingerprint.json").read_text())["fingerprint"] == FP


@pytest.mark.skipif(not hasattr(os, "preadv"), reason="byte accounting hooks os.preadv")
def test_get_reads_only_requested_rows(tmp_path, monkeypatch):
    data = make_data(n=16)
    fc, _ = build(tmp_path, data, shard_size=16)
    fc.get([0])  # open the shard (header read) before counting
    real_preadv, requested = os.preadv, []

    def counting_preadv(fd, buffers, offset):
        requested.append(sum(len(b) for b in buffers))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(cache_mod.os, "preadv", counting_preadv)
    row_bytes = T * H * 4
    out = fc.get([5])
    assert sum(requested) == 2 * row_bytes  # one row of "inputs" and one of "targets"
    requested.clear()
    out = fc.get([9, 3, 4, 5, 9])  # runs [3, 6) and [9, 10); the duplicate 9 is not re-read
    assert sorted(requested) == [row_bytes, row_bytes, 3 * row_bytes, 3 * row_bytes]  # per tensor
    assert torch.equal(out["targets"], data["targets"][[9, 3, 4, 5, 9]])


# --------------------------------------------------------------------------- a cache of the same rows


def build_rows(path, data, n, *, fingerprint=FP, rebuild="auto"):
    """A cache of the first ``n`` rows of ``data`` whose fingerprint counts them (Teacher.use_rows)."""
    producer = Producer(data)
    fp = {**fingerprint, "rows": n} if n < len(data["inputs"]) else fingerprint
    fc = build_or_open(path, fingerprint=fp, num_samples=n, seq_len=T, hidden_size=H, dtype=torch.float32, produce=producer,
                       shard_size=4, rebuild=rebuild, progress=False, prefix_key="rows")
    return fc, producer


def test_a_cache_of_more_of_the_same_rows_serves_the_first_of_them(tmp_path):
    data = make_data()
    whole, _ = build_rows(tmp_path / "whole", data, N)
    fc, producer = build_rows(tmp_path / "part", data, 6)
    assert producer.calls == [] and len(fc) == 6 and fc.path == tmp_path / "whole"
    assert not (tmp_path / "part").exists()
    assert torch.equal(fc.get([5, 0])["targets"], data["targets"][[5, 0]])
    with pytest.raises(IndexError):
        fc.get([6])
    # what those rows cost to build: the shards' recorded seconds, a shard read in part in proportion
    shards = whole.manifest["shards"]
    assert fc.build_seconds == pytest.approx(shards[0]["seconds"] + shards[1]["seconds"] / 2)


def test_a_cache_of_fewer_of_the_same_rows_feeds_the_leading_rows_of_a_bigger_one(tmp_path, caplog):
    data = make_data()
    small, _ = build_rows(tmp_path / "small", data, 6)
    with caplog.at_level(logging.INFO, logger="overrep.data.cache"):
        fc, producer = build_rows(tmp_path / "big", data, N)
    assert producer.calls == [range(6, 8), range(8, 10)]  # shards [4, 8) in part, [8, 10) whole
    assert fc.path == tmp_path / "big" and len(fc) == N
    for k in ("inputs", "targets"):
        assert torch.equal(fc.get(list(range(N)))[k], data[k])
    assert "6 of its 10 rows read from the cache" in caplog.text
    # the rows read count at what the smaller cache recorded for them
    assert fc.build_seconds >= small.build_seconds
    assert FeatureCache.open(tmp_path / "big", fingerprint=FP, verify=True).get([7])["inputs"].equal(data["inputs"][7:8])


def test_no_rows_are_read_from_a_cache_of_other_data_or_under_rebuild_always(tmp_path):
    data = make_data()
    build_rows(tmp_path / "other", make_data(seed=1), N, fingerprint={**FP, "data": "zzz"})
    fc, producer = build_rows(tmp_path / "mine", data, 6)
    assert len(producer.calls) == 2 and fc.path == tmp_path / "mine"
    assert torch.equal(fc.get([1])["inputs"], data["inputs"][1:2])
    _, producer = build_rows(tmp_path / "again", data, 4, rebuild="always")
    assert producer.calls == [range(0, 4)]


def test_a_corrupt_cache_of_the_same_rows_is_passed_over(tmp_path, caplog):
    data = make_data()
    build_rows(tmp_path / "whole", data, N)
    shard = tmp_path / "whole" / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        fc, producer = build_rows(tmp_path / "part", data, 6)
    assert "sha256" in caplog.text and len(producer.calls) == 2 and fc.path == tmp_path / "part"
    assert torch.equal(fc.get([0])["inputs"], data["inputs"][0:1])
    # the next that holds the rows serves them: a corrupt cache of 8 passed over for one of 10
    build_rows(tmp_path / "whole", data, N, rebuild="always")
    build_rows(tmp_path / "eight", data, 8, rebuild="always")  # (built, not served by the one of 10)
    shard = tmp_path / "eight" / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    fc, producer = build_rows(tmp_path / "seven", data, 7)
    assert producer.calls == [] and fc.path == tmp_path / "whole" and len(fc) == 7
