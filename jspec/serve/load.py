"""A serving load test (`python -m jspec bench serve`): requests arriving as a Poisson
process at several rates, through a `jspec.Engine` per setting (plain decoding and each
speculative chain or tree), the same arrivals, prompts and weights for every setting.

Each request is greedy with a fixed output length (no stop tokens), so every setting does
the same work. Per setting and rate: throughput (generated tokens over the time from the
first arrival to the last finish), time to first token, time per output token after the
first, end-to-end latency (p50 and p99), and the mean accepted length. Each engine is
warmed up first (its programs compiled: admission buckets and the chunk), the compile
time reported.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from jspec.config import SpecConfig
from jspec.serve.engine import Engine


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


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> np.ndarray:
    """n arrival times (seconds from the start) of a Poisson process of `rate` a second."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


def _pct(values: list[float]) -> tuple[float, float]:
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


def warm_up(engine: Engine, prompt, max_new_tokens: int) -> float:
    """Compiles the engine's programs (every admission bucket and the chunk) -> seconds."""
    t0 = time.perf_counter()
    B = engine.batch
    for n in sorted({min(1 << k, B) for k in range(B.bit_length() + 1)}):  # the admission buckets
        hs = [engine.submit(prompt, max_new_tokens=min(2, max_new_tokens), stop_token_ids=[]) for _ in range(n)]
        while not all(h.done for h in hs):
            engine.step()
    while engine.step():
        pass
    return time.perf_counter() - t0


def run_serve_bench(params, prompts: Sequence, *, rates: Sequence[float], specs: Sequence[SpecConfig | None],
                    requests: int = 32, max_new_tokens: int = 64, max_batch: int = 8, rounds_per_chunk: int = 4,
                    seed: int = 0) -> list[LoadRow]:
    """One `LoadRow` per setting (None in `specs`: plain decoding, the draft left out) and
    rate; each setting's engine serves every rate in turn."""
    lens = [len(params.tokenizer(p)["input_ids"]) if isinstance(p, str) else len(p) for p in prompts]
    rows = []
    for spec in specs:
        p = params if spec is not None else params.with_draft(None)
        engine = Engine(p, max_batch=max_batch, max_prompt_len=max(lens), max_new_tokens=max_new_tokens, spec=spec,
                        rounds_per_chunk=rounds_per_chunk, max_waiting=max(requests, 1))
        compile_s = warm_up(engine, prompts[0], max_new_tokens)
        name = "plain" if spec is None else f"{spec.num_steps},{spec.topk},{spec.num_draft_tokens}"
        with engine:
            for rate in rates:
                before = dict(engine.stats)
                res = run_load(engine, prompts, rate, requests, max_new_tokens, seed)
                hs = res["handles"]
                tokens = sum(len(h.output.tokens) for h in hs)
                rounds = engine.stats["accept_rounds"] - before["accept_rounds"]
                tau = (engine.stats["accept_tokens"] - before["accept_tokens"]) / rounds if rounds else 1.0
                rows.append(LoadRow(
                    setting=name, rate=rate, requests=requests, tokens_per_s=tokens / (res["end"] - res["start"]),
                    ttft_ms=_pct([h.first_token_at - h.submitted for h in hs]),
                    tpot_ms=_pct([(h.finished_at - h.first_token_at) / max(len(h.output.tokens) - 1, 1) for h in hs]),
                    e2e_ms=_pct([h.finished_at - h.submitted for h in hs]), tau=tau, compile_s=compile_s))
    return rows


def format_load_table(rows: Sequence[LoadRow]) -> str:
    """A Markdown table, rates grouped, each row's tokens/s also as a ratio to plain
    decoding's at that rate."""
    plain = {r.rate: r.tokens_per_s for r in rows if r.setting == "plain"}
    out = ["| rate (req/s) | setting | tokens/s | vs plain | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
           "latency p50 / p99 ms | tau | compile s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r.rate, r.setting != "plain")):
        ratio = f"{r.tokens_per_s / plain[r.rate]:.2f}x" if r.rate in plain else "-"
        out.append(f"| {r.rate:g} | {r.setting} | {r.tokens_per_s:.1f} | {ratio} | {r.ttft_ms[0]:.0f} / "
                   f"{r.ttft_ms[1]:.0f} | {r.tpot_ms[0]:.1f} / {r.tpot_ms[1]:.1f} | {r.e2e_ms[0]:.0f} / "
                   f"{r.e2e_ms[1]:.0f} | {r.tau:.2f} | {r.compile_s:.1f} |")
    return "\n".join(out)
