"""A constraint compiled for a tokenizer: a deterministic automaton over token ids
(outlines-core's `Index` of the constraint's regular expression over the vocabulary's
byte strings), renumbered 0..Q-1, with one more state for a finished constraint.

- `allowed[q]`: the token ids state q may emit (a final state's include EOS);
- `next_state(q, t)`: the state after q emits t (EOS from a final state: `done`);
- `terminal[q]`: q allows nothing but EOS: the constraint is complete there, and a
  request that reaches it ends (finish reason "stop") without emitting more.

Compiled automata are cached by the constraint's text and the tokenizer's vocabulary.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib

import numpy as np

from jspec.constraints.kinds import Constraint


@dataclasses.dataclass(eq=False)
class Automaton:
    """Q states (the last: `done`); transitions[q]: {token: next state}."""

    initial: int
    transitions: list  # [Q] dicts
    terminal: np.ndarray  # [Q] bool
    eos: int
    vocab_size: int
    key: str

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    @property
    def done(self) -> int:
        return len(self.transitions) - 1

    def walk(self, tokens, state: int | None = None) -> int:
        """The state after `tokens` from `state` (None: the initial state); ValueError if
        the constraint does not allow them."""
        q = self.initial if state is None else state
        for t in tokens:
            nxt = self.transitions[q].get(int(t))
            if nxt is None:
                raise ValueError(f"token {t} is not allowed by the constraint in state {q}")
            q = nxt
        return q

    def edges(self) -> int:
        return sum(len(tr) for tr in self.transitions)


def byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the
    others for code points from 256 up, in byte order -> {character: byte}."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Each ordinary token id's bytes (special tokens left out): byte-level BPE through its
    alphabet, SentencePiece pieces with their '▁' spaces and <0xNN> byte tokens, any other
    by decoding it alone."""
    special = set(tokenizer.all_special_ids)
    try:
        decoder = repr(tokenizer.backend_tokenizer.decoder)
    except AttributeError:
        decoder = ""
    byte_level = "ByteLevel" in decoder
    alphabet = byte_decoder()
    out = {}
    for i in range(len(tokenizer)):
        if i in special:
            continue
        piece = tokenizer.convert_ids_to_tokens(i)
        if piece is None:
            continue
        if byte_level and all(c in alphabet for c in piece):
            out[i] = bytes(alphabet[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes([int(piece[3:5], 16)])
        elif "▁" in piece or "Metaspace" in decoder:
            out[i] = piece.replace("▁", " ").encode()
        else:
            out[i] = tokenizer.decode([i]).encode()
    return out


@functools.lru_cache(maxsize=8)
def _vocabulary(tokenizer_key: str, tokenizer):
    from outlines_core import Vocabulary
    by_bytes = collections.defaultdict(list)
    for i, b in token_bytes(tokenizer).items():
        if b:
            by_bytes[b].append(i)
    return Vocabulary(tokenizer.eos_token_id, dict(by_bytes))


def tokenizer_key(tokenizer) -> str:
    """What identifies the tokenizer's vocabulary (computed once per tokenizer object)."""
    cached = getattr(tokenizer, "_jspec_vocab_key", None)
    if cached is None:
        vocab = tokenizer.get_vocab()
        text = repr((type(tokenizer).__name__, tokenizer.eos_token_id, sorted(vocab.items()), len(vocab)))
        cached = hashlib.sha1(text.encode()).hexdigest()
        try:
            tokenizer._jspec_vocab_key = cached
        except AttributeError:  # a tokenizer that takes no attributes: computed every call
            pass
    return cached


_CACHE: collections.OrderedDict = collections.OrderedDict()
CACHE_SIZE = 64


def clear_cache() -> None:
    """Forgets every compiled automaton (the vocabularies built for outlines-core stay)."""
    _CACHE.clear()


def compile_constraint(constraint: Constraint, tokenizer, vocab_size: int) -> Automaton:
    """`constraint` compiled for `tokenizer` (cached by its text and the vocabulary).
    ValueError: no tokenizer, no EOS token, an invalid constraint, or one no token
    sequence can satisfy."""
    if tokenizer is None:
        raise ValueError("a constraint needs the model's tokenizer (these params have none)")
    if tokenizer.eos_token_id is None:
        raise ValueError("a constraint needs the tokenizer's EOS token (it has none)")
    try:
        from outlines_core import Index
    except ImportError as err:  # pragma: no cover - the extra is installed with the tests
        raise ImportError("constraints need outlines-core: pip install 'jspec[structured]'") from err
    tkey = tokenizer_key(tokenizer)
    regex = constraint.regex()  # (a JSON schema's translation: once a call)
    name = f"{type(constraint).__name__}:{regex}"
    key = (name, tkey, vocab_size)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    try:
        index = Index(regex, _vocabulary(tkey, tokenizer))
    except Exception as err:  # outlines-core's own error types
        raise ValueError(f"{type(constraint).__name__}: cannot compile {regex[:200]!r}: {err}") from err
    automaton = from_index(index, tokenizer.eos_token_id, vocab_size, name)
    _CACHE[key] = automaton
    if len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return automaton


def from_index(index, eos: int, vocab_size: int, key: str) -> Automaton:
    """outlines-core's Index renumbered (its initial state first) with a `done` state
    after EOS; ValueError if the initial state allows no token (an empty language)."""
    raw = index.get_transitions()
    finals = set(index.get_final_states())
    initial = index.get_initial_state()
    order = [initial] + sorted(s for s in set(raw) | finals if s != initial)
    ids = {s: i for i, s in enumerate(order)}
    done = len(order)
    transitions, terminal = [], np.zeros(done + 1, bool)
    for s in order:
        out = {}
        for t, nxt in raw.get(s, {}).items():
            if t == eos:
                out[t] = done
            elif t < vocab_size:
                out[t] = ids[nxt]
        if s in finals:
            out[eos] = done
        transitions.append(out)
        terminal[ids[s]] = s in finals and set(out) == {eos}
    transitions.append({eos: done})
    terminal[done] = True
    if not transitions[0]:
        raise ValueError("the constraint allows no output (no token can start it)")
    return Automaton(initial=0, transitions=transitions, terminal=terminal, eos=eos, vocab_size=vocab_size,
                     key=key)
