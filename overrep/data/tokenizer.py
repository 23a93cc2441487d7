"""A byte-level BPE tokenizer trained in code, for models trained from scratch here.

The hub is not reachable offline, so small models that the project trains itself (the
hybrid Mamba-attention model of ``scripts/train_small_hybrid.py``, the tiny test models)
get their tokenizer from their own training text. Byte-level, so every string encodes.
"""

from __future__ import annotations

EOS = "<eos>"


def train_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A ``PreTrainedTokenizerFast`` with a ``vocab_size`` BPE vocabulary learned on ``texts``;
    ``<eos>`` is its end-of-sequence and padding token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
