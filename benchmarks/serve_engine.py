"""The serving engine's own cost on the 8B shape (random weights, plain decoding):

1. full batch (`--parts full`): `Compiled.run` of B requests against the engine serving
   the same B requests submitted at once (same prompts, lengths, cache), tokens/s and the
   ratio; the device's idle time: kernel spans of the engine's run and of one
   `Compiled.run` under the profiler, the idle stretches longer than `--gap-us` as a share
   of the span (the engine's idle beyond `Compiled.run`'s is its own, between chunks);
2. the decode stall a long prompt causes (`stall`): B-1 requests decoding, then one prompt
   of `--long` tokens admitted; each engine iteration's wall time before and while it is
   prefilled, whole (one pass) against blocks of `--prefill-chunk` tokens;
3. host time per chunk (`host`): B requests of `--host-new` tokens (2k) with stop strings
   that never match, the engine driven by its own thread; the driving thread's time per
   chunk outside its waits for the device, against the chunk's device time (the run's
   wall time over its chunks), and the engine's split of its CPU time: its own work
   (`stats.host_s`) and the program calls (`stats.launch_s`); `--host-twin-off` measures
   it again with one copy of each chunk program (`jspec.Engine(twin_chunks=False)`). A word-level tokenizer of the
   8B vocabulary gives the text. The timed run is served twice: with Python's garbage
   collector as it is, then inside `jspec.serve.static_heap` (as the server serves); each
   reports its longest engine iteration and the full collections that fell in it.
   It measures the engine it imports, so `PYTHONPATH=.old:.` measures an older jspec
   unpacked into .old (`git archive COMMIT jspec | tar -x -C .old`);
4. the load test on the 8B shape (`load`): `jspec.serve.load.run_serve_bench` at
   `--rates`, plain, adaptive and each fixed tier, with n-gram drafts over a target whose
   greedy next token is a fixed permutation of the previous one (its attention and MLP
   outputs zeroed: every layer still runs) and prompts half of which hold their own
   continuation (drafts accepted) and half not (drafts rejected);
5. the server's defaults at the model's whole context (`context`): the engine
   `python -m jspec serve` builds (batch derived from a pool of 0.9 of the memory),
   `--context-requests` random prompts of `--context-prompt` tokens and `--new` new ones
   submitted at once: tokens/s, TTFT, preemptions;
6. a shared system prompt (`shared`): `--batch` requests of one `--shared-prefix`-token
   prefix and `--shared-question` tokens of their own, submitted at once, prefix caching on
   against off: TTFT p50 and tokens/s;
7. oversubscription (`oversub`): 2 x `--batch` requests of `--oversub-prompt` prompt and
   new tokens at once, over a pool of every row's room, over one of half of it, and over
   that half with half the rows (`--oversub-runs`).

    PYTHONPATH=. python3 benchmarks/serve_engine.py [--shape 8b|tiny|qwen35_27b|tiny_hybrid] [--layers N]
        [--mtp] [--batch 32] [--new 256] [--parts full,stall,host,load,context,shared,oversub]
        [--settings plain|spec|both]

`--shape qwen35_27b` is the Qwen3.5-27B hybrid (Gated DeltaNet and gated attention);
`--mtp` gives the target a random MTP draft of its own kind (the engine's default
chain), for the parts that take the target (context, shared, oversub, full).

`--identical` instead serves the bundled pair's requests (the built-in prompts with
several lengths and seeds, greedy and sampled) through an adaptive engine at staggered
arrivals and counts the requests whose tokens equal the same request run alone (one
request, whole prefill, the default chain): the share of identical outputs in the
model's dtype (bf16 on a GPU, where a row's arithmetic may depend on the batch).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import numpy as np

import jspec
from benchmarks import common
from jspec.config import ModelConfig
from jspec.serve.engine import static_heap
from jspec.serve.load import full_collections

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype="float32", max_position_embeddings=8192)
TINY_HYBRID = dataclasses.replace(  # the Qwen3.5 layout in small, for a CPU check of the hybrid shape's parts
    common.QWEN35_27B, vocab_size=512, hidden_size=64, num_layers=4, layer_types=common.QWEN35_27B.layer_types[:4],
    num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=128, dtype="float32")
SHAPES = {"8b": common.LLAMA31_8B, "tiny": TINY, "qwen35_27b": common.QWEN35_27B, "tiny_hybrid": TINY_HYBRID}


def cut_layers(cfg, layers: int):
    """`cfg` with its first `layers` layers (their windows or kinds kept)."""
    fields = {"num_layers": layers}
    if getattr(cfg, "layer_types", None):
        fields["layer_types"] = tuple(cfg.layer_types)[:layers]
    if getattr(cfg, "sliding_windows", None) is not None:
        fields["sliding_windows"] = (tuple(cfg.sliding_windows) * layers)[:layers]
    return dataclasses.replace(cfg, **fields)


def with_random_mtp(params):
    """`params` with a random MTP layer of its own kind as the draft (a Qwen3.5 shape): its
    acceptance is not the point, its cost and caches are."""
    import jax
    from jspec.drafts.qwen_mtp import QwenMtpDraft, layer_config
    cfg = params.config
    draft = QwenMtpDraft(layer_config(cfg))
    weights = jax.jit(lambda key: draft.init(key, cfg.vocab_size))(jax.random.key(1))
    return params.with_draft(jspec.DraftParams(draft, weights))


def stat(engine, name: str):
    """An engine statistic (an attribute; a dict entry in older engines)."""
    s = engine.stats
    return getattr(s, name) if hasattr(s, name) else s[name]


def word_tokenizer(vocab: int):
    """A word-level tokenizer of `vocab` words ("w0", "w1", ...), decoded with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def host_time(params, batch: int, prompt: int, new: int, cache, rounds_per_chunk: int, tuning=None,
              twin_chunks=None) -> dict:
    """Host time per chunk of the engine's driving thread, B requests of `new` tokens with
    stop strings that never match (see the module); twin_chunks: as `jspec.Engine`'s."""
    import threading

    import jax
    params = dataclasses.replace(params, tokenizer=word_tokenizer(params.config.vocab_size))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, params.config.vocab_size, prompt).tolist() for _ in range(batch)]
    stops = ["w1 w1 w1 w1", "never appears"]
    engine = jspec.Engine(params, max_batch=batch, max_prompt_len=prompt, max_new_tokens=new, cache=cache,
                          tuning=tuning, rounds_per_chunk=rounds_per_chunk, twin_chunks=twin_chunks)
    waits, steps = [0.0], []  # the driving thread's readback waits; (start, seconds, waits, CPU seconds) a step
    device_get, step = jax.device_get, engine.step

    def timed_get(x):
        t = time.perf_counter()
        out = device_get(x)
        if threading.current_thread().name == "jspec-engine":
            waits[0] += time.perf_counter() - t
        return out

    def timed_step():
        t, w, c = time.perf_counter(), waits[0], time.thread_time()
        busy = step()
        steps.append((t, time.perf_counter() - t, waits[0] - w, time.thread_time() - c))
        return busy

    output = getattr(engine, "output", None)  # the output processor (on its own thread), where there is one
    output_cpu = [0.0]
    if output is not None:
        process = output.process

        def timed_process(items):
            c = time.thread_time()
            process(items)
            output_cpu[0] += time.thread_time() - c
        output.process = timed_process

    def serve():
        t0 = time.perf_counter()
        hs = [engine.submit(p, max_new_tokens=new, stop_token_ids=[], stop=stops) for p in prompts]
        outs = [h.result() for h in hs]
        return t0, time.perf_counter(), outs

    def timed_run(frozen: bool) -> dict:  # one timed serve; frozen: inside `static_heap`, as the server serves
        chunks0, own0, launch0 = stat(engine, "chunks"), stat(engine, "host_s"), getattr(engine.stats, "launch_s", 0)
        cpu0 = output_cpu[0]
        with contextlib.ExitStack() as stack:
            if frozen:
                stack.enter_context(static_heap())
            pauses = stack.enter_context(full_collections())
            t0, t1, outs = serve()
        chunks = stat(engine, "chunks") - chunks0
        own, launch = stat(engine, "host_s") - own0, getattr(engine.stats, "launch_s", 0) - launch0
        wall = t1 - t0
        timed = [x for x in steps if t0 <= x[0] <= t1]  # the steps of the timed run
        cpu = sum(x[3] for x in timed) / chunks  # the driving thread's CPU time: host work, not waits
        return {"batch": batch, "new": new, "tokens": sum(len(o.tokens) for o in outs), "chunks": chunks,
                "wall_s": wall, "chunk_ms": wall / chunks * 1e3, "host_cpu_ms_per_chunk": cpu * 1e3,
                "host_share": cpu / (wall / chunks),
                "step_ms_outside_readback_waits": sum(d - w for _, d, w, _ in timed) / chunks * 1e3,
                # the engine's own split of that CPU time (engines from 2026-11-28 on): its Python
                # work (`stats.host_s`) and the program calls (`stats.launch_s`: kernel launches)
                "own_work_ms_per_chunk": own / chunks * 1e3, "launch_cpu_ms_per_chunk": launch / chunks * 1e3,
                "output_thread_cpu_ms_per_chunk": (output_cpu[0] - cpu0) / chunks * 1e3 if output is not None else None,
                "text_chars": sum(len(o.text) for o in outs),
                # a stall of the driving thread, and whether a full garbage collection fell in the run
                "longest_step_ms": max(d for _, d, _, _ in timed) * 1e3,
                "steps_over_50ms": sum(d > 0.05 for _, d, _, _ in timed),
                "full_gcs": len(pauses), "full_gc_ms": sum(pauses) * 1e3}
    engine.warm_up([prompt], sampled=False)
    engine.step = timed_step
    jax.device_get = timed_get
    try:
        with engine:
            serve()  # compiles what it runs
            collected = timed_run(frozen=False)
            frozen = timed_run(frozen=True)
    finally:
        jax.device_get = device_get
    return {**collected, "static_heap": frozen}


def permutation_target(cfg, seed: int = 0) -> jspec.Params:
    """A target of shape `cfg` whose greedy next token is pi(token) for a fixed random
    cycle pi: attention and MLP outputs zeroed (every layer still runs), the LM head rows
    the embeddings of pi's inverse -> (params, pi)."""
    import jax
    import jax.numpy as jnp
    params = common.random_params(cfg, seed)
    rng = np.random.default_rng(seed)
    order = rng.permutation(cfg.vocab_size)
    pi = np.empty(cfg.vocab_size, np.int64)
    pi[order] = np.roll(order, -1)
    inv = jnp.asarray(np.argsort(pi))

    def edit(path, w):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "o_proj" in name or "down_proj" in name:
            return jnp.zeros_like(w)
        return w
    w = jax.tree_util.tree_map_with_path(edit, params.weights)
    e = w["params"]["embed_tokens"]["embedding"].astype(jnp.float32)
    e = e / jnp.linalg.norm(e, axis=1, keepdims=True)
    w["params"]["embed_tokens"]["embedding"] = e.astype(cfg.jnp_dtype)
    w["params"]["lm_head"]["kernel"] = (4.0 * e[inv]).T.astype(cfg.jnp_dtype)
    return jspec.Params(config=cfg, weights=w), pi


def load_8b(cfg, rates, requests: int, batch: int, new: int, prompt: int, settings: str = "both", tuning=None) -> list:
    """`run_serve_bench` on the permutation target with n-gram drafts (see the module);
    settings: "plain" (its own engine), "spec" (adaptive and the fixed tiers, one engine)
    or "both"."""
    from jspec.serve.load import format_load_table, run_serve_bench
    from jspec.serve.tiers import Adaptive, default_tiers
    target, pi = permutation_target(cfg)
    rng = np.random.default_rng(3)
    prompts = []
    for i in range(16):
        t = int(rng.integers(cfg.vocab_size))
        run = [t]
        for _ in range(prompt + new):
            run.append(int(pi[run[-1]]))
        h = prompt // 2
        if i % 2:  # the tokens after its second half open its first half: the lookup drafts them
            prompts.append(run[h - 8: 2 * h - 8] + run[:h])
        else:
            prompts.append(run[:prompt])
    params = target.with_draft(jspec.NgramDraft())
    specs = [None] if settings != "spec" else []
    if settings != "plain":
        specs += [Adaptive(), *[t for t in default_tiers(jspec.SpecConfig(3)) if t is not None]]
    t0 = time.perf_counter()
    rows = run_serve_bench(params, prompts, rates=rates, specs=specs, requests=requests, max_new_tokens=new,
                           max_batch=batch, tuning=tuning, progress=lambda line: print(f"[{time.perf_counter() - t0:6.1f} s] {line}",
                                                                       flush=True))
    print(format_load_table(rows), flush=True)
    return [r.__dict__ for r in rows]


def full_batch(params, prompts, new: int, cache, tuning=None, rounds_per_chunk: int = 4) -> dict:
    """Compiled.run against the engine on the same full batch, and the engine's idle gaps."""
    B = len(prompts)
    prog = jspec.compile(params, prompts, max_new_tokens=new, stop_token_ids=[], cache=cache, tuning=tuning)
    prog.run()
    run_s = []
    for _ in range(3):
        out = prog.run()
        run_s.append(out.timing["run_s"])
    tokens = B * new
    _, run_trace = common.traced(lambda: prog.run().tokens)
    # (no prefix caching: the same prompts are served four times, as Compiled.run runs them)
    engine = jspec.Engine(params, max_batch=B, max_prompt_len=len(prompts[0]), max_new_tokens=new, cache=cache,
                          tuning=tuning, rounds_per_chunk=rounds_per_chunk, prefix_caching=False)

    def serve():
        hs = [engine.submit(p, max_new_tokens=new, stop_token_ids=[]) for p in prompts]
        t0 = time.perf_counter()
        while engine.step():
            pass
        lens = [len(h.result().tokens) for h in hs]
        if any(n != new for n in lens):
            raise AssertionError(f"token counts {lens}, reasons {[h.result().finish_reason for h in hs][:4]}, "
                                 f"expected {new}")
        return time.perf_counter() - t0, stat(engine, "chunks")
    t0 = time.perf_counter()
    serve()  # compiles what it runs
    warm = time.perf_counter() - t0
    engine_s = []
    for _ in range(3):
        engine_s.append(serve()[0])
    calls = []  # a whole iteration's host time
    step = engine.step

    def timed():
        t = time.perf_counter()
        r = step()
        calls.append(time.perf_counter() - t)
        return r
    engine.step = timed
    serve()
    engine.step = step
    host = {"step_call_ms_median": float(np.median(calls)) * 1e3}
    before = stat(engine, "chunks")
    (_, chunks), trace = common.traced(serve)
    chunks -= before
    return {"batch": B, "new": new, "run_tokens_per_s": tokens / float(np.median(run_s)),
            "engine_tokens_per_s": tokens / float(np.median(engine_s)),
            "engine_vs_run": float(np.median(run_s)) / float(np.median(engine_s)), "warm_up_s": warm,
            "chunks": chunks, "trace": trace, "run_trace": run_trace, **host}


def burst(engine, prompts, new: int) -> dict:
    """Every prompt submitted at once to a started engine, greedy, exactly `new` tokens each
    -> tokens/s (generated tokens over the first submission to the last finish), TTFT and
    latency p50 / p99 ms, and the preemptions and prefix-cache hits and queries (tokens)."""
    s = engine.stats
    before = (s.num_preemptions, s.prefix_cache_hits, s.prefix_cache_queries)
    hs = [engine.submit(p, max_new_tokens=new, stop_token_ids=[]) for p in prompts]
    lens = [len(h.result().tokens) for h in hs]
    if any(n != new for n in lens):
        raise AssertionError(f"token counts {sorted(set(lens))}, expected {new}: "
                             f"{sorted({h.result().finish_reason for h in hs})}")
    start, end = min(h.submitted for h in hs), max(h.finished_at for h in hs)

    def pct(xs):
        return [float(np.percentile(xs, q)) * 1e3 for q in (50, 99)]
    return {"requests": len(prompts), "tokens_per_s": new * len(prompts) / (end - start), "seconds": end - start,
            "ttft_ms": pct([h.first_token_at - h.submitted for h in hs]),
            "latency_ms": pct([h.finished_at - h.submitted for h in hs]),
            "preemptions": s.num_preemptions - before[0], "prefix_hit_tokens": s.prefix_cache_hits - before[1],
            "prefix_query_tokens": s.prefix_cache_queries - before[2]}


def full_context(params, requests: int, prompt: int, new: int, vocab: int) -> dict:
    """The server's defaults on the model's whole context (`python -m jspec serve` builds
    this engine: batch derived from a pool of 0.9 of the memory), `requests` random
    prompts of `prompt` tokens and `new` new ones submitted at once."""
    rng = np.random.default_rng(4)
    max_len = params.config.max_position_embeddings
    t0 = time.perf_counter()
    engine = jspec.Engine(params, max_batch=None, max_len=max_len, max_prompt_len=max_len - 1,
                          max_new_tokens=max_len - 1, memory_utilization=0.9)
    lay = engine.plan.layout
    out = {"max_len": max_len, "batch": engine.batch, "pool_tokens": lay.num_pages * lay.page_size,
           "pool": engine.runner.pool_note, "build_s": time.perf_counter() - t0}
    print("context:", out, flush=True)
    out["warm_up_s"] = engine.warm_up([prompt], sampled=False, logprobs=False)
    out["programs"] = stat(engine, "programs")
    with engine:
        burst(engine, [rng.integers(1, vocab, prompt).tolist() for _ in range(8)], 8)
        out["run"] = burst(engine, [rng.integers(1, vocab, prompt).tolist() for _ in range(requests)], new)
    return out


def shared_prefix(params, batch: int, requests: int, prefix: int, question: int, new: int, vocab: int,
                  prefill_chunk: int = 512, off_in_place: bool = False) -> dict:
    """`requests` prompts of one `prefix`-token system prompt and a `question`-token
    question of their own, submitted at once, with prefix caching on and off (an engine
    each; a warm-up burst on another system prompt first). off_in_place: off is the same
    engine after its pool stops caching (`PagePool.prefix_caching` False: nothing looked up,
    registered or snapshotted; the same programs, none compiled again), not an engine built
    with prefix_caching=False (whose programs differ where a hybrid keeps snapshots)."""
    rng = np.random.default_rng(5)
    out = {}

    def bursts(engine):  # the warm-up burst, then the measured one
        for n in (4, requests):
            system = rng.integers(1, vocab, prefix).tolist()
            r = burst(engine, [system + rng.integers(1, vocab, question).tolist() for _ in range(n)], new)
        return r

    def record(name, r, engine, warm):
        out[name] = r | {"warm_up_s": warm, "programs": stat(engine, "programs")}
        print(f"shared prefix, caching {name}:", common.rounded(out[name]), flush=True)

    for caching in (True, False) if not off_in_place else (True,):
        engine = jspec.Engine(params, max_batch=batch, max_prompt_len=prefix + question, max_new_tokens=new,
                              prefix_caching=caching, prefill_chunk=prefill_chunk)
        warm = engine.warm_up([prefix + question], sampled=False, logprobs=False)
        with engine:
            record("on" if caching else "off", bursts(engine), engine, warm)
            if off_in_place:
                engine.pool.prefix_caching = False
                record("off", bursts(engine), engine, 0.0)
    on, off = out["on"], out["off"]
    out["ttft_p50_off_over_on"] = off["ttft_ms"][0] / on["ttft_ms"][0]
    out["tokens_per_s_on_over_off"] = on["tokens_per_s"] / off["tokens_per_s"]
    return out


def oversubscribed(params, batch: int, requests: int, prompt: int, new: int, vocab: int,
                   runs=("whole", "half", "fit")) -> dict:
    """`requests` prompts of `prompt` tokens and `new` new ones submitted at once, `runs` of:
    whole, `batch` rows over a pool of every row's whole room; half, `batch` rows over half
    of it (the rows' page demand twice the pool: requests preempted and resumed); fit, half
    the rows over that half pool (every row's room fits: the pool uncongested)."""
    rng = np.random.default_rng(6)
    whole = jspec.Engine(params, max_batch=batch, max_prompt_len=prompt, max_new_tokens=new,
                         cache=jspec.CacheConfig("paged", page_size=16)).plan.layout.num_pages
    shapes = {"whole": (batch, whole), "half": (batch, whole // 2), "fit": (batch // 2, whole // 2)}
    out = {}
    for key in runs:
        rows, pages = shapes[key]
        engine = jspec.Engine(params, max_batch=rows, max_prompt_len=prompt, max_new_tokens=new,
                              cache=jspec.CacheConfig("paged", page_size=16, num_pages=pages))
        # (a resumed prompt holds its output: the preempting engine's longest prompt is longer)
        warm = engine.warm_up([prompt, engine.runner.max_prompt_len], sampled=False, logprobs=False)
        with engine:
            burst(engine, [rng.integers(1, vocab, prompt).tolist() for _ in range(4)], 8)
            r = burst(engine, [rng.integers(1, vocab, prompt).tolist() for _ in range(requests)], new)
        out[key] = r | {"batch": rows, "pool_tokens": pages * 16, "warm_up_s": warm,
                        "programs": stat(engine, "programs")}
        print(f"oversubscription, {key}:", common.rounded(out[key]), flush=True)
    for a, b in (("half", "whole"), ("half", "fit")):
        if a in out and b in out:
            out[f"{a}_over_{b}"] = out[a]["tokens_per_s"] / out[b]["tokens_per_s"]
    return out


def idle_between_chunks(trace: str, chunks: int, gap_us: float) -> dict:
    _, spans = common.kernel_spans(trace)
    if not spans:
        return {"note": "no GPU kernels in the trace (CPU run)"}
    busy, gaps = common.busy_and_gaps(spans)
    long = [g for g in gaps if g > gap_us]
    span_us = (spans[-1][1] - spans[0][0]) / 1e3
    events = sorted((e for evs in common.trace_events(trace).values() for e in evs), key=lambda e: e[2])
    big, end, prev = [], None, None
    for _, name, start, dur in events:
        if end is not None and (start - end) / 1e3 > 1000:
            big.append((round((start - end) / 1e3), prev[:40], name[:40]))
        if end is None or start + dur > end:
            end, prev = start + dur, name
    hist = {"20-100us": sum(gap_us < g <= 100 for g in gaps), "0.1-1ms": sum(100 < g <= 1000 for g in gaps),
            ">1ms": sum(g > 1000 for g in gaps), ">1ms_total_ms": sum(g for g in gaps if g > 1000) / 1e3}
    return {"gap_histogram": hist, "gaps_over_1ms": big[:12],
            "span_ms": span_us / 1e3, "busy_ms": busy / 1e3, "idle_share": 1 - busy / span_us,
            "long_gaps": len(long), "long_gap_ms_total": sum(long) / 1e3, "chunks": chunks,
            "long_gap_share": sum(long) / span_us, "long_gap_us_median": float(np.median(long)) if long else 0.0}


def stall(params, batch: int, long: int, short: int, new: int, chunk: int, cache, vocab: int) -> dict:
    """Per-iteration wall times while a `long`-token prompt joins batch-1 decoding rows."""
    rng = np.random.default_rng(0)
    engine = jspec.Engine(params, max_batch=batch, max_prompt_len=long, max_new_tokens=new, cache=cache,
                          prefill_chunk=chunk)

    def once():
        shorts = [rng.integers(1, vocab, short).tolist() for _ in range(batch - 1)]
        hs = [engine.submit(p, max_new_tokens=new, stop_token_ids=[]) for p in shorts]
        for _ in range(6):
            engine.step()
        times = []
        for _ in range(8):  # decoding only
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        h = engine.submit(rng.integers(1, vocab, long).tolist(), max_new_tokens=8, stop_token_ids=[])
        during = []
        while not h.tokens and not h.done:
            t = time.perf_counter()
            engine.step()
            during.append(time.perf_counter() - t)
        for x in hs:
            x.cancel()
        engine.close()
        return float(np.median(times)), during
    t0 = time.perf_counter()
    once()  # compiles what it runs
    warm = time.perf_counter() - t0
    base, during = once()
    chunk_of = engine.runner.prefill_chunk if hasattr(engine, "runner") else engine.prefill_chunk
    return {"prefill_chunk": chunk_of, "warm_up_s": warm, "decode_step_ms": base * 1e3,
            "iterations_until_first_token": len(during), "max_step_ms": max(during) * 1e3,
            "max_stall_ms": (max(during) - base) * 1e3, "extra_ms_total": (sum(during) - base * len(during)) * 1e3}


def identical(batch: int, requests: int, new: int) -> dict:
    import os

    from jspec.bench import BUILTIN_PROMPTS
    from jspec.serve.load import poisson_arrivals
    bundle = os.path.join(os.path.dirname(jspec.__file__), "bundle")
    params = jspec.load(os.path.join(bundle, "target"), draft=os.path.join(bundle, "eagle3"))
    cases = [(BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)], new - 8 * (i % 4),
              {} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": i}) for i in range(requests)]
    engine = jspec.Engine(params, max_batch=batch, max_prompt_len=64, max_new_tokens=new, spec=jspec.Adaptive())
    engine.warm_up([len(params.tokenizer(p)["input_ids"]) for p, _, _ in cases])
    arrivals = poisson_arrivals(batch * 20.0, requests, seed=3)
    handles = []
    with engine:
        t0 = time.perf_counter()
        for (prompt, m, sampling), at in zip(cases, arrivals):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            handles.append(engine.submit(prompt, max_new_tokens=m, stop_token_ids=[], **sampling))
        outs = [h.result() for h in handles]
    longest = max((p for p, _, _ in cases), key=lambda p: len(params.tokenizer(p)["input_ids"]))
    alone = jspec.compile(params, longest, max_new_tokens=new, stop_token_ids=[], temperature=0.5)  # a batch of one
    same = [alone.run(p, max_new_tokens=m, stop_token_ids=[], **({"temperature": 0.0} | s)).tokens == o.tokens
            for (p, m, s), o in zip(cases, outs)]
    greedy = [x for x, (_, _, s) in zip(same, cases) if not s]
    return {"requests": requests, "identical": sum(same), "identical_greedy": sum(greedy), "greedy": len(greedy),
            "tiers": stat(engine, "tier_chunks"), "dtype": params.config.dtype}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--mtp", action="store_true", help="a random MTP draft for the target (Qwen3.5 shapes)")
    ap.add_argument("--layers", type=int, default=None, help="the shape cut to this many layers (fewer compiles)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of the full-batch requests")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--stall-batch", type=int, default=8)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--gap-us", type=float, default=20.0)
    ap.add_argument("--parts", default="full,stall", help="comma-separated parts: full,stall,host,load,context,shared,oversub")
    ap.add_argument("--context-requests", type=int, default=64, help="the context part's requests (of --new tokens)")
    ap.add_argument("--context-prompt", type=int, default=2048, help="the context part's prompt tokens")
    ap.add_argument("--shared-prefix", type=int, default=4096, help="the shared part's system prompt tokens")
    ap.add_argument("--shared-question", type=int, default=128, help="the shared part's own tokens a request")
    ap.add_argument("--shared-new", type=int, default=128, help="the shared part's new tokens a request")
    ap.add_argument("--off-in-place", action="store_true", help="the shared part's caching off in the same engine "
                                                                "(see shared_prefix)")
    ap.add_argument("--oversub-prompt", type=int, default=512, help="the oversub part's prompt and new tokens")
    ap.add_argument("--oversub-runs", default="whole,half,fit", help="the oversub part's pools (see oversubscribed)")
    ap.add_argument("--host-new", type=int, default=2048, help="tokens each request of the host part generates")
    ap.add_argument("--host-twin-off", action="store_true", help="the host part again with twin_chunks=False")
    ap.add_argument("--rates", type=float, nargs="+", default=[16.0, 64.0, 256.0], help="the load part's rates")
    ap.add_argument("--requests", type=int, default=96, help="the load part's requests a rate")
    ap.add_argument("--load-new", type=int, default=64, help="the load part's tokens a request")
    ap.add_argument("--settings", default="both", choices=["plain", "spec", "both"],
                    help="the load part's settings: plain decoding, spec (adaptive and the fixed tiers), both")
    ap.add_argument("--identical", action="store_true", help="the bundled pair's share of identical outputs")
    ap.add_argument("--rounds-per-chunk", type=int, default=4)
    ap.add_argument("--tag", default="", help="result file serve_engine_{shape}_{tag}.json")
    ap.add_argument("--xla", default="", help="XLA options (NAME=VALUE;NAME=VALUE) for every program: the engines' and, in the full part, "
                    "Compiled.run's")
    args = ap.parse_args()
    if args.identical:
        r = identical(args.batch, 64, 64)
        print("identical:", r)
        print("saved", common.save_json("serve_identical.json", {"env": common.env_info(), **r}))
        return
    cfg = SHAPES[args.shape]
    if args.layers:
        cfg = cut_layers(cfg, args.layers)
    parts = args.parts.split(",")
    if parts == ["load"]:  # the load part makes its own target
        params = None
    else:
        params = common.random_params(cfg)
        if args.mtp:
            params = with_random_mtp(params)
    vocab = cfg.vocab_size
    cache = jspec.CacheConfig("paged", page_size=16)
    shape = args.shape + (f"_{args.layers}layers" if args.layers else "") + ("_mtp" if args.mtp else "")
    out = {"env": common.env_info(), "shape": shape}
    name = f"serve_engine_{shape}{'_' + args.tag if args.tag else ''}.json"
    rng = np.random.default_rng(1)
    options = tuple(tuple(kv.split("=", 1)) for kv in args.xla.split(";") if kv)
    tuning = jspec.Tuning(xla_options=options) if options else None
    out["xla_options"] = dict(options)
    if "host" in parts:
        r = host_time(params, args.batch, args.prompt, args.host_new, cache, args.rounds_per_chunk, tuning)
        out["host"] = r
        print("host:", common.rounded(r), flush=True)
        if args.host_twin_off:  # the same engine with one copy of each chunk program, same process
            out["host_twin_off"] = host_time(params, args.batch, args.prompt, args.host_new, cache,
                                             args.rounds_per_chunk, tuning, twin_chunks=False)
            print("host, twin_chunks=False:", common.rounded(out["host_twin_off"]), flush=True)
    if "load" in parts:
        out["load"] = load_8b(cfg, args.rates, args.requests, args.batch, args.load_new, args.prompt, args.settings,
                              tuning)
        print("saved", common.save_json(name, out), flush=True)  # before any later part
    if "context" in parts:
        out["context"] = full_context(params, args.context_requests, args.context_prompt, args.new, vocab)
        print("context:", common.rounded(out["context"]), flush=True)
        print("saved", common.save_json(name, out), flush=True)
    if "shared" in parts:
        out["shared"] = shared_prefix(params, args.batch, args.batch, args.shared_prefix, args.shared_question,
                                      args.shared_new, vocab, args.prefill_chunk, args.off_in_place)
        print("saved", common.save_json(name, out), flush=True)
    if "oversub" in parts:
        out["oversub"] = oversubscribed(params, args.batch, 2 * args.batch, args.oversub_prompt, args.oversub_prompt,
                                        vocab, args.oversub_runs.split(","))
        print("saved", common.save_json(name, out), flush=True)
    if "full" in parts:
        prompts = [rng.integers(1, vocab, args.prompt).tolist() for _ in range(args.batch)]
        fb = full_batch(params, prompts, args.new, cache, tuning, args.rounds_per_chunk)
        fb["idle"] = idle_between_chunks(fb.pop("trace"), fb["chunks"], args.gap_us)
        fb["run_idle"] = idle_between_chunks(fb.pop("run_trace"), 0, args.gap_us)  # Compiled.run: one program
        out["full_batch"] = fb
        print(common.rounded({k: v for k, v in fb.items() if k not in ("idle", "run_idle")}), flush=True)
        print("idle (engine):", common.rounded(fb["idle"]), flush=True)
        print("idle (Compiled.run):", common.rounded(fb["run_idle"]), flush=True)
    if "stall" in parts:
        out["stall"] = []
        for chunk in (args.long, args.prefill_chunk):  # whole (chunk >= the prompt bucket) and in blocks
            r = stall(params, args.stall_batch, args.long, 64, 256, chunk, cache, vocab)
            out["stall"].append(r)
            print("stall:", common.rounded(r), flush=True)
    print("saved", common.save_json(name, out))


if __name__ == "__main__":
    main()
