"""Tiny random Hugging Face models saved to temp dirs, for tests (nothing from a hub)."""
from __future__ import annotations

import os

import torch
import transformers

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
VOCAB = 300


def hf_config(family: str = "llama", *, tie: bool = False, vocab: int = VOCAB, hidden: int = 64,
              layers: int = 2, heads: int = 4, kv_heads: int = 2, inter: int = 128, **kw):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tie,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  initializer_range=0.2)
    common.update(kw)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        common.setdefault("head_dim", 32)
        return transformers.Qwen3Config(**common)
    if family == "mistral":
        common.setdefault("sliding_window", None)
        return transformers.MistralConfig(**common)
    raise ValueError(family)


def save_tokenizer(path: str):
    """A byte-level tokenizer: 3 specials (<pad>, <s>, </s>) then the 256 byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    table = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch, b in _bytes_to_unicode().items():
        table[ch] = 3 + b
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.save_pretrained(path)


def _bytes_to_unicode():
    """GPT-2's printable stand-in character for each byte: {char: byte}."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def make_model(path: str, family: str = "llama", *, seed: int = 0, tokenizer: bool = False,
               dtype=torch.float32, max_shard_size=None, **kw) -> transformers.PreTrainedModel:
    cfg = hf_config(family, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    os.makedirs(path, exist_ok=True)
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **extra)
    if tokenizer:
        save_tokenizer(path)
    return model
