"""The output processor (`jspec.serve.output`), with no model: token ids delivered in
random pieces, as readbacks deliver them.

- Incremental detokenization hands out exactly the full decode of the tokens (byte-level
  BPE with multi-byte characters split between tokens, and the bundled tokenizer), and
  decodes a bounded window per delivery (never the whole output again).
- Stop strings end a request at their first appearance, across delivery boundaries: the
  text cut before them (or after, include_stop_str_in_output), the tokens ending with the
  one that completed them, the engine told; the stream never shows a stop string; before
  min_tokens tokens none counts.
"""
from __future__ import annotations

import numpy as np
import pytest

from jspec import requests as rq
from jspec.bundle import bundle_path
from jspec.loading import load_tokenizer
from jspec.serve.output import Delivery, Handle, IncrementalText, OutputProcessor
from jspec.serve.scheduler import Request


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    import tiny_models
    path = str(tmp_path_factory.mktemp("bytes"))
    tiny_models.save_tokenizer(path)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def bundled_tokenizer():
    import os
    return load_tokenizer(os.path.join(bundle_path(), "target"))


def pieces(rng, tokens):
    out, i = [], 0
    while i < len(tokens):
        n = int(rng.integers(1, 6))
        out.append(tokens[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("which", ["byte_tokenizer", "bundled_tokenizer"])
def test_incremental_text_equals_full_decode(which, request):
    tok = request.getfixturevalue(which)
    rng = np.random.default_rng(0)
    text = "déf naïve(x):\n    return 'é→ü' * x  # ∑ 日本語 😀\n" * 3
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    calls = []
    inc = IncrementalText(tok)
    decode = inc._decode
    inc._decode = lambda ids: calls.append(len(ids)) or decode(ids)
    out = ""
    for part in pieces(rng, tokens):
        out += inc.add(part)
        assert "\ufffd" not in out
    out += inc.finish()
    assert out == tok.decode(tokens) == text
    assert max(calls) < len(tokens) / 5  # a window of the last deliveries, not the whole output


def handle_for(max_new=64, min_tokens=0):
    reqs = rq.Requests(prompts=[[1, 2]], is_batch=False, max_new=[max_new],
                       sampling={k: [v] for k, v in rq.NEUTRAL.items()}, stop_ids=[[]], min_tokens=[min_tokens])
    return Handle(Request(reqs), cancel=lambda h: None)


def run(tok, text, stops, include=False, min_tokens=0, seed=0):
    """Delivers the tokens of `text` in random pieces -> (output, handle's deltas, stopped handles)."""
    rng = np.random.default_rng(seed)
    stopped = []
    proc = OutputProcessor(tok, on_stop=stopped.append)
    h = handle_for(min_tokens=min_tokens)
    proc.open(h, {"stop": stops, "include_stop_str_in_output": include})
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    parts = pieces(rng, tokens)
    for i, part in enumerate(parts):
        proc.deliver([Delivery(h, part, finish="length" if i == len(parts) - 1 else None)])
        if h.done:
            break
    return h.result(), list(h), stopped, tokens


@pytest.mark.parametrize("seed", range(4))
def test_stop_strings_across_pieces(byte_tokenizer, seed):
    tok = byte_tokenizer
    text = "def f(x):\n    return x\n\n\ndef g(y):\n    pass\n"
    out, deltas, stopped, tokens = run(tok, text, ["\n\n", "never"], seed=seed)
    assert out.finish_reason == "stop" and out.stop_string == "\n\n" and stopped
    assert out.text == text[:text.find("\n\n")]
    assert "".join(d.text for d in deltas) == out.text and [t for d in deltas for t in d.tokens] == out.tokens
    # The tokens end with the one that completed the stop string.
    assert "\n\n" in tok.decode(out.tokens) and "\n\n" not in tok.decode(out.tokens[:-1])
    out, deltas, _, _ = run(tok, text, ["\n\n"], include=True, seed=seed)
    assert out.text == text[:text.find("\n\n") + 2] == "".join(d.text for d in deltas)
    # The earliest-ending match wins among several stop strings.
    out, _, _, _ = run(tok, text, ["return x\n\n\n", "x\n"], seed=seed)
    assert out.text == text[:text.find("x\n")]


def test_min_tokens_and_no_stop(byte_tokenizer):
    tok = byte_tokenizer
    text = "ab\nab\nab\n"
    out, _, _, _ = run(tok, text, ["b\n"], min_tokens=5)
    assert out.text == "ab\na"  # the first "b\n" ends within the first 5 tokens: the second one stops
    out, deltas, stopped, tokens = run(tok, text, ["zzz"])
    assert out.finish_reason == "length" and out.text == text and out.tokens == tokens and not stopped
    assert "".join(d.text for d in deltas) == text
