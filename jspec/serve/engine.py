"""A serving engine: requests submitted at any time join a running batch between chunks
of rounds and leave it the moment they finish.

`Engine` wires three parts, shaped like vLLM v1's engine core:
- the scheduler (`jspec.serve.scheduler`): pure host logic: the queue, which request
  holds which row, prompts passed a block at a time, the speculation tier, and each
  request's end; it turns them into decisions each iteration;
- the runner (`jspec.serve.runner`): the compiled programs and the device state, which
  executes the decisions (admissions, prefill blocks, chunks of rounds, evictions);
- the output processor (`jspec.serve.output`): token ids into text incrementally, stop
  strings, the requests' `Handle`s; on its own thread while the engine runs one.

One iteration (`step`; its own thread after `start()` / `with engine:`): the scheduler
decides, the runner dispatches, the admissions' readbacks are read (their first tokens;
the chunk behind them is queued already), and the oldest chunk in flight is read back
unless a second chunk could go behind it first; what each readback says goes to the
scheduler (which requests finished, the tier choice's acceptance and costs) and to the
output processor. While no request waits and no prompt is half prefilled two chunks are
in flight and the device never waits for the host.

A request's tokens depend only on the request itself (its prompt, values and seed: see
`jspec.loop.rows`), so they are the same whatever shares the batch, whenever it joined,
and whichever tier ran its rounds (target-only verification; with `sample_drafts`,
sampled tokens keep the target's distribution but depend on the drafts).

Faults: an exception in an iteration fails every running and waiting request at once
(finish_reason "error" with the message), the engine stops, `healthy` turns False and
`submit` raises `EngineError`; the log names the cause. A request may carry a time limit
(`request_timeout`), after which it ends with finish_reason "timeout".
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from jspec import requests as rq
from jspec.config import CacheConfig, SpecConfig
from jspec.loop.state import MAX_LOGPROBS, unpack_window
from jspec.models import family_for
from jspec.params import Params
from jspec.results import token_logprobs
from jspec.serve.output import Delivery, Handle, OutputProcessor, RequestOutput
from jspec.serve.pages import PagePool
from jspec.serve.runner import NUM_STOP, Runner
from jspec.serve.scheduler import QueueFull, Request, Scheduler
from jspec.serve.stats import EngineStats
from jspec.serve.tiers import Adaptive, Chooser, buckets, default_tiers, measure_costs, tier_name

__all__ = ["Engine", "EngineError", "Handle", "QueueFull", "RequestOutput", "static_heap"]

log = logging.getLogger("jspec.serve")

# The engine's command buffers on a GPU (where neither the family nor the tuning sets them):
# graphs of its kernels, but not XLA's default graphs over while loops and conditionals, which
# XLA re-recorded before every chunk (3.3 ms an 8B chunk on an H100). With none at all the
# driving thread launches every kernel itself: 21.5 ms of CPU a 24 ms 8B chunk at batch 32 on
# an H200, against 3.2 ms with these (docs/benchmarks.md, "The engine's own cost after the split").
SERVE_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
# A batch derived from the pool (`max_batch=None`): a row for every ROW_TOKENS of its tokens,
# a power of two from 8 to 128 rows; always 8 on the CPU, where a chunk costs in proportion
# to its rows (on a GPU a decode step reads the weights once for every row).
ROW_TOKENS = 4096
DERIVED_ROWS = (8, 128)
HOST_ENDS = ("cancelled", "timeout")  # finish reasons the engine itself delivers when it evicts the row


@contextlib.contextmanager
def static_heap():
    """While serving: every Python object alive on entry (after warm-up: the weights, the
    compiled programs and the traces and lowerings JAX keeps of them, 1.2 million objects
    for the bundled pair's plain engine) is left out of Python's cyclic garbage
    collection, and given back to it on exit (`gc.unfreeze`: every frozen object). A
    full collection walks every tracked object: over that heap one took 0.5-0.8 s on a
    2-core CPU, time the engine's thread would not dispatch chunks if one fell while
    serving. vLLM's server freezes its start-up heap the same way. Objects freed by their
    reference counts are freed as before; only cycles among the frozen ones wait."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class EngineError(RuntimeError):
    """The engine failed (its message names the cause) or was closed: it takes no requests."""


@dataclasses.dataclass
class Inflight:
    """A chunk dispatched and not yet read back."""

    back: Any  # its window readback, on the device
    rows: dict  # row -> Request, the rows it ran
    tier: int
    dispatched: float
    clean: bool  # nothing else was queued on the device before it since the previous chunk


def derived_batch(pool_tokens: int, platform: str) -> int:
    """The batch of an engine given no max_batch, from its page pool's tokens (see
    ROW_TOKENS) on a device of `platform` ("cpu", "gpu", ...)."""
    least, most = DERIVED_ROWS
    if platform == "cpu":
        return least
    rows = max(pool_tokens // ROW_TOKENS, 1)
    return min(max(1 << (rows.bit_length() - 1), least), most)


class Engine:
    """Continuous batching over one batch of `max_batch` rows (see the module).

    params: a `jspec.Params` (with a draft: speculative rounds). spec: a SpecConfig (fixed
    speculation; None: the proposer's default), or `jspec.Adaptive(...)` (a tier chosen
    before each chunk, `jspec.serve.tiers`). max_prompt_len, max_new_tokens: the largest
    request the engine takes (they size the programs and caches; a larger one is refused
    at `submit`). max_batch: rows decoded together; None: derived from a paged cache's pool
    (`derived_batch`: a row per ROW_TOKENS tokens of it, 8 to 128 rows; 8 on the CPU or
    with a dense cache). cache: as `jspec.compile`, paged by default (None); a pool smaller than
    every row's whole room (`CacheConfig(num_pages=...)`) admits requests only while the
    pages they may come to hold fit (`jspec.serve.scheduler`: the rest wait, none is cut
    short; one that could never fit is refused at `submit`). memory_utilization: a paged
    cache of no given size takes the pages that fit in this share of the device's memory
    beside the weights (at most every row's whole room; None: every row's whole room,
    whatever the memory). preemption: with such a pool, admit requests by the pages they
    hold now and preempt the latest when the rows' growth would not fit (each resumes where
    it stopped, its output the same); False: admit by the pages each may come to hold, and
    never preempt (`jspec.serve.scheduler`). prefix_caching: a paged cache keeps the full
    pages of prompts and outputs, and a request whose prompt begins with a kept prefix
    shares those pages and is prefilled from past them (`jspec.serve.pages`; a hybrid
    linear-attention target's at whole prompt blocks, from saved recurrent states).
    max_len: tokens a request may hold, prompt and generated
    together (as vLLM's max_model_len): a request may then ask for any max_new_tokens up to
    max_len less its prompt (and max_new_tokens), and the cache's rows hold max_len tokens,
    not max_prompt_len + max_new_tokens (None: the two limits apart). prefill_chunk: prompt
    tokens a pass takes (paged caches of targets that take a prompt in blocks; otherwise
    prompts are passed whole). tuning: as `jspec.compile`. rounds_per_chunk: rounds
    between admissions (smaller: new requests start sooner, more host round trips).
    max_waiting: requests that may wait for a row before `submit` raises `QueueFull`.
    max_logprobs: the most alternatives a request's logprobs may list (0: none, and no
    logprob buffers). request_timeout: seconds a request may take from its submission
    (None: no limit; `submit(timeout=...)` sets one per request). max_batched_tokens: with
    prompts in blocks, the most prompt tokens one pass takes (rows of prefill_chunk tokens;
    vLLM's max_num_batched_tokens): a pass's activations stay bounded beside a full pool.
    constraint_states: the states of the constraint tables (`submit(constraint=...)`,
    `jspec.serve.grammar`; rounded up to a power of two, with 64 exceptions a state; 0: the
    engine takes no constraints, and its rounds mask nothing). twin_chunks: chunks alternate
    between two loaded copies of their program (`Runner.chunk`; None: on a GPU, where each
    copy's CUDA graphs then stay as recorded instead of being updated before every chunk).

        engine = jspec.Engine(params, max_batch=8)
        with engine:                                  # threads drive it
            h = engine.submit("def fib(n):", max_new_tokens=64)
            for delta in h:
                print(delta.text, end="")
    """

    def __init__(self, params: Params, *, max_batch: int | None = 8, max_prompt_len: int = 512,
                 max_new_tokens: int = 256, cache=None, spec=None, tuning=None, rounds_per_chunk: int = 4, max_waiting: int = 256,
                 prefill_chunk: int = 512, max_logprobs: int = MAX_LOGPROBS, request_timeout: float | None = None,
                 memory_utilization: float | None = None, max_len: int | None = None, preemption: bool = True,
                 prefix_caching: bool = True, max_batched_tokens: int = 16384, constraint_states: int = 0,
                 twin_chunks: bool | None = None):
        rq.check_params(params)
        derive = max_batch is None  # then the pool sized at the most rows decides the batch
        if derive:
            max_batch = derived_batch(1 << 62, jax.devices()[0].platform)
        for name, v, low in (("max_batch", max_batch, 1), ("max_prompt_len", max_prompt_len, 1),
                             ("max_new_tokens", max_new_tokens, 1), ("rounds_per_chunk", rounds_per_chunk, 1),
                             ("max_waiting", max_waiting, 0), ("prefill_chunk", prefill_chunk, 1),
                             ("max_logprobs", max_logprobs, 0), ("max_batched_tokens", max_batched_tokens, 1),
                             ("constraint_states", constraint_states, 0)):
            if not rq.is_int(v) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be at most {MAX_LOGPROBS}, got {max_logprobs}")
        if request_timeout is not None and not (isinstance(request_timeout, (int, float)) and request_timeout > 0):
            raise ValueError(f"request_timeout must be a number of seconds > 0 or None, got {request_timeout!r}")
        if max_len is not None:
            if not rq.is_int(max_len) or max_len < 2:
                raise ValueError(f"max_len must be an int >= 2 or None, got {max_len!r}")
            if max_prompt_len >= max_len or max_new_tokens >= max_len:
                raise ValueError(f"max_prompt_len ({max_prompt_len}) and max_new_tokens ({max_new_tokens}) must be "
                                 f"below max_len ({max_len})")
            cache = rq.cache_config(cache or CacheConfig("paged"))
            if cache.max_len not in (None, max_len):
                raise ValueError(f"max_len={max_len} and the cache's max_len={cache.max_len} differ")
            cache = dataclasses.replace(cache, max_len=max_len)
        if memory_utilization is not None and not (isinstance(memory_utilization, (int, float))
                                                   and 0 < memory_utilization <= 1):
            raise ValueError(f"memory_utilization must be a number in (0, 1] or None, got {memory_utilization!r}")
        self.params = params
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.max_len = int(max_len) if max_len is not None else self.max_prompt_len + self.max_new_tokens
        self._total_bound = max_len is not None  # prompt + max_new_tokens limited by max_len
        self.max_logprobs, self.request_timeout = int(max_logprobs), request_timeout
        self.adaptive = spec if isinstance(spec, Adaptive) else None
        tiers = self._tiers(params, spec)
        tuning = rq.tuning_config(tuning)
        # CUDA-graph command buffers of the chunks' kernels, not over their loops, unless the
        # family or the tuning names its own (`SERVE_COMMAND_BUFFERS`).
        key = "xla_gpu_enable_command_buffer"
        if key not in family_for(params.config).gpu_xla_options(params.config) and key not in dict(tuning.xla_options):
            tuning = dataclasses.replace(tuning, xla_options=((key, SERVE_COMMAND_BUFFERS),) + tuning.xla_options)
        grammar = ()
        if constraint_states:  # tables of that many states, and 64 exceptions a state
            Q = 1 << (constraint_states - 1).bit_length()
            grammar = (Q, 64 * Q)
        runner = dict(batch=max_batch, max_new_tokens=self.max_new_tokens, tiers=tiers, tuning=tuning,
                      prefill_chunk=prefill_chunk, rounds_per_chunk=rounds_per_chunk, max_logprobs=self.max_logprobs,
                      prefix_caching=prefix_caching, max_batched_tokens=max_batched_tokens, grammar=grammar,
                      twin_chunks=jax.devices()[0].platform == "gpu" if twin_chunks is None else bool(twin_chunks))
        cache = rq.cache_config(cache or CacheConfig("paged"))
        self.runner = Runner(params, max_prompt_len=self.max_prompt_len, memory_utilization=memory_utilization,
                             cache=cache, **runner)
        lay = self.runner.plan.layout
        if derive:  # (a dense cache's rows are the least)
            runner["batch"] = (derived_batch(lay.num_pages * lay.page_size, jax.devices()[0].platform) if lay.paged
                               else DERIVED_ROWS[0])
            if runner["batch"] != self.runner.batch:
                self.runner = Runner(params, max_prompt_len=self.max_prompt_len,
                                     memory_utilization=memory_utilization, cache=cache, **runner)
                lay = self.runner.plan.layout
        # A pool smaller than every row's whole room: pages decide admission (else no row can run short).
        pages_decide = lay.paged and lay.num_pages < self.runner.batch * lay.pages_per_seq
        resumed = min(self.max_prompt_len + self.max_new_tokens - 1, self.max_len - 1)
        if preemption and pages_decide and resumed > self.max_prompt_len:  # a resumed prompt holds its output
            note = self.runner.pool_note
            self.runner = Runner(params, max_prompt_len=resumed, cache=self.runner.cache, **runner)
            self.runner.pool_note = note
        self.plan = self.runner.plan
        self.batch = self.runner.batch
        self.tiers = tiers
        default = rq.spec_config(params, None)
        drafting = [i for i, t in enumerate(tiers) if t is not None]
        self._first_tier = tiers.index(default) if default in tiers else (drafting or [0])[0]
        if self.adaptive is not None and self.adaptive.costs is not None:
            missing = [(t, n) for t in range(len(tiers)) for n in buckets(self.batch)
                       if (t, n) not in self.adaptive.costs]
            if missing:
                raise ValueError(f"Adaptive.costs has no cost for (tier, bucket) {missing[0]}; it needs one for every "
                                 f"tier index and occupancy bucket {buckets(self.batch)} (the batch bucketed)")
        self.pool_pages = lay.num_pages if lay.paged else 0
        proposer = self.plan.proposer
        next_token = proposer is not None and proposer.cache_reads_next_token()
        self.pool = PagePool(lay.num_pages, lay.page_size, self.runner.prefix_caching, snapshots=lay.snapshots,
                             boundary=self.runner.prefill_chunk, next_token=next_token) if lay.paged else None
        self.scheduler = Scheduler(self.batch, prefill_chunk=self.runner.prefill_chunk,
                                   width_class=self.runner.width_class, rounds_per_chunk=rounds_per_chunk,
                                   max_waiting=max_waiting, tier=self._first_tier, pool=self.pool,
                                   pages_at=lambda q, slots: self.runner.pages_at(len(q.prompt), q.max_new, slots),
                                   preempting=preemption and pages_decide,
                                   chunk_slots=rounds_per_chunk * self.plan.slack, cache_margin=self.plan.slack,
                                   pass_rows=self.runner.pass_rows, narrow_block=self.runner.narrow,
                                   wide_block=self.runner.wide)
        self.output = OutputProcessor(params.tokenizer, on_stop=self._stopped, on_finish=self._finished,
                                      on_error=self._fail)
        self.stats = EngineStats(max_accept=max(t.num_steps + 1 if t else 1 for t in tiers))
        self.stats.tier_chunks = {tier_name(t): 0 for t in tiers}
        self._handles: dict[Request, Handle] = {}
        self._inflight: collections.deque[Inflight] = collections.deque()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False
        self._closed = False
        self._last_done = 0.0  # when the last chunk's readback arrived
        self._wait_cpu_s = 0.0  # the driving thread's CPU time inside readbacks (not host work)
        self.error: str | None = None

    @staticmethod
    def _tiers(params: Params, spec) -> list:
        if isinstance(spec, Adaptive):
            default = rq.spec_config(params, None)
            if default is None:
                raise ValueError("adaptive speculation needs a draft; load one with jspec.load(target, draft=...)")
            tiers = list(spec.tiers or default_tiers(default))
            for t in tiers:
                if t is not None:
                    rq.spec_config(params, t)
            return tiers
        return [rq.spec_config(params, spec)]

    # ------------------------------------------------------------------ state

    @property
    def tier(self) -> str:
        """The tier the next chunk runs ("plain" or "S,K,N")."""
        return tier_name(self.tiers[self.scheduler.tier])

    @property
    def spec(self) -> SpecConfig | None:
        """The SpecConfig of the tier in use (None: plain rounds)."""
        return self.tiers[self.scheduler.tier]

    def pin_tier(self, tier: int | None) -> None:
        """Runs every chunk on tier `tier` (an index of `tiers`), whatever the adaptive
        choice says; None: the choice again (a load test runs fixed tiers on one engine)."""
        if tier is not None and not (rq.is_int(tier) and 0 <= tier < len(self.tiers)):
            raise ValueError(f"tier must be an index of the engine's {len(self.tiers)} tiers or None, got {tier!r}")
        with self._lock:
            self.scheduler.pinned = tier
            if tier is not None:
                self.scheduler.tier = tier

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.scheduler.rows)

    @property
    def healthy(self) -> bool:
        """False once the engine failed (`error` says why)."""
        return self.error is None

    def kv_cache_usage(self) -> float:
        """The share of the cache in use (0 to 1): paged, the pages the rows hold (cached
        pages nobody holds count as free); dense, the slots the rows' requests may use."""
        lay = self.plan.layout
        if self.pool is not None:
            with self._lock:
                return 1.0 - self.pool.available / max(self.pool.num_pages, 1)
        ahead = self.runner.rounds_per_chunk * self.plan.slack
        with self._lock:
            used = sum(min(len(q.prompt) + q.generated + ahead, lay.capacity) for q in self.scheduler.rows.values())
        return min(1.0, used / (lay.capacity * self.batch))

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, *, max_new_tokens: int = 64, stop_token_ids=None, stop: str | Sequence[str] | None = None,
               include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
               timeout: float | None = None, **values) -> Handle:
        """Queues one request -> its `Handle`. prompt: a string or token ids; values: as
        `jspec.generate`, one each (sampling values, seed: a fresh one if left out,
        min_tokens, speculative, logprobs, prompt_logprobs, constraint); stop: strings that end the
        request where they appear in its text (cut before them, or after with
        include_stop_str_in_output); skip_special_tokens: left out of the text; timeout:
        seconds for this request (None: the engine's request_timeout). ValueError /
        TypeError for a bad request; `QueueFull` when `max_waiting` requests wait already;
        `EngineError` once the engine failed or was closed."""
        if self.error is not None:
            raise EngineError(f"the engine failed ({self.error}); it takes no requests")
        if self._closed:
            raise EngineError("the engine is closed; it takes no requests")
        reqs = rq.check_requests(self.params, prompt, max_new_tokens, stop_token_ids, values)
        if reqs.is_batch:
            raise TypeError("submit takes one prompt (a string or a list of token ids); submit a batch one by one")
        n, m = reqs.lens[0], reqs.max_new[0]
        if n > self.max_prompt_len:
            raise ValueError(f"prompt has {n} tokens; this engine takes prompts of at most {self.max_prompt_len} "
                             f"tokens (max_prompt_len)")
        if m > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={m}; this engine allows at most {self.max_new_tokens}")
        if self._total_bound and n + m > self.max_len:
            raise ValueError(f"max_new_tokens={m} with a prompt of {n} tokens asks for {n + m} tokens; this engine "
                             f"holds at most max_len={self.max_len}")
        need = self.runner.pages_needed(n, m)
        if need > self.pool_pages > 0:
            P = self.plan.layout.page_size
            raise ValueError(f"a prompt of {n} tokens with max_new_tokens={m} may need {need} pages of {P} tokens; "
                             f"the engine's page pool holds {self.pool_pages} ({self.pool_pages * P} tokens)")
        automaton = reqs.automata[0]
        if automaton is not None:
            if self.runner.slots is None:
                raise ValueError("constraint: this engine takes no constraints (Engine(constraint_states=0))")
            self.runner.slots.check(automaton)
        if len(reqs.stop_ids[0]) > NUM_STOP:
            raise ValueError(f"{len(reqs.stop_ids[0])} stop token ids; this engine takes at most {NUM_STOP}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(reqs, name)[0]
            if k is not None and (k > self.max_logprobs or not self.max_logprobs):
                raise ValueError(f"{name}={k}; this engine lists at most {self.max_logprobs} (max_logprobs)"
                                 + ("" if self.max_logprobs else " and keeps no logprobs"))
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stops):
            raise TypeError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if stops and self.params.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        seeds = reqs.sampling["seed"]
        reqs = dataclasses.replace(reqs, sampling=dict(reqs.sampling, seed=[rq.fresh_seed() if seeds[0] is None
                                                                            else seeds[0]]))
        now = time.perf_counter()
        limit = timeout if timeout is not None else self.request_timeout
        request = Request(reqs, arrival=now, deadline=None if limit is None else now + limit)
        handle = Handle(request, self._cancel)
        with self._lock:
            if self.error is not None:
                raise EngineError(f"the engine failed ({self.error}); it takes no requests")
            self.scheduler.add(request)
            self._handles[request] = handle
            self.output.open(handle, {"stop": stops, "include_stop_str_in_output": include_stop_str_in_output,
                                      "skip_special_tokens": skip_special_tokens})
            self._work.notify()
        return handle

    def generate(self, prompt, **kw) -> RequestOutput:
        """Submits one request and drives the engine (from this thread, unless it runs its
        own) until it finishes."""
        handle = self.submit(prompt, **kw)
        if self._thread is None:
            while not handle.done:
                self.step()
        return handle.result()

    def _cancel(self, handle: Handle) -> None:
        with self._lock:
            self.scheduler.end(handle.request, "cancelled")
            self._work.notify()

    def _stopped(self, handle: Handle) -> None:
        """A stop string ended the request (the output processor): its row is freed."""
        with self._lock:
            self.scheduler.end(handle.request, "stop")

    def _finished(self, handle: Handle, out: RequestOutput) -> None:
        """Every request's end (the output processor's thread): the statistics."""
        q, s = handle.request, self.stats
        now = time.perf_counter()
        with s.lock:
            s.finished += 1
            s.cancelled += out.finish_reason == "cancelled"
            s.finish_reasons[out.finish_reason] = s.finish_reasons.get(out.finish_reason, 0) + 1
            s.e2e.observe(now - q.arrival)
            if q.admitted_at is not None:
                s.queue_time.observe(q.admitted_at - q.arrival)
            if handle.first_token_at is not None:
                s.ttft.observe(handle.first_token_at - q.arrival)
                if len(out.tokens) > 1:
                    s.tpot.observe((now - handle.first_token_at) / (len(out.tokens) - 1))
        self._handles.pop(q, None)

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One iteration (see the module) -> whether any request is running or waiting, or
        a chunk is in flight. The thread's CPU time in it adds to `stats.launch_s` inside
        program calls, to nothing inside readbacks (a wait may spin), and to
        `stats.host_s` elsewhere; its wall time raises `stats.longest_step_s`."""
        t0, launched, waited = time.thread_time(), self.runner.launch_s, self._wait_cpu_s
        began = time.perf_counter()
        busy = self._iterate()
        self.stats.longest_step_s = max(self.stats.longest_step_s, time.perf_counter() - began)
        launch = self.runner.launch_s - launched
        self.stats.launch_s += launch
        self.stats.host_s += time.thread_time() - t0 - launch - (self._wait_cpu_s - waited)
        return busy

    def _get(self, back):
        """A window readback on the host, its parts named (the wait adds to `stats.wait_s`)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        back = jax.device_get(back)
        self.stats.wait_s += time.perf_counter() - t0
        self._wait_cpu_s += time.thread_time() - c0
        return unpack_window(back)

    def _iterate(self) -> bool:
        self._ready()
        with self._lock:
            d = self.scheduler.schedule(time.perf_counter())
        self._deliver_ends([(None, q) for q in d.ended])
        if d.evict or d.preempt:
            self.runner.evict([r for r, _ in d.evict + d.preempt])
            self._deliver_ends(d.evict)
            self.stats.num_preemptions += len(d.preempt)
        if d.pages:
            self.runner.set_pages(d.pages)
        if self.pool is not None:
            self.stats.prefix_cache_queries, self.stats.prefix_cache_hits = self.pool.query_tokens, self.pool.hit_tokens
        if self.runner.slots is not None and (d.cached or d.admit):  # their constraints into the tables
            self.runner.place_constraints([q.reqs.automata[0] for g in d.cached + d.admit for _, q in g],
                                          {q.reqs.automata[0].key for q in self.scheduler.rows.values()
                                           if q.reqs.automata[0] is not None})
        for group in d.cached:  # a cached prefix: no pass; their first blocks are among d.prefill
            self.runner.admit_cached([r for r, _ in group], rq.Requests.concat([q.reqs for _, q in group]))
            self.stats.admitted += len(group)
        if d.restore:  # a hybrid's cached prefix: its recurrent states
            self.runner.load_states(d.restore)
        passes = []
        for group in d.admit:
            rows, reqs = [r for r, _ in group], rq.Requests.concat([q.reqs for _, q in group])
            passes.append((self.runner.admit(rows, reqs, group[0][1].prompt_logprobs, [d.stops[r] for r in rows]),
                           dict(group)))
            self.stats.admitted += len(group)
        for blocks, width in zip(d.prefill, d.widths):
            rows = {r: self.scheduler.rows[r] for r, _ in blocks}
            logprobs = next(iter(rows.values())).prompt_logprobs
            passes.append((self.runner.prefill(blocks, width, logprobs, [d.stops[r] for r, _ in blocks]), rows))
            self.stats.prefill_passes += 1
        if d.save:  # a hybrid's states where a prompt block ended: a prefix's, for later requests
            self.runner.save_states(d.save)
        for blocks in d.tails:  # the rest of prompts whose pass stopped at a state point, saved above
            rows = {r: self.scheduler.rows[r] for r, _ in blocks}
            passes.append((self.runner.prefill(blocks, self.runner.narrow or self.runner.prefill_chunk), rows))
            self.stats.prefill_passes += 1
        if d.dispatch:
            self._inflight.append(Inflight(self.runner.chunk(d.tier, d.sampled, d.logprobs), d.running, d.tier,
                                           time.perf_counter(), clean=not passes))
            self.stats.chunks += 1
            self.stats.tier_chunks[tier_name(self.tiers[d.tier])] += 1
        for back, rows in passes:  # their first tokens (the chunk is queued behind them)
            self._read(self._get(back), rows, chunk=False)
        if self._inflight and (len(self._inflight) >= 2 or not d.dispatch):
            c = self._inflight.popleft()
            back = self._get(c.back)
            done = time.perf_counter()
            if c.clean and self.scheduler.chooser is not None:  # the device ran it from its dispatch or the last
                started = max(c.dispatched, self._last_done)
                self.scheduler.chooser.observe_cost(c.tier, len(c.rows), (done - started) / self.runner.rounds_per_chunk)
            self._last_done = done
            self._read(back, c.rows, chunk=True, tier=c.tier)
        with self._lock:
            return self.scheduler.has_work or bool(self._inflight)

    def _read(self, back: dict, rows: dict, chunk: bool, tier: int | None = None) -> None:
        """A readback (host arrays) of a call over `rows` -> the scheduler's progress, the
        statistics and each request's new tokens to the output processor."""
        with self._lock:
            progress = self.scheduler.update(back, rows, chunk, tier)
        deliveries = []
        for p in progress:
            q = p.request
            n, start = len(q.prompt), int(back["tokens_from"][p.row])
            lo, hi = n + p.before - start, n + p.now - start  # the new tokens' places in the window
            if hi > lo and (lo < 0 or hi > back["tokens"].shape[1]):
                raise RuntimeError(f"row {p.row}: tokens {n + p.before}..{n + p.now} are outside the readback's "
                                   f"window {start}..{start + back['tokens'].shape[1]}")
            lps = prompt_lps = None
            if q.token_logprobs and "lp_chosen" in back:
                lps = token_logprobs(back, p.row, lo, hi - lo, q.reqs.logprobs[0])
            if not chunk and q.prompt_logprobs and "lp_chosen" in back:
                prompt_lps = token_logprobs(back, p.row, 0, max(0, min(n - start, back["tokens"].shape[1])),
                                            q.reqs.prompt_logprobs[0])
            new = back["tokens"][p.row, lo:hi].tolist() if hi > lo else []
            q.output.extend(new)  # a preempted request resumes from them
            deliveries.append(Delivery(self._handles[q], new, lps, prompt_lps, p.finish))
            self.stats.generation_tokens += p.now - p.before
            if p.before == 0 and p.now > 0 and not q.preemptions:
                self.stats.prompt_tokens += n
        if chunk:
            self._count_rounds(progress, tier)
        self.output.deliver(deliveries)

    def _count_rounds(self, progress, tier: int) -> None:
        """The accept lengths a chunk's speculating rows reported -> the statistics."""
        s, spec = self.stats, self.tiers[tier]
        s.rounds += self.runner.rounds_per_chunk
        lens = [p.accept_lens for p in progress if p.accept_lens is not None and len(p.accept_lens)]
        if spec is None or not lens:
            return
        lens = np.concatenate(lens)  # every row's at once: a np.unique a row cost 0.6 ms a chunk of 32 rows
        n, total = len(lens), int(lens.sum())
        s.accept_rounds += n
        s.accept_tokens += total
        s.spec_draft_tokens += (spec.num_draft_tokens - 1) * n
        s.spec_accepted_tokens += total - n
        for length, times in enumerate(np.bincount(lens)):
            if times:
                s.accept_length.observe(length, int(times))

    def _deliver_ends(self, evicted) -> None:
        """Final outputs of requests the host ended (cancelled, timed out)."""
        self.output.deliver([Delivery(self._handles[q], [], finish=q.finish) for _, q in evicted
                             if q.finish in HOST_ENDS and q in self._handles])

    def _ready(self) -> None:
        """The state (every row free) and, for adaptive speculation, the round costs."""
        if self.runner.state is None:
            self.runner.reset()
            if self.pool is not None:
                self.pool.clear()  # the device's pages hold nothing now
        if self.adaptive is not None and self.scheduler.chooser is None:
            t0 = time.perf_counter()
            costs = self.adaptive.costs
            if costs is None:
                costs = measure_costs(self.runner, self.adaptive.context)
            self.stats.startup_s += time.perf_counter() - t0
            self.scheduler.chooser = Chooser(self.adaptive, self.tiers, costs, self.batch)
            self.stats.round_costs = {f"{tier_name(self.tiers[t])} @ {n}": c for (t, n), c in costs.items()}

    def warm_up(self, prompt_lens: Sequence[int] | None = None, sampled: bool = True,
                logprobs: bool | None = None) -> float:
        """Compiles every program serving may run (`Runner.programs_needed`) and runs each
        once (`Runner.compile_all`), before the engine serves: prompt_lens: only the
        admission widths these prompt lengths take (None: all); sampled: also the programs
        with the sampling steps; logprobs: also those recording logprobs (None: where the
        engine keeps them). For adaptive speculation the round costs are measured first.
        -> seconds (programs compiled before cost only their run); the count is
        `stats.programs`. RuntimeError while requests are in the engine (the runs start the
        device state afresh, and the prefix cache with it)."""
        t0 = time.perf_counter()
        with self._lock:
            if self.scheduler.has_work or self._inflight:
                raise RuntimeError("warm_up runs before serving: this engine has requests in it")
        self._ready()
        widths = None if prompt_lens is None else sorted({self.runner.width_class(n) for n in prompt_lens})
        count, _ = self.runner.compile_all(widths=widths, sampled=(False, True) if sampled else (False,),
                                           logprobs=None if logprobs is None else
                                           ((False, True) if logprobs else (False,)))
        self.stats.programs = count
        if self.pool is not None:
            self.pool.clear()  # the device's pages hold nothing now
        seconds = time.perf_counter() - t0
        self.stats.startup_s += seconds
        return seconds

    # ------------------------------------------------------------------ the thread

    def start(self) -> "Engine":
        """Drives the engine from its own thread (and the output processor from another)
        until `close`."""
        if self._closed:
            raise EngineError("the engine is closed")
        if self._thread is None:
            self._running = True
            self.output.start()
            self._thread = threading.Thread(target=self._run, name="jspec-engine", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while self._running:
                if not self.step():
                    with self._lock:
                        self._work.wait_for(lambda: self.scheduler.has_work or not self._running, timeout=1.0)
        except Exception as err:  # noqa: BLE001  (any fault fails every request rather than hanging them)
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        """Every running and waiting request ends with finish_reason "error"; no more requests."""
        if self.error is not None:
            return
        self.error = f"{type(err).__name__}: {err}"
        self._running = False
        log.error("the engine failed, every open request ends with an error: %s", self.error, exc_info=err)
        with self._lock:
            handles = list(self._handles.values())
            self.scheduler.waiting.clear()
            self.scheduler.rows.clear()
        self._inflight.clear()
        self.output.deliver([Delivery(h, [], finish="error", error=self.error) for h in handles])

    def close(self) -> None:
        """Stops the threads (after the iteration in flight), delivers the chunks in flight
        and cancels what is left; `submit` raises from then on."""
        self._closed = True
        if self._thread is not None:
            self._running = False
            with self._lock:
                self._work.notify()
            self._thread.join()
            self._thread = None
        if self.error is None:
            while self._inflight:  # the chunks in flight: their tokens are delivered
                c = self._inflight.popleft()
                self._read(self._get(c.back), c.rows, chunk=True, tier=c.tier)
        with self._lock:
            for q in list(self.scheduler.waiting) + list(self.scheduler.rows.values()):
                self.scheduler.end(q, "cancelled")
            ended = [(None, q) for q in self._handles]
        self._deliver_ends(ended)
        self.output.stop()
        self.runner.state = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
