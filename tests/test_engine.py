"""The serving engine (`jspec.Engine`): requests submitted at any time, admitted into free
rows between chunks of rounds, evicted when they finish or are cancelled.

- Each request's tokens equal the same request run alone (`jspec.generate`), greedy and
  seeded sampling, plain and speculative, dense and paged, whatever shares the batch and
  whenever it joined (float32, CPU); the same from several threads at once and through
  the asyncio interface.
- Stop strings end a request where they appear, its text cut before them; cancelling a
  request frees its row for the next; a full queue raises QueueFull; bad requests get
  clear errors at submit.
- Logprobs through the engine equal `jspec.generate`'s; a request with speculation off
  emits its tokens with every round keeping the root alone; min_tokens holds stops back.
- After `warm_up` serving compiles nothing, whatever the requests ask; a fault in the
  runner fails every open request at once and the engine refuses new ones; a request past
  its time limit ends as "timeout"; submit after close raises.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading

import numpy as np
import pytest

import jspec
from jspec.loop import programs
from conftest import CACHES, SERVED_ENGINE

PROMPTS = ["def add(a, b):", [5, 7, 9, 11, 13, 5, 7], [20, 21, 22], list(range(30, 45)), [8, 9, 8, 9, 8],
           "import os\n", [3, 100, 7, 3]]
SAMPLING = [{}, {"temperature": 0.8, "seed": 3}, {}, {"temperature": 1.0, "top_k": 20, "seed": 11}, {},
            {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.2, "seed": 5}, {"presence_penalty": 0.5}]
MAX_NEW = [12, 9, 14, 6, 11, 10, 8]


_ALONE: dict = {}


def alone(params, i, cache="dense", prompts=PROMPTS):
    """Request i run alone (a batch of one, the whole prompt prefilled at once) through one
    compiled program per params, cache and prompt list."""
    key = (id(params), cache, id(prompts))
    if key not in _ALONE:
        _ALONE[key] = jspec.compile(params, prompts, max_new_tokens=max(MAX_NEW), stop_token_ids=[],
                                    cache=CACHES[cache], temperature=0.5)
    out = _ALONE[key].run(prompts[i], max_new_tokens=MAX_NEW[i % len(MAX_NEW)], stop_token_ids=[],
                          **({"temperature": 0.0} | SAMPLING[i % len(SAMPLING)]))
    return out.tokens, out.finish_reasons


def staggered(engine):
    """Requests 0..6 through the engine's rows: two at first, more after one and after three
    chunks, the rest when rows free up -> {request: output}."""
    handles = {}

    def submit(*ids):
        for i in ids:
            handles[i] = engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW[i], stop_token_ids=[], **SAMPLING[i])
    submit(0, 1)
    engine.step()
    submit(2, 3, 4)
    for _ in range(3):
        engine.step()
    submit(5, 6)
    while not all(h.done for h in handles.values()):
        engine.step()
    return {i: h.result() for i, h in handles.items()}


@pytest.mark.parametrize("kind,cache", [("plain", "dense"), ("eagle3", "paged16")])
def test_requests_equal_alone_whenever_they_join(target, with_draft, kind, cache, monkeypatch):
    """... with the speculating engine's chunks alternating between their program and its
    twin (`twin_chunks`, a GPU engine's default): every other chunk runs the twin."""
    params = target if kind == "plain" else with_draft(kind)
    twin_calls, make_twin = [], programs.twin

    def counted_twin(program):
        twin = make_twin(program)
        assert twin is not None and twin is not program

        def call(*args):
            twin_calls.append(1)
            return twin(*args)
        return call
    monkeypatch.setattr(programs, "twin", counted_twin)
    engine = jspec.Engine(params, max_batch=3, max_prompt_len=16, max_new_tokens=16, cache=CACHES[cache],
                          rounds_per_chunk=2, prefill_chunk=8,  # paged: the 15-token prompt in two blocks
                          twin_chunks=kind != "plain")
    got = staggered(engine)
    assert len(twin_calls) == (engine.stats.chunks + 1) // 2 if kind != "plain" else not twin_calls
    for i, out in got.items():
        tokens, reason = alone(params, i, cache=cache)
        assert out.tokens == tokens, i
        assert out.finish_reason == reason
        assert out.text == target.tokenizer.decode(tokens, skip_special_tokens=True)
    assert engine.running == 0 or all(q.state == "done" for q in engine.scheduler.rows.values())
    assert engine.stats.finished == len(PROMPTS) and engine.stats.admitted == len(PROMPTS)
    if kind != "plain":
        assert engine.stats.accept_rounds > 0
    assert (engine.stats.prefill_passes > 0) == (cache != "dense")  # paged: prompts over 8 tokens in blocks
    # the driving thread's CPU time: its own work apart from the program calls (all made in `step` here)
    assert engine.stats.host_s > 0 and engine.stats.launch_s > 0
    assert engine.stats.launch_s == pytest.approx(engine.runner.launch_s)


def test_a_small_page_pool_admits_by_pages(target):
    """Admission by the pages a request may come to hold (preemption off). A pool of 4
    pages of 16 tokens under 3 rows: every request may come to hold 2 pages,
    so two run at a time and the third row waits for pages; none is cut short, and every
    output equals the request run alone. A request that could never fit is refused.
    max_len bounds prompt and new tokens together (a row holds 28 tokens, not 16 + 20)."""
    cache = jspec.CacheConfig("paged", page_size=16, num_pages=4)
    engine = jspec.Engine(target, max_batch=3, max_prompt_len=16, max_new_tokens=20, max_len=28, cache=cache,
                          rounds_per_chunk=2, prefill_chunk=8, preemption=False)
    assert engine.plan.layout.host_pages and engine.pool_pages == 4
    assert engine.plan.layout.capacity == 32 and engine.plan.max_rounds >= 20  # 28 + slack, in pages of 16
    with pytest.raises(ValueError, match="max_new_tokens=20 with a prompt of 16 tokens asks for 36 tokens; this "
                                         "engine holds at most max_len=28"):
        engine.submit(list(range(1, 17)), max_new_tokens=20)
    seen = []
    step = engine.step

    def counted():
        step()
        seen.append((len(engine.scheduler.rows), engine.scheduler.pages_free, len(engine.scheduler.waiting)))
    engine.step = counted
    got = staggered(engine)
    for i, out in got.items():
        tokens, reason = alone(target, i, cache="paged16")
        assert out.tokens == tokens and out.finish_reason == reason, i
    assert max(rows for rows, _, _ in seen) == 2 and min(free for _, free, _ in seen) >= 0
    assert any(rows == 2 and waiting for rows, _, waiting in seen)  # a row free, requests waiting for pages
    small = jspec.Engine(target, max_batch=1, max_prompt_len=60, max_new_tokens=16, cache=cache)
    with pytest.raises(ValueError, match="may need 5 pages of 16 tokens; the engine's page pool holds 4"):
        small.submit(list(range(1, 56)), max_new_tokens=16)


@pytest.mark.parametrize("kind", ["plain", "eagle", "eagle3", "standalone", "ngram"])
def test_preempted_requests_resume_exactly(target, with_draft, kind):
    """A pool of 3 pages of 16 tokens under 3 rows, admission by the pages held now: the
    rows outgrow the pool, the latest requests are preempted and resume from their output
    so far (prompt + output prefilled again, their penalties' counts restored); every
    output equals the request run alone, greedy and seeded sampling, with and without
    speculation; a resumed request finds its own pages in the prefix cache; passes of two
    rows at most (max_batched_tokens). With preemption off the same requests wait instead
    and none is preempted."""
    params = {"plain": target, "ngram": target.with_draft(jspec.NgramDraft())}.get(kind) or with_draft(kind)
    cache = jspec.CacheConfig("paged", page_size=16, num_pages=3)
    engine = jspec.Engine(params, max_batch=3, max_prompt_len=16, max_new_tokens=16, cache=cache,
                          rounds_per_chunk=2, prefill_chunk=8, max_batched_tokens=16)
    assert engine.runner.pass_rows == 2  # a pass takes two rows' blocks of 8 at most
    got = staggered(engine)
    for i, out in got.items():
        tokens, reason = alone(params, i, cache="paged16")
        assert out.tokens == tokens and out.finish_reason == reason, i
    assert engine.stats.num_preemptions > 0
    assert engine.stats.admitted == len(PROMPTS) + engine.stats.num_preemptions
    assert kind != "plain" or engine.stats.prefix_cache_hits > 0  # a resumed request found its own pages
    if kind != "plain":
        return
    # Three at once, the latest admitted preempted first: its presence and frequency
    # penalties read the counts of its output so far, restored when it resumes (they
    # change its tokens from the 8th on).
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    handles = {i: engine.submit(PROMPTS[i], max_new_tokens=16, stop_token_ids=[], **(penalties if i == 5 else {}))
               for i in (4, 6, 5)}
    while not all(h.done for h in handles.values()):
        engine.step()
    assert handles[5].request.preemptions > 0
    program = _ALONE[(id(params), "paged16", id(PROMPTS))]
    for i, h in handles.items():
        want = program.run(PROMPTS[i], max_new_tokens=16, stop_token_ids=[], temperature=0.0,
                           **(penalties if i == 5 else {}))
        assert h.result().tokens == want.tokens, i


def test_the_pool_sized_from_memory(target, monkeypatch):
    """memory_utilization: the pool takes the pages that fit in that share of the device's
    memory beside the weights and the loop's other buffers, at most every row's whole room;
    too little memory for the largest request is a clear error naming the numbers."""
    from jspec.loop import plan as plan_mod
    kw = dict(max_batch=4, max_prompt_len=32, max_new_tokens=16)
    whole = jspec.Engine(target, **kw)  # every row's whole room
    per_row = whole.plan.layout.pages_per_seq
    assert whole.pool_pages == 4 * per_row
    weights = plan_mod.weight_bytes(target)
    lay = whole.plan.layout
    sized = lambda n: dataclasses.replace(whole.plan, layout=dataclasses.replace(lay, num_pages=n))  # noqa: E731
    base, page = plan_mod.plan_bytes(sized(0)), plan_mod.plan_bytes(sized(1)) - plan_mod.plan_bytes(sized(0))
    limit = int((weights + base + 7.5 * page) / 0.5)  # half of it holds 7 pages beside the rest
    monkeypatch.setattr(plan_mod, "device_memory", lambda: (limit, "the test's device"))
    engine = jspec.Engine(target, memory_utilization=0.5, **kw)
    assert engine.pool_pages == 7 < 4 * per_row and engine.plan.layout.host_pages
    assert "at utilization 0.5" in engine.runner.pool_note
    small = int((weights + base + 2 * page) / 0.5)
    monkeypatch.setattr(plan_mod, "device_memory", lambda: (small, "the test's device"))
    with pytest.raises(ValueError, match=r"the page pool that fits in memory holds 2 pages .* needs 4"):
        jspec.Engine(target, memory_utilization=0.5, **kw)
    with pytest.raises(ValueError, match="memory_utilization must be a number in"):
        jspec.Engine(target, memory_utilization=1.5, **kw)


SYSTEM = list(range(40, 70))  # a 30-token shared prefix: 3 full pages of 8 with the token after each


def test_prefix_caching_shares_pages_exactly(with_draft):
    """Prefix caching over pages of 8: a request whose prompt begins with a prefix kept
    from an earlier one (its prompt, or for a second turn its prompt and output) shares
    those pages and is prefilled from past them; two requests with one new prefix admitted
    together share it (two samples of one new prompt: the second waits for the first's
    blocks and takes them all); a pool too small to keep everything drops the least
    recently used pages. Every output (greedy and seeded sampling) equals the request run
    alone, and the EAGLE-3 head reads exactly what it would have written: the same accepted
    tokens as an engine without prefix caching; prompt tails of at most a quarter block
    pass the narrower block program. The hits are counted in tokens. (DeepSeek's
    MTP and Qwen3.5's: tests/test_deepseek_v32.py, tests/test_qwen3_next.py.)"""
    params = with_draft("eagle3")
    cache = jspec.CacheConfig("paged", page_size=8)
    first = SYSTEM + [5, 6, 7]
    kw = dict(max_batch=3, max_prompt_len=64, max_new_tokens=12, cache=cache, rounds_per_chunk=2, prefill_chunk=32)
    program = jspec.compile(params, [list(range(1, 65))], max_new_tokens=12, stop_token_ids=[], cache=cache,
                            temperature=0.5)

    def serve(engine):
        outs = []
        a = engine.generate(first, max_new_tokens=12, stop_token_ids=[])
        outs.append((first, {}, a))
        second_turn = first + a.tokens + [11, 12]
        fresh = list(range(100, 140))  # two samples of a new 40-token prompt: the second waits for the first's pages
        batch = [(SYSTEM + [9, 10], {}), (SYSTEM + [9, 10, 3], {"temperature": 0.9, "seed": 4}),
                 (list(range(70, 90)), {}), (second_turn, {}), (fresh, {"temperature": 1.0, "seed": 1}),
                 (fresh, {"temperature": 1.0, "seed": 2})]
        handles = [(p, v, engine.submit(p, max_new_tokens=12, stop_token_ids=[], **v)) for p, v in batch]
        while engine.step():  # to the end: the last rows evicted
            pass
        return outs + [(p, v, h.result()) for p, v, h in handles]

    cached = jspec.Engine(params, **kw)
    got = serve(cached)
    assert cached.runner.narrow == 8 and cached.runner.narrow_passes > 0  # prompts' tails of 8 tokens or less
    for prompt, values, out in got:
        want = program.run(prompt, max_new_tokens=12, stop_token_ids=[], **({"temperature": 0.0} | values))
        assert out.tokens == want.tokens, prompt
    # hits: both SYSTEM requests find its 3 pages (24 tokens); the second turn finds the
    # first request's 4 prompt pages and its output's full pages; the second sample of the
    # new prompt finds its 4 full pages (32 tokens)
    turn = len(got[4][0])
    assert cached.stats.prefix_cache_queries == sum(len(p) for p, _, _ in got)
    assert cached.stats.prefix_cache_hits >= 24 + 24 + 32 + 8 * ((len(first) + 12 - 1 - cached.plan.slack) // 8)
    assert cached.stats.prefix_cache_hits <= 24 + 24 + 32 + 8 * ((turn - 1) // 8)
    plain = jspec.Engine(params, prefix_caching=False, **kw)
    assert [o.tokens for _, _, o in serve(plain)] == [o.tokens for _, _, o in got]
    assert plain.stats.prefix_cache_hits == 0
    assert cached.stats.accept_tokens == plain.stats.accept_tokens  # the drafts proposed the same
    assert cached.pool.available == cached.pool.num_pages and cached.pool.cached > 0
    # A pool of 6 pages for 1 row: each request takes most of it, so older prefixes make way.
    small = jspec.Engine(params, **(kw | dict(max_batch=1, cache=jspec.CacheConfig("paged", page_size=8, num_pages=7))))
    for prompt in (first, SYSTEM + [9, 10], list(range(70, 100)), first):
        out = small.generate(prompt, max_new_tokens=12, stop_token_ids=[])
        assert out.tokens == program.run(prompt, max_new_tokens=12, stop_token_ids=[], temperature=0.0).tokens
    assert small.stats.prefix_cache_hits == 24  # the second finds the first's; the last finds nothing left


LONG_PROMPTS = PROMPTS + [list(range(40, 64)), [8, 9, 8, 9, 8] * 4]  # 24 and 20 tokens


def test_adaptive_tiers_and_prompt_blocks_equal_alone(target, with_draft):
    """Adaptive speculation over a plain tier, a chain and a tree, the tier switched before
    every chunk in turn, prompts of up to 24 tokens prefilled in blocks of 8 on a page-1
    pool (the first prompt, alone, in a wide block of 32 after its admission): every
    request (greedy and seeded sampling) equals its run alone, whole prompt and the
    default chain."""
    params = with_draft("eagle3")
    tiers = (None, jspec.SpecConfig(2), jspec.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4))
    costs = {(t, n): 1.0 for t in range(3) for n in (1, 2, 4)}  # the batch: 3 rows, bucketed to 4
    engine = jspec.Engine(params, max_batch=3, max_prompt_len=24, max_new_tokens=16, cache=CACHES["paged1"],
                          spec=jspec.Adaptive(tiers=tiers, costs=costs), rounds_per_chunk=2, prefill_chunk=8)
    engine._ready()
    order = itertools.cycle([1, 2, 0])
    engine.scheduler.chooser.choose = lambda current, running: next(order)
    handles = {}
    for i in (7, 0, 8, 1):
        handles[i] = engine.submit(LONG_PROMPTS[i], max_new_tokens=MAX_NEW[i % 7], stop_token_ids=[],
                                   **SAMPLING[i % 7])
        engine.step()
    for i in (2, 3, 4, 5, 6):
        handles[i] = engine.submit(LONG_PROMPTS[i], max_new_tokens=MAX_NEW[i % 7], stop_token_ids=[],
                                   **SAMPLING[i % 7])
    while not all(h.done for h in handles.values()):
        engine.step()
    for i, h in handles.items():
        assert h.result().tokens == alone(params, i, "paged16", LONG_PROMPTS)[0], i
    assert all(n > 0 for n in engine.stats.tier_chunks.values()), engine.stats
    assert engine.stats.prefill_passes >= 2
    assert engine.runner.wide == 32 and engine.runner.wide_passes > 0


def test_threads_and_asyncio(target):
    """The engine's own thread serves requests submitted from several threads at once and
    from asyncio; streamed pieces concatenate to the result."""
    engine = jspec.Engine(target, max_batch=2, max_prompt_len=16, max_new_tokens=16, rounds_per_chunk=3)
    outputs = {}
    with engine:
        def client(i):
            h = engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW[i], stop_token_ids=[], **SAMPLING[i])
            pieces = list(h)
            outputs[i] = (h.result(timeout=120), pieces)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        async def async_client(i):
            h = engine.submit(PROMPTS[i], max_new_tokens=MAX_NEW[i], stop_token_ids=[], **SAMPLING[i])
            pieces = [p async for p in h.stream()]
            return i, await h.wait(), pieces

        async def main():
            return await asyncio.gather(*(async_client(i) for i in (4, 5, 6)))
        for i, out, pieces in asyncio.run(main()):
            outputs[i] = (out, pieces)
    for i, (out, pieces) in outputs.items():
        assert out.tokens == alone(target, i)[0], i
        assert [t for d in pieces for t in d.tokens] == out.tokens
        assert "".join(d.text for d in pieces) == out.text


def test_stop_strings(target):
    """A stop string ends the request at its first appearance: the text is cut before it,
    the tokens end with the one that completed it, streamed text never shows it."""
    for prompt in PROMPTS:  # a stop of three printable ASCII characters, not at the start
        full = jspec.generate(target, prompt, max_new_tokens=16, stop_token_ids=[])
        text = full.text
        at = next((i for i in range(2, len(text) - 2) if text[i:i + 3].isascii() and text[i:i + 3].isprintable()),
                  None)
        if at is not None:
            break
    stop = text[at:at + 3]
    at = text.find(stop)
    engine = jspec.Engine(target, max_batch=2, max_prompt_len=16, max_new_tokens=16, rounds_per_chunk=1)
    h = engine.submit(prompt, max_new_tokens=16, stop_token_ids=[], stop=[stop, "never appears"])
    while not h.done:
        engine.step()
    out = h.result()
    pieces = list(h)
    assert out.finish_reason == "stop" and out.text == text[:at]
    assert full.tokens[:len(out.tokens)] == out.tokens and len(out.tokens) < len(full.tokens)
    assert stop in target.tokenizer.decode(out.tokens) and stop not in target.tokenizer.decode(out.tokens[:-1])
    assert "".join(d.text for d in pieces) == out.text


def test_cancel_frees_the_row(target):
    engine = jspec.Engine(target, max_batch=1, max_prompt_len=16, max_new_tokens=16, rounds_per_chunk=1)
    first = engine.submit(PROMPTS[1], max_new_tokens=16, stop_token_ids=[])
    second = engine.submit(PROMPTS[2], max_new_tokens=MAX_NEW[2], stop_token_ids=[])
    engine.step()
    engine.step()
    assert engine.running == 1 and engine.waiting == 1 and not first.done
    first.cancel()
    while not second.done:
        engine.step()
    assert first.result().finish_reason == "cancelled" and 0 < len(first.result().tokens) < 16
    assert second.result().tokens == alone(target, 2)[0]
    waiting = engine.submit(PROMPTS[3], max_new_tokens=4, stop_token_ids=[])
    waiting.cancel()  # cancelled before it got a row: never admitted
    engine.step()
    assert waiting.result().finish_reason == "cancelled" and waiting.result().tokens == []


def test_batch_derived_from_the_pool():
    from jspec.serve.engine import ROW_TOKENS, derived_batch
    pools = [0, 8 * ROW_TOKENS, 9 * ROW_TOKENS, 64 * ROW_TOKENS + 1, 127 * ROW_TOKENS, 1 << 40]
    assert [derived_batch(t, "gpu") for t in pools] == [8, 8, 8, 64, 64, 128]
    assert derived_batch(1 << 40, "cpu") == 8


def test_queue_full_and_bad_requests(target):
    engine = jspec.Engine(target, max_batch=1, max_prompt_len=8, max_new_tokens=8, max_waiting=1)
    # The engine's programs ask XLA for command buffers of kernels, not of loops (on a GPU),
    # unless its tuning names its own.
    options = dict(engine.plan.tuning.xla_options)
    assert options["xla_gpu_enable_command_buffer"] == "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
    own = jspec.Tuning(xla_options={"xla_gpu_enable_command_buffer": "FUSION"})
    mine = jspec.Engine(target, max_batch=1, max_prompt_len=8, max_new_tokens=8, tuning=own)
    assert dict(mine.plan.tuning.xla_options)["xla_gpu_enable_command_buffer"] == "FUSION"
    engine.submit([1, 2, 3], max_new_tokens=4)
    with pytest.raises(jspec.QueueFull, match="max_waiting=1"):
        engine.submit([1, 2, 3], max_new_tokens=4)
    for kw, err, match in [
            (dict(prompt=list(range(1, 10))), ValueError, "prompt has 9 tokens; this engine takes prompts of at most 8"),
            (dict(max_new_tokens=9), ValueError, "max_new_tokens=9; this engine allows at most 8"),
            (dict(prompt=[[1, 2], [3]]), TypeError, "one prompt"),
            (dict(prompt=[]), ValueError, "prompt is empty"),
            (dict(stop=[""]), TypeError, "stop must be a non-empty string"),
            (dict(temperature=-1.0), ValueError, "temperature must be finite and >= 0"),
            (dict(stop_token_ids=list(range(9))), ValueError, "9 stop token ids"),
            (dict(logprobs=21), ValueError, "logprobs must be in \\[0, 20\\]"),
            (dict(min_tokens=5), ValueError, "min_tokens=5 is above max_new_tokens=4"),
            (dict(speculative="no"), TypeError, "speculative must be True or False"),
            (dict(timeout=0), ValueError, "timeout must be a number of seconds > 0"),
            (dict(n=2), TypeError, "unexpected argument 'n'")]:
        kw = {"prompt": [1, 2], "max_new_tokens": 4} | kw
        with pytest.raises(err, match=match):
            engine.submit(kw.pop("prompt"), **kw)
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        jspec.Engine(target, max_batch=0)
    assert jspec.Engine(target, max_batch=None, max_prompt_len=8, max_new_tokens=8).batch == 8  # the CPU's
    with pytest.raises(ValueError, match="max_logprobs must be at most 20"):
        jspec.Engine(target, max_batch=1, max_logprobs=21)
    none = jspec.Engine(target, max_batch=1, max_prompt_len=8, max_new_tokens=8, max_logprobs=0)
    with pytest.raises(ValueError, match="logprobs=0; this engine lists at most 0 .* keeps no logprobs"):
        none.submit([1, 2], max_new_tokens=2, logprobs=0)
    with pytest.raises(ValueError, match="adaptive speculation needs a draft"):
        jspec.Engine(target, max_batch=1, spec=jspec.Adaptive())
    with pytest.raises(ValueError, match=r"no cost for \(tier, bucket\) \(0, 2\)"):
        jspec.Engine(target.with_draft(jspec.NgramDraft()), max_batch=2, max_prompt_len=8, max_new_tokens=8,
                     spec=jspec.Adaptive(tiers=(None, jspec.SpecConfig(2)), costs={(0, 1): 1.0}))


def test_serve_load_benchmark(with_draft):
    """`python -m jspec bench serve`'s core: Poisson arrivals through an engine per setting,
    the same arrivals for each; every request generates its fixed length; the table holds
    each setting at each rate with its ratio to plain decoding."""
    from jspec.serve.load import format_load_table, poisson_arrivals, run_serve_bench
    a = poisson_arrivals(50.0, 2000, seed=1)
    assert abs(np.mean(np.diff(a)) - 1 / 50) < 0.002 and np.all(np.diff(a) > 0)
    assert np.array_equal(a, poisson_arrivals(50.0, 2000, seed=1))
    chain = jspec.SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
    adaptive = jspec.Adaptive(tiers=(None, chain), costs={(t, n): 1.0 + t for t in (0, 1) for n in (1, 2)})
    rows = run_serve_bench(with_draft("eagle3"), PROMPTS[:3], rates=[200.0], specs=[None, chain, adaptive],
                           requests=5, max_new_tokens=6, max_batch=2, rounds_per_chunk=2)
    assert [(r.setting, r.rate, r.requests) for r in rows] == [("plain", 200.0, 5), ("2,1,3", 200.0, 5),
                                                                ("adaptive", 200.0, 5)]
    for r in rows:
        assert r.tokens_per_s > 0 and r.ttft_ms[0] <= r.e2e_ms[0] and r.ttft_ms[0] <= r.ttft_ms[1]
        assert r.compile_s > 0
        # the engine's longest iteration while the row ran (a step begun before the row's
        # first arrival counts too, so no bound from the requests' latency)
        assert r.longest_step_ms > 0 and r.full_gcs >= 0 and r.full_gc_ms >= 0
    assert rows[0].tau == 1.0 and rows[1].tau >= 1.0
    assert rows[1].tiers == "2,1,3 100%" and rows[2].tiers.endswith("%")
    table = format_load_table(rows)
    assert "| 200 | plain |" in table and "| 200 | 2,1,3 |" in table and "1.00x" in table
    assert "| 200 | adaptive |" in table
    # The start-up cost measurement (on the bench's compiled programs) covers every tier and bucket.
    from jspec.serve.tiers import measure_costs
    engine = jspec.Engine(with_draft("eagle3"), max_batch=2, max_prompt_len=max(len(p) for p in PROMPTS[1:3]),
                          max_new_tokens=6, spec=adaptive, rounds_per_chunk=2)
    measured = measure_costs(engine.runner, context=4, repeats=1)
    assert sorted(measured) == sorted(adaptive.costs) and all(c > 0 for c in measured.values())


def test_bench_serve_cli_errors(capsys):
    from jspec.__main__ import bench_serve_parser, serve_parser, main
    assert isinstance(serve_parser().parse_args(["--spec", "adaptive"]).spec, jspec.Adaptive)
    assert bench_serve_parser().parse_args(["--spec", "adaptive", "3,1,4"]).spec == [jspec.Adaptive(),
                                                                                      jspec.SpecConfig(3)]
    for argv, match in [(["bench", "serve", "--rates", "0"], "must be a rate > 0"),
                        (["bench", "serve", "--draft", "none"], "compares speculative decoding"),
                        (["serve", "--max-len", "8", "--max-new-tokens", "8"], "must be below --max-len")]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and match in capsys.readouterr().err


def test_logprobs_speculation_off_and_min_tokens(perm):
    """Through the engine, with drafts that agree (long accepted runs): logprobs equal
    `jspec.generate`'s and the target's own log-softmax at each position; a request with
    speculation off emits the same tokens with every round keeping the root alone while
    its neighbours accept drafts; min_tokens bars the stop token until then."""
    import jax
    p = jspec.load(perm["target"], draft=perm["eagle"])
    plain = p.with_draft(None)
    prompts = [[5, 7, 9], [20, 21], [30, 31, 32, 33]]
    engine = jspec.Engine(p, max_batch=4, max_prompt_len=8, max_new_tokens=12, spec=jspec.SpecConfig(3),
                          rounds_per_chunk=2)
    hs = [engine.submit(q, max_new_tokens=12, stop_token_ids=[], logprobs=2, prompt_logprobs=1 if i == 2 else None,
                        speculative=i != 1) for i, q in enumerate(prompts)]
    while not all(h.done for h in hs):
        engine.step()
    want = jspec.generate(plain, prompts, max_new_tokens=12, stop_token_ids=[], logprobs=2)
    for i, (q, h) in enumerate(zip(prompts, hs)):
        out = h.result()
        assert out.tokens == want.tokens[i]
        ref = np.asarray(jax.nn.log_softmax(jspec.logits(plain, [q + out.tokens])[0], axis=-1))
        got = np.array([lp.logprob for lp in out.logprobs])
        np.testing.assert_allclose(got, [ref[len(q) - 1 + j, t] for j, t in enumerate(out.tokens)], atol=1e-5)
        assert [t for t, _ in out.logprobs[0].top] == list(np.argsort(-ref[len(q) - 1])[:2])
    assert hs[2].result().prompt_logprobs[0] is None and len(hs[2].result().prompt_logprobs) == 4
    np.testing.assert_allclose([lp.logprob for lp in hs[2].result().prompt_logprobs[1:]],
                               [ref[j - 1, prompts[2][j]] for j in range(1, 4)], atol=1e-5)
    assert engine.stats.accept_rounds > 0 and engine.stats.mean_accept_length > 2  # the others accepted drafts
    stop = want.tokens[0][2]
    h = engine.submit(prompts[0], max_new_tokens=12, stop_token_ids=[stop], min_tokens=5)
    while not h.done:
        engine.step()
    assert stop not in h.result().tokens[:5] and h.result().tokens[:2] == want.tokens[0][:2]
    # A tree's accepted path (gathered from its nodes) carries the same logprobs.
    tree = jspec.generate(p, prompts, max_new_tokens=12, stop_token_ids=[], logprobs=2,
                          spec=jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))
    assert tree.tokens == want.tokens and tree.stats.mean_accept_length > 2
    for a, b in zip(tree.logprobs, want.logprobs):
        np.testing.assert_allclose([x.logprob for x in a], [x.logprob for x in b], atol=1e-5)
        assert [x.top[0][0] for x in a] == [x.top[0][0] for x in b]
    # Sampled drafts with speculation off: the target's own draw each round, plain sampling's tokens.
    sampled = dict(max_new_tokens=12, stop_token_ids=[], temperature=1.0, seed=[4, 5, 6])
    off = jspec.generate(p, prompts, speculative=False, spec=jspec.SpecConfig(3, sample_drafts=True), **sampled)
    assert off.tokens == jspec.generate(plain, prompts, **sampled).tokens
    assert all(a == 1 for row in off.stats.accept_lengths for a in row)


def test_no_compile_while_serving(with_draft, monkeypatch):
    """After `warm_up`, serving greedy and sampled requests, with and without logprobs,
    prompt logprobs, speculation off, stop strings, constraints (their tables placed as
    they come) and prompts of every length up to the largest (prefilled in blocks)
    compiles nothing: XLA reports no compilation, and the chunks' twins (`twin_chunks`) are
    loaded by the warm-up too. A warm-up with requests in the engine is refused."""
    import jax
    params = with_draft("eagle3")
    engine = jspec.Engine(params, **SERVED_ENGINE, twin_chunks=True)
    engine.warm_up()  # compiled in threads (`jspec.loop.programs.compile_many`)
    twins_made = []
    monkeypatch.setattr(programs, "twin", lambda program: twins_made.append(program))
    assert engine.stats.programs == len(engine.runner.programs_needed())
    _, entry, plan, args = engine.runner.programs_needed()[0]  # kept: an item of one key compiles once
    (first, s1), (again, s2) = programs.compile_many([(entry, plan, args)] * 2, engine.runner.weights, threads=2)
    assert first is again and s1 == s2 == 0.0
    # without logprobs (as `bench serve` warms up): no admission, pass or chunk that records them
    lean = {key for key, *_ in engine.runner.programs_needed(logprobs=(False,))}
    assert lean < {key for key, *_ in engine.runner.programs_needed()}
    assert not any(k[0] in ("admit", "chunk") and k[3] or k[0] == "prefill" and k[2] for k in lean)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
    cases = [dict(), dict(temperature=0.8, seed=1), dict(logprobs=3), dict(prompt_logprobs=2, logprobs=0),
             dict(speculative=False, temperature=0.5), dict(stop=["a"], min_tokens=2),
             dict(constraint=jspec.Choice(["ab", "cd"])), dict(constraint=jspec.Regex("[a-z]+"), temperature=0.7)]
    hs = [engine.submit(list(range(3, 3 + n)), max_new_tokens=8, stop_token_ids=[], **cases[i % len(cases)])
          for i, n in enumerate((1, 5, 17, 64, 33, 32, 2, 39, 12, 6))]
    while not all(h.done for h in hs):
        engine.step()
    assert not compiles, compiles
    assert not twins_made
    assert all(h.result().finish_reason in ("length", "stop") for h in hs)
    engine.submit([5, 6], max_new_tokens=8)
    with pytest.raises(RuntimeError, match="warm_up runs before serving"):  # its runs start the state afresh
        engine.warm_up()


def test_full_collections_are_counted():
    """`jspec.serve.load.full_collections`: the seconds of each full garbage collection
    while inside, none of a younger generation's, and none after."""
    import gc
    from jspec.serve.load import full_collections
    with full_collections() as pauses:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    gc.collect(2)
    assert len(pauses) == 2 and all(p > 0 for p in pauses)


def test_static_heap_keeps_start_up_objects_out_of_full_collections():
    """`jspec.serve.static_heap`: objects alive on entry are frozen (a cycle among them is
    not collected while inside), cycles made inside are collected as before, and on exit
    every object is the collector's again."""
    import gc
    import weakref

    class Node:
        pass
    old = Node()
    old.me = old  # a cycle alive on entry: only the cyclic collector can free it
    old_ref = weakref.ref(old)
    with jspec.serve.static_heap():
        assert gc.get_freeze_count() > 0
        del old
        gc.collect()
        assert old_ref() is not None  # frozen: not walked, not freed
        new = Node()
        new.me = new
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None


def test_faults_fail_every_request_and_nothing_hangs(target):
    """A failure injected into the runner's chunk: every running and waiting request ends
    with finish_reason "error" and the message; results and streams return; the engine
    is unhealthy and refuses requests; close() returns. Timeouts and submit after close."""
    engine = jspec.Engine(target, max_batch=2, max_prompt_len=16, max_new_tokens=16, rounds_per_chunk=1)
    calls = {"n": 0}
    chunk = engine.runner.chunk

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return chunk(*args)
    engine.runner.chunk = failing
    with engine:
        hs = [engine.submit(PROMPTS[i], max_new_tokens=16, stop_token_ids=[]) for i in range(4)]
        outs = [h.result(timeout=120) for h in hs]
        assert all(o.finish_reason == "error" and "injected device failure" in o.error for o in outs)
        assert [t for d in hs[0] for t in d.tokens] == outs[0].tokens  # the stream ends with what was delivered
        assert not engine.healthy and "injected device failure" in engine.error
        with pytest.raises(jspec.EngineError, match="injected device failure"):
            engine.submit(PROMPTS[0])
    engine = jspec.Engine(target, max_batch=1, max_prompt_len=16, max_new_tokens=16, rounds_per_chunk=1)
    slow = engine.submit(PROMPTS[0], max_new_tokens=16, stop_token_ids=[], timeout=0.001)
    waiting = engine.submit(PROMPTS[1], max_new_tokens=4, stop_token_ids=[], timeout=1e-6)
    while not (slow.done and waiting.done):
        engine.step()
    assert slow.result().finish_reason == "timeout" and waiting.result().finish_reason == "timeout"
    engine.close()
    with pytest.raises(jspec.EngineError, match="closed"):
        engine.submit(PROMPTS[0])
