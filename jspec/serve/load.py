"""A serving load test (`python -m jspec bench serve`): requests arriving as a Poisson
process at several rates, through a `jspec.Engine` per setting (plain decoding without
the draft, adaptive speculation, each fixed chain or tree), the same arrivals, prompts
and weights for every setting.

Each request is greedy with a fixed output length (no stop tokens), so every setting does
the same work. Per setting and rate: throughput (generated tokens over the time from the
first arrival to the last finish), time to first token, time per output token after the
first, end-to-end latency (p50 and p99), the mean accepted length and the share of chunks
each tier ran. Each engine is warmed up first (`Engine.warm_up`: its programs compiled,
adaptive round costs measured), that time reported; it then serves with the objects alive
after warm-up out of Python's full garbage collections (`static_heap`).

Adaptive speculation and the fixed settings among its tiers run on one engine (a fixed
setting pins its tier: `Engine.pin_tier`), so they share their compiled programs and
their state's shape (sized for the deepest tier); plain decoding runs on an engine
without the draft, other fixed settings on engines of their own.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Sequence

import numpy as np

from jspec.serve.engine import Engine, static_heap
from jspec.serve.tiers import Adaptive, buckets, tier_name


@dataclasses.dataclass(frozen=True)
class LoadRow:
    setting: str  # "plain" or "S,K,N"
    rate: float  # requests a second
    requests: int
    tokens_per_s: float
    ttft_ms: tuple[float, float]  # p50, p99
    tpot_ms: tuple[float, float]
    e2e_ms: tuple[float, float]
    tau: float
    compile_s: float
    tiers: str = ""  # share of chunks each tier ran, e.g. "3,1,4 80%, 5,1,6 20%"
    longest_step_ms: float = 0.0  # the engine's longest iteration (`EngineStats.longest_step_s`)
    full_gcs: int = 0  # Python's full garbage collections while the requests ran
    full_gc_ms: float = 0.0  # and their time together


@contextlib.contextmanager
def full_collections():
    """Python's full (generation 2) garbage collections while inside -> the list of their
    seconds, filled as they end: a stall of the engine's thread told from the device's."""
    pauses, began = [], []

    def watch(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                began.append(time.perf_counter())
            elif began:
                pauses.append(time.perf_counter() - began.pop())
    gc.callbacks.append(watch)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(watch)


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> np.ndarray:
    """n arrival times (seconds from the start) of a Poisson process of `rate` a second."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


def percentiles(values: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds of values in seconds (NaN when there are none)."""
    return (float(np.percentile(values, 50)) * 1e3, float(np.percentile(values, 99)) * 1e3) if values else (
        float("nan"), float("nan"))


def run_load(engine: Engine, prompts: Sequence, rate: float, n: int, max_new_tokens: int, seed: int = 0) -> dict:
    """Submits n requests (prompts in turn) at Poisson arrival times to a started engine,
    waits for all -> their handles and the wall time from the first arrival."""
    arrivals = poisson_arrivals(rate, n, seed)
    t0 = time.perf_counter()
    handles = []
    for i, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        handles.append(engine.submit(prompts[i % len(prompts)], max_new_tokens=max_new_tokens, stop_token_ids=[]))
    for h in handles:
        h.result()
    return {"handles": handles, "start": t0, "end": max(h.finished_at for h in handles)}


def setting_name(spec) -> str:
    return "adaptive" if isinstance(spec, Adaptive) else tier_name(spec)


def format_costs(engine: Engine) -> str:
    """The adaptive choice's round costs in ms, per tier over the occupancy buckets
    ("plain 5.1 5.2 ..., 1,1,2 ..."), as it uses them now (start-up, then online)."""
    costs = engine.scheduler.chooser.costs
    ns = buckets(engine.batch)
    return f"round costs ms at {'/'.join(map(str, ns))} rows: " + ", ".join(
        f"{tier_name(t)} " + " ".join(f"{costs[i, n] * 1e3:.2f}" for n in ns) for i, t in enumerate(engine.tiers))


def tier_shares(before: dict, after: dict) -> str:
    """Chunks each tier ran between two `tier_chunks` counts -> "S,K,N 80%, ..." (tiers
    that ran)."""
    ran = {t: after[t] - before.get(t, 0) for t in after}
    total = sum(ran.values())
    return ", ".join(f"{t} {100 * n / total:.0f}%" for t, n in ran.items() if n) if total else ""


def measure_rate(engine: Engine, setting: str, rate: float, prompts: Sequence, requests: int, max_new_tokens: int,
                 seed: int, compile_s: float) -> LoadRow:
    """`run_load` on a started engine -> its row (the engine's stats read before and after)."""
    s = engine.stats
    before = (dict(s.tier_chunks), s.accept_rounds, s.accept_tokens)
    s.longest_step_s = 0.0
    with full_collections() as pauses:
        res = run_load(engine, prompts, rate, requests, max_new_tokens, seed)
    hs = res["handles"]
    tokens = sum(len(h.output.tokens) for h in hs)
    rounds = s.accept_rounds - before[1]
    return LoadRow(
        setting=setting, rate=rate, requests=requests, tokens_per_s=tokens / (res["end"] - res["start"]),
        ttft_ms=percentiles([h.first_token_at - h.submitted for h in hs]),
        tpot_ms=percentiles([(h.finished_at - h.first_token_at) / max(len(h.output.tokens) - 1, 1) for h in hs]),
        e2e_ms=percentiles([h.finished_at - h.submitted for h in hs]),
        tau=(s.accept_tokens - before[2]) / rounds if rounds else 1.0, compile_s=compile_s,
        tiers=tier_shares(before[0], s.tier_chunks), longest_step_ms=s.longest_step_s * 1e3,
        full_gcs=len(pauses), full_gc_ms=sum(pauses) * 1e3)


def run_serve_bench(params, prompts: Sequence, *, rates: Sequence[float], specs: Sequence, requests: int = 32,
                    max_new_tokens: int = 64, max_batch: int = 8, rounds_per_chunk: int = 4, seed: int = 0,
                    prefill_chunk: int = 512, tuning=None, prefix_caching: bool = True,
                    progress: Callable[[str], None] | None = None) -> list[LoadRow]:
    """One `LoadRow` per setting and rate; a setting is None (plain decoding, the draft left
    out), a SpecConfig (fixed) or an `Adaptive`. Each engine serves every rate of each of
    its settings in turn (see the module for which settings share one). tuning: the
    engines' `jspec.Tuning` (None: the default); prefix_caching: the engines'. progress, where
    given, is called with a line before and after each engine's warm-up and after each row
    (for adaptive speculation also with the round costs the choice uses: after the
    warm-up, the start-up measurement; after each of its rows, as measured online)."""
    say = progress or (lambda line: None)
    lens = [len(params.tokenizer(p)["input_ids"]) if isinstance(p, str) else len(p) for p in prompts]
    adaptive = next((s for s in specs if isinstance(s, Adaptive)), None)

    def engine_for(spec):
        p = params if spec is not None else params.with_draft(None)
        engine = Engine(p, max_batch=max_batch, max_prompt_len=max(lens), max_new_tokens=max_new_tokens, spec=spec,
                        tuning=tuning, rounds_per_chunk=rounds_per_chunk, max_waiting=max(requests, 1),
                        prefill_chunk=prefill_chunk, prefix_caching=prefix_caching)
        say(f"warming up the {'plain' if spec is None else setting_name(spec)} engine")
        seconds = engine.warm_up(lens, sampled=False, logprobs=False)  # the requests are greedy
        say(f"warm-up {seconds:.1f} s, {engine.stats.programs} programs")
        if engine.scheduler.chooser is not None:
            say(format_costs(engine))
        return engine, seconds
    shared = engine_for(adaptive) if adaptive is not None else None
    rows = []
    for spec in specs:
        if isinstance(spec, Adaptive) or (shared is not None and spec is not None and spec in shared[0].tiers):
            engine, compile_s = shared
            engine.pin_tier(None if isinstance(spec, Adaptive) else shared[0].tiers.index(spec))
        else:
            engine, compile_s = engine_for(spec)
        engine.start()
        with static_heap():  # no full garbage collection over the warm-up's objects while timed
            for rate in rates:
                rows.append(measure_rate(engine, setting_name(spec), rate, prompts, requests, max_new_tokens, seed,
                                         compile_s))
                say(format_load_table(rows[-1:]).splitlines()[-1] + f" longest step {rows[-1].longest_step_ms:.1f} "
                    f"ms; {rows[-1].full_gcs} full garbage collections ({rows[-1].full_gc_ms:.1f} ms)")
                if isinstance(spec, Adaptive):
                    say(format_costs(engine))
        if shared is None or engine is not shared[0]:
            engine.close()
    if shared is not None:
        shared[0].close()
    return rows


def format_load_table(rows: Sequence[LoadRow]) -> str:
    """A Markdown table, rates grouped, each row's tokens/s also as a ratio to plain
    decoding's at that rate."""
    plain = {r.rate: r.tokens_per_s for r in rows if r.setting == "plain"}
    out = ["| rate (req/s) | setting | tokens/s | vs plain | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
           "latency p50 / p99 ms | tau | tiers run | warm-up s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r.rate, r.setting != "plain")):
        ratio = f"{r.tokens_per_s / plain[r.rate]:.2f}x" if r.rate in plain else "-"
        out.append(f"| {r.rate:g} | {r.setting} | {r.tokens_per_s:.1f} | {ratio} | {r.ttft_ms[0]:.0f} / "
                   f"{r.ttft_ms[1]:.0f} | {r.tpot_ms[0]:.1f} / {r.tpot_ms[1]:.1f} | {r.e2e_ms[0]:.0f} / "
                   f"{r.e2e_ms[1]:.0f} | {r.tau:.2f} | {r.tiers} | {r.compile_s:.1f} |")
    return "\n".join(out)
