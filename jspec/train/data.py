"""Training text: reading files, directories and jsonl; tokenizing; batching."""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, Sequence

import numpy as np

from jspec.util import cdiv


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read training file {path!r}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"training file {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_jsonl(path: str, field: str) -> list[str]:
    docs = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise ValueError(f"{path}:{n}: expected an object with a string {field!r} field")
        docs.append(obj[field])
    return docs


def read_corpus(paths: str | Sequence[str], *, extensions: Sequence[str] | None = None,
                field: str = "text") -> list[str]:
    """Documents from files (plain text, or .jsonl with a `field` per line) and directories
    (walked recursively, keeping files whose name ends with one of `extensions`, default
    all). Raises ValueError for a missing or unreadable path and for an empty corpus."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs.sort()
                for name in sorted(names):
                    if extensions is None or name.endswith(tuple(extensions)):
                        files.append(os.path.join(root, name))
        elif os.path.exists(p):
            files.append(p)
        else:
            raise ValueError(f"training data path {p!r} does not exist")
    docs = []
    for f in files:
        docs.extend(_read_jsonl(f, field) if f.endswith(".jsonl") else [_read_text(f)])
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"the training corpus is empty (no non-empty documents in {list(paths)})")
    return docs


def tokenize(tokenizer, docs: Iterable[str], eos_id: int | None) -> np.ndarray:
    """All documents as one int32 token stream, each followed by `eos_id` (if given)."""
    out = []
    for d in docs:
        ids = tokenizer(d, add_special_tokens=False)["input_ids"]
        out.append(np.asarray(ids, np.int32))
        if eos_id is not None:
            out.append(np.asarray([eos_id], np.int32))
    stream = np.concatenate(out) if out else np.zeros(0, np.int32)
    if stream.size < 2:
        raise ValueError("the training corpus tokenizes to fewer than 2 tokens")
    return stream


def batches(stream: np.ndarray, batch: int, seq_len: int, seed: int, start_step: int = 0) -> Iterator[np.ndarray]:
    """Endless [batch, seq_len] windows at random offsets (deterministic per step)."""
    if stream.size < seq_len + 1:
        reps = cdiv(seq_len + 1, stream.size)
        stream = np.tile(stream, reps)
    step = start_step
    while True:
        rng = np.random.RandomState((seed * 1_000_003 + step) % (2 ** 31))
        starts = rng.randint(0, stream.size - seq_len + 1, size=batch)
        yield np.stack([stream[s: s + seq_len] for s in starts])
        step += 1


def token_counts(stream: np.ndarray, vocab: int) -> np.ndarray:
    return np.bincount(stream, minlength=vocab)[:vocab]


def token_stream(target, data, extensions=None) -> np.ndarray:
    """A trainer's corpus as one token stream: an int array of target ids (checked), or
    text files, directories and .jsonl files tokenized with the target's tokenizer."""
    V = target.config.vocab_size
    if isinstance(data, np.ndarray):
        stream = data.astype(np.int32)
        if stream.ndim != 1 or stream.size < 2:
            raise ValueError("a token-array corpus must be 1-D with at least 2 tokens")
        if stream.min() < 0 or stream.max() >= V:
            raise ValueError("the token-array corpus holds ids outside the target vocabulary")
        return stream
    if target.tokenizer is None:
        raise ValueError("training on text needs the target's tokenizer; its directory has none")
    docs = read_corpus(data, extensions=extensions)
    return tokenize(target.tokenizer, docs, getattr(target.tokenizer, "eos_token_id", None))


TARGET_TEXT_PROMPT = 64  # tokens of the corpus a window of the target's own text starts from


def target_text(target, stream: np.ndarray, windows: int, new_tokens: int, seed: int = 0,
                batch: int = 1024) -> np.ndarray:
    """The target's own text: `windows` windows of TARGET_TEXT_PROMPT tokens drawn from
    `stream` (seeded), each continued by the target, greedy, for `new_tokens` tokens (or
    to its end-of-text token) and followed by one, as one token stream. A drafter trained
    on it and the corpus together learns the text it will be asked to draft
    (docs/training.md)."""
    from jspec.api import generate
    if windows < 1 or new_tokens < 1:
        raise ValueError(f"target text needs windows >= 1 and new_tokens >= 1, got {windows} and {new_tokens}")
    P = TARGET_TEXT_PROMPT
    if stream.size < P:
        raise ValueError(f"the corpus holds {stream.size} tokens, fewer than a window of the target's text ({P})")
    eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else None
    starts = np.random.RandomState(seed).randint(0, stream.size - P + 1, size=windows)
    prompts = [stream[s:s + P].tolist() for s in starts]
    parts = []
    for i in range(0, windows, batch):
        out = generate(target, prompts[i:i + batch], max_new_tokens=new_tokens)
        for prompt, tokens in zip(prompts[i:i + batch], out.tokens):
            end = [eos] if eos is not None and (not tokens or tokens[-1] != eos) else []  # one end-of-text token
            parts.append(np.asarray(prompt + list(tokens) + end, np.int32))
    return np.concatenate(parts)

