"""A byte-level BPE tokenizer trained with the `tokenizers` library."""
from __future__ import annotations

from typing import Iterable

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_bpe(docs: Iterable[str], vocab_size: int, *, min_frequency: int = 2):
    """-> a transformers PreTrainedTokenizerFast (byte-level BPE, EOS and PAD specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258 + 2:
        raise ValueError(f"vocab_size must be at least 260 (bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
