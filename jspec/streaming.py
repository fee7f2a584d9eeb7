"""Streaming: `jspec.stream` yields each request's new tokens and text as rounds commit.

It runs the generation loop's own rounds in bounded chunks: one compiled program admits
the requests into a fresh state (`programs.start`), another runs up to `rounds_per_chunk`
rounds (`programs.advance`), and the state, caches included, is carried from call to call
(donated: updated in place). Values never recompile between chunks, and the concatenated
chunks are `generate`'s output. Closing the generator early (a `break`, or dropping it)
releases the state.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator

import jax
import numpy as np

from jspec.loop import programs
from jspec.loop.state import init_state
from jspec.results import generate_output


@dataclasses.dataclass
class StreamChunk:
    """What one chunk of rounds committed. For one prompt: tokens, the new token ids; text,
    their new text (None without a tokenizer); finished, whether the request is done. For
    a batch, a list of each, one per request. output: on the last chunk, the
    `GenerateOutput` that `generate` returns for the same call (else None)."""

    tokens: Any
    text: Any
    finished: Any
    output: Any = None


class TextDiff:
    """A request's new text as tokens arrive: the decoded text's growth, holding back a
    trailing replacement character (a multi-byte character cut between tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.shown = tokenizer, ""

    def new(self, tokens, final: bool):
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.shown):  # a decoder that rewrote earlier text: go on from here
            self.shown = text
            return ""
        new, self.shown = text[len(self.shown):], text
        return new


def chunks(prog, reqs, rounds_per_chunk: int) -> Iterator[StreamChunk]:
    """The stream of `prog` (a `jspec.Compiled`) over checked requests `reqs` (checked
    here, at the call; the programs compile at the first chunk)."""
    if isinstance(rounds_per_chunk, bool) or not (isinstance(rounds_per_chunk, (int, np.integer))
                                                  and rounds_per_chunk >= 1):
        raise ValueError(f"rounds_per_chunk must be an int >= 1, got {rounds_per_chunk!r}")
    return _chunks(prog, reqs, int(rounds_per_chunk))


def _chunks(prog, reqs, rounds_per_chunk: int) -> Iterator[StreamChunk]:
    prog.fit(reqs)
    plan, (tw, pw) = prog.plan, prog.weights
    rows, adm = prog.device_inputs(reqs)
    start = prog.program(programs.start_jit, rows, adm)
    state_shape = jax.eval_shape(lambda: init_state(plan))
    advance = prog.program(programs.advance_jit, state_shape, np.int32(0))
    compile_s, prog.compile_s = prog.compile_s, 0.0
    lens = reqs.lens
    n = len(lens)
    shown = [0] * n
    texts = [TextDiff(prog.params.tokenizer) for _ in range(n)]
    run_s, t0 = 0.0, time.perf_counter()
    st, back = start(tw, pw, rows, adm)
    try:
        while True:
            back = jax.device_get(back)
            run_s += time.perf_counter() - t0
            done = bool(back["finished"][:n].all()) or int(back["step"]) >= plan.max_rounds
            tokens, text = [], []
            for i, l in enumerate(lens):
                g = int(back["generated"][i])
                tokens.append([int(t) for t in back["tokens"][i, l + shown[i]: l + g]])
                text.append(texts[i].new([int(t) for t in back["tokens"][i, l: l + g]], done))
                shown[i] = g
            finished = [bool(f) or done for f in back["finished"][:n]]
            output = generate_output(prog.params, plan, back, reqs, compile_s=compile_s,
                                     run_s=run_s) if done else None
            if reqs.is_batch:
                yield StreamChunk(tokens, text, finished, output)
            else:
                yield StreamChunk(tokens[0], text[0], finished[0], output)
            if done:
                return
            t0 = time.perf_counter()
            st, back = advance(tw, pw, st, np.int32(int(back["step"]) + rounds_per_chunk))
    finally:
        del st, back  # the caches go with the last reference
