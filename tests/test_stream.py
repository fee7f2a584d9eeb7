"""jspec.stream: chunks concatenate to generate's output, no recompiles between chunks,
limits and stop ids honoured, an early stop releases the state."""
from __future__ import annotations

import gc

import jax
import pytest

import jspec
from jspec import api
from conftest import PROMPTS

CHAIN = jspec.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)


def _joined(chunks):
    """Per request: the concatenated tokens; plus the chunks' count and the last output."""
    chunks = list(chunks)
    rows = len(chunks[0].tokens)
    tokens = [[t for c in chunks for t in c.tokens[i]] for i in range(rows)]
    assert all(c.output is None for c in chunks[:-1]) and chunks[-1].output is not None
    return tokens, len(chunks), chunks[-1].output


@pytest.mark.parametrize("sampled", [False, True])
def test_stream_equals_generate(with_draft, sampled):
    p = with_draft("eagle3")
    kw = dict(max_new_tokens=[12, 5, 9], stop_token_ids=[], spec=CHAIN)
    if sampled:
        kw.update(temperature=[0.8, 0.0, 1.2], top_p=0.9, seed=[3, 4, 5])
    want = jspec.generate(p, PROMPTS, **kw)
    n_programs = api.compiled_programs()
    chunks = jspec.stream(p, PROMPTS, rounds_per_chunk=1, **kw)
    first = next(chunks)  # the prefill's token, before any round
    assert [len(t) for t in first.tokens] == [1, 1, 1] and first.output is None
    assert api.compiled_programs() == n_programs + 2  # start and advance, compiled once
    tokens, count, out = _joined([first, *chunks])
    assert api.compiled_programs() == n_programs + 2
    assert tokens == want.tokens and out.tokens == want.tokens
    assert out.finish_reasons == want.finish_reasons == ["length"] * 3
    assert out.stats.accept_lengths == want.stats.accept_lengths
    assert count == 1 + max(out.stats.rounds)  # one chunk per round after the prefill's
    # Larger chunks: the same tokens, fewer chunks, the same programs.
    tokens3, count3, _ = _joined(jspec.stream(p, PROMPTS, rounds_per_chunk=3, **kw))
    assert tokens3 == want.tokens and count3 < count and api.compiled_programs() == n_programs + 2


def test_stream_one_prompt_text_and_stop(target):
    plain = jspec.generate(target, PROMPTS[0], max_new_tokens=10, stop_token_ids=[])
    stop = plain.tokens[4]
    want = jspec.generate(target, PROMPTS[0], max_new_tokens=10, stop_token_ids=[stop])
    chunks = list(jspec.stream(target, PROMPTS[0], max_new_tokens=10, stop_token_ids=[stop], rounds_per_chunk=2))
    assert isinstance(chunks[0].tokens, list) and all(isinstance(t, int) for t in chunks[0].tokens)
    assert [t for c in chunks for t in c.tokens] == want.tokens and want.tokens[-1] == stop
    assert chunks[-1].finished and chunks[-1].output.finish_reasons == "stop"
    if target.tokenizer is not None:
        assert "".join(c.text for c in chunks) == want.text


def test_stream_early_stop_releases_the_state(with_draft):
    p = with_draft("eagle3")
    kw = dict(max_new_tokens=40, stop_token_ids=[], spec=CHAIN)
    list(jspec.stream(p, PROMPTS, rounds_per_chunk=2, **kw))  # compile first
    gc.collect()
    before = len(jax.live_arrays())
    chunks = jspec.stream(p, PROMPTS, rounds_per_chunk=2, **kw)
    for i, _ in enumerate(chunks):
        if i == 2:
            break
    assert len(jax.live_arrays()) > before  # the caches are alive while the stream is
    chunks.close()
    del chunks
    gc.collect()
    assert len(jax.live_arrays()) == before


def test_stream_bad_chunk_size(target):
    with pytest.raises(ValueError, match="rounds_per_chunk"):
        jspec.stream(target, PROMPTS[0], rounds_per_chunk=0)
