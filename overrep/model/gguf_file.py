"""Loading a ``.gguf`` file as a plain ``transformers`` model and the tokenizer it embeds
(the embedded model ships as one; :func:`overrep.model.loading.load_model` converts it once)."""

from __future__ import annotations

import contextlib
import pathlib

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..errors import OverRepError, first_line


def strip_quantization(model: transformers.PreTrainedModel) -> None:
    """Remove any trace of the GGUF quantiser so the model saves and reloads as plain weights.

    With ``GgufConfig(dequantize=True)`` transformers 5.23 already leaves none, but a
    stale ``quantization_config`` in ``config.json`` would make ``from_pretrained`` look
    for a GGUF file that a saved folder does not have.
    """
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


@contextlib.contextmanager
def _gguf_parsed_once():
    """Inside, each GGUF file's metadata is parsed once. transformers parses it for the config,
    again for the tokenizer and again for the weights, and :func:`gguf_special_tokens` a fourth
    time; each parse walks the ~100k vocabulary and merge strings in Python (about 5 s on a 2-core
    CPU for the embedded model). The readers are read-only views of the file, so one serves all."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def load_gguf(path: pathlib.Path, dtype: torch.dtype, attn_implementation: str, placement: dict | None = None):
    """Load a ``.gguf`` file dequantised into a plain model, plus the tokenizer it embeds."""
    with _gguf_parsed_once():
        return _load_gguf_once(path, dtype, attn_implementation, placement)


def _load_gguf_once(path: pathlib.Path, dtype: torch.dtype, attn_implementation: str, placement: dict | None):
    from transformers import GgufConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            **(placement or {}),
        )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise OverRepError(f"cannot load GGUF file '{path}': {first_line(error)}") from error
    strip_quantization(model)
    gguf_special_tokens(path, tokenizer)
    return model, tokenizer


def gguf_special_tokens(path: pathlib.Path, tokenizer) -> None:
    """Give the tokenizer the bos / eos / pad ids the GGUF's own metadata names.

    transformers' GGUF tokenizer conversion has not always read them the same way (5.17 gave
    the embedded model's tokenizer eos id 1, ``<|im_start|>``, where the file and 5.24 say 2),
    and the eos id separates the documents packed into every row: another id, other rows.
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            token = tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0]))
            if token is not None and getattr(tokenizer, f"{role}_token") != token:
                setattr(tokenizer, f"{role}_token", token)
