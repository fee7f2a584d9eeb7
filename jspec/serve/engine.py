"""A serving engine: requests submitted at any time join a running batch between chunks
of rounds and leave it the moment they finish.

The engine owns one loop state of `max_batch` rows (`jspec.loop.state`) and drives the
loop's compiled entry points (`jspec.loop.programs`) from the host, one iteration at a
time (`Engine.step`), either called directly or from its own thread (`Engine.start`).
One chunk of rounds is always in flight on the device while the host works:

1. the in-flight chunk's readback arrives (the host waits for it here, and only here);
   the rounds' accept lengths update the tier choice;
2. rows whose request finished (on the device, by a stop string, or cancelled) are
   evicted (`evict`: pages back to the pool, the row free);
3. waiting requests go into free rows (`admit`), in buckets of 1, 2, 4, ... requests and
   of their longest prompt's length; with a paged cache a prompt longer than
   `prefill_chunk` tokens is prefilled in blocks of that many (`prefill`), one block per
   iteration, so a long prompt delays each chunk of the others by one block's pass
   instead of its whole prefill;
4. the next chunk of `rounds_per_chunk` rounds is dispatched (`chunk`), on the tier
   the adaptive choice picked (`jspec.serve.tiers`; the tiers share the state, so a switch
   moves nothing). A chunk runs exactly that many rounds with its pages reserved first,
   so the host reads no predicate (the default pool; with a smaller one, the
   reservation's retry loop, at its start) and the call returns with its rounds enqueued (a while loop until every row finished would
   block the call for the whole chunk: XLA reads a loop's predicate on the host);
5. while it runs, the previous chunk's tokens are handed to their requests (`Handle`)
   with their text; stop strings are matched here, ending the request at the first match.

So the device runs chunk after chunk while the host reads back, evicts, packs and
dispatches. While no request waits for a row (and no prompt is half prefilled) the next
chunk is dispatched before step 1, two chunks in flight, and the device does not wait
for the host at all; with a queue, admissions into rows already free and the parked
prompts' blocks are dispatched before step 1, and only the rows the chunk freed are
admitted between the readback and the next dispatch (a freed row takes a new request at
the very next chunk; the device waits for that host work). A
request's tokens depend only on the request itself (its prompt, values and seed: see
`jspec.loop.rows`), so they are the same whatever shares the batch, whenever it joined,
and whichever tier ran its rounds (target-only verification; with `sample_drafts`,
sampled tokens keep the target's distribution but depend on the drafts).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from jspec import requests as rq
from jspec.api import Compiled, mesh_of
from jspec.config import CacheConfig, SpecConfig
from jspec.loop import programs
from jspec.loop.plan import prompt_bucket
from jspec.loop.state import FINISH_REASONS
from jspec.models import family_for
from jspec.params import Params
from jspec.serve.tiers import (
    Adaptive,
    Chooser,
    buckets,
    default_tiers,
    measure_costs,
    tier_name,
)


class QueueFull(RuntimeError):
    """The engine's waiting queue is full (a server answers 429 with Retry-After)."""


@dataclasses.dataclass
class RequestOutput:
    """A finished request: its generated token ids (a stop token included, tokens after a
    stop string's end left out), their text (None without a tokenizer; cut before a stop
    string), finish_reason ('stop', 'length', 'cache_full' or 'cancelled'), the prompt's
    token count and the times it waited and ran (seconds)."""

    tokens: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    queued_s: float
    run_s: float


NO_COMMAND_BUFFERS = (("xla_gpu_enable_command_buffer", ""),)  # the engine's programs' XLA option (GPU)


class Handle:
    """A submitted request. Iterating it yields (new token ids, new text) as chunks commit
    (blocking); `result()` waits for the `RequestOutput`; `cancel()` ends it at the next
    chunk boundary and frees its row. `stream()` and `wait()` are the asyncio forms."""

    def __init__(self, engine: "Engine", reqs: rq.Requests, stop_strings: tuple[str, ...]):
        self.engine, self.reqs, self.stop_strings = engine, reqs, stop_strings
        self.prompt = reqs.prompts[0]
        self.tokens: list[int] = []
        self.text = ""
        self.output: RequestOutput | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.admitted: float | None = None
        self.first_token_at: float | None = None  # when its first token was handed out
        self.token_times: list[tuple[float, int]] = []  # (when, how many) of each delivery of tokens
        self.finished_at: float | None = None
        self.cut = False  # a stop string ended it (`text` is cut before it)
        self.shown_chars = 0  # characters of `text` handed out
        self.rounds_seen = 0  # rounds of its row whose accept lengths were counted
        self.samples = reqs.samples  # it samples or has penalties (it needs the sampling programs)
        self._events: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waiters: list = []  # (asyncio loop, asyncio.Event) pairs to wake

    @property
    def done(self) -> bool:
        return self.output is not None

    def cancel(self) -> None:
        self.cancelled = True
        self.engine._wake()

    # ------------------------------------------------------------------ delivery (engine thread)

    def _push(self, tokens: list[int], text: str | None, output: RequestOutput | None) -> None:
        now = time.perf_counter()
        with self._cond:
            if tokens or text:
                self._events.append((tokens, text))
            if tokens:
                self.token_times.append((now, len(tokens)))
                if self.first_token_at is None:
                    self.first_token_at = now
            if output is not None:
                self.output, self.finished_at = output, now
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    # ------------------------------------------------------------------ reading (any thread)

    def __iter__(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._events or self.output is not None)
                if self._events:
                    item = self._events.popleft()
                else:
                    return
            yield item

    def result(self, timeout: float | None = None) -> RequestOutput:
        with self._cond:
            if not self._cond.wait_for(lambda: self.output is not None, timeout):
                raise TimeoutError("the request did not finish in time")
            return self.output

    async def stream(self):
        """Async iterator of (new token ids, new text)."""
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, event))
        try:
            while True:
                with self._cond:
                    item = self._events.popleft() if self._events else None
                    finished = self.output is not None and not self._events
                if item is not None:
                    yield item
                elif finished:
                    return
                else:
                    await event.wait()
                    event.clear()
        finally:
            with self._cond:
                self._waiters.remove((loop, event))

    async def wait(self) -> RequestOutput:
        async for _ in self.stream():
            pass
        return self.output


class Engine:
    """Continuous batching over one compiled loop of `max_batch` rows (see the module).

    params: a `jspec.Params` (with a draft: speculative rounds). spec: a SpecConfig (fixed
    speculation; None: the proposer's default), or `jspec.Adaptive(...)` (a tier chosen
    before each chunk, `jspec.serve.tiers`). max_prompt_len, max_new_tokens: the largest
    request the engine takes (they size the programs and caches; a larger one is refused
    at `submit`). cache: as `jspec.compile`, paged by default (None). prefill_chunk: prompt
    tokens an admission or prefill pass takes (paged caches of targets that take a prompt
    in blocks; otherwise prompts are prefilled whole). tuning: as `jspec.compile`.
    rounds_per_chunk: rounds between admissions (smaller: new requests start sooner, more
    host round trips). max_waiting: requests that may wait for a row before `submit`
    raises `QueueFull`.

        engine = jspec.Engine(params, max_batch=8)
        with engine:                                  # a thread drives it
            h = engine.submit("def fib(n):", max_new_tokens=64)
            for tokens, text in h:
                print(text, end="")
    """

    def __init__(self, params: Params, *, max_batch: int = 8, max_prompt_len: int = 512, max_new_tokens: int = 256,
                 cache=None, spec=None, tuning=None, rounds_per_chunk: int = 4, max_waiting: int = 256,
                 prefill_chunk: int = 512):
        rq.check_params(params)
        for name, v, low in (("max_batch", max_batch, 1), ("max_prompt_len", max_prompt_len, 1),
                             ("max_new_tokens", max_new_tokens, 1), ("rounds_per_chunk", rounds_per_chunk, 1),
                             ("max_waiting", max_waiting, 0), ("prefill_chunk", prefill_chunk, 1)):
            if not rq.is_int(v) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        self.params = params
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.rounds_per_chunk, self.max_waiting = int(rounds_per_chunk), int(max_waiting)
        cache = rq.cache_config(cache if cache is not None else CacheConfig(kind="paged"))
        self.adaptive = spec if isinstance(spec, Adaptive) else None
        if self.adaptive is not None:
            default = rq.spec_config(params, None)
            if default is None:
                raise ValueError("adaptive speculation needs a draft; load one with jspec.load(target, draft=...)")
            tiers = self.adaptive.tiers or default_tiers(default)
            for t in tiers:
                if t is not None:
                    rq.spec_config(params, t)
        else:
            tiers = (rq.spec_config(params, spec),)
        self.tiers = list(tiers)
        # The programs' shape: max_batch requests of the largest size, up to 8 stop ids a request;
        # each program in two variants: with the sampling steps, and without them while every row is greedy.
        shape = rq.check_requests(params, [[0] * self.max_prompt_len] * max_batch, self.max_new_tokens,
                                  [list(range(8))] * max_batch, {"temperature": 1.0})
        Tp = prompt_bucket(self.max_prompt_len)
        kind = family_for(params.config).cache_kind(params.config)
        chunked = cache.kind == "paged" and kind.prefill_in_chunks and prefill_chunk < Tp
        self.prefill_chunk = int(prefill_chunk) if chunked else 0  # 0: prompts prefilled whole
        tuning = rq.tuning_config(tuning)
        # No CUDA-graph command buffers (unless the tuning names them): XLA records a loop
        # body's graphs at every execution, 3.3 ms before each 8B chunk on an H100, where a
        # chunk's kernels launched one by one queue behind the running chunk at no cost.
        tuning = dataclasses.replace(tuning, xla_options=NO_COMMAND_BUFFERS + tuning.xla_options)
        self.prog = Compiled(params, shape, cache, self.tiers[0], tuning, eager=False,
                             tiers=tuple(self.tiers) if len(self.tiers) > 1 else (), prefill_chunk=self.prefill_chunk)
        self.plans = [dataclasses.replace(self.prog.plan, spec=t) for t in self.tiers]
        self.plan = self.plans[0]
        self.batch = self.plan.batch
        drafting = [i for i, t in enumerate(self.tiers) if t is not None]
        default = rq.spec_config(params, None)
        self._first_tier = self.tiers.index(default) if default in self.tiers else (drafting or [0])[0]
        self._tier = self._first_tier
        self._chooser: Chooser | None = None
        costs = self.adaptive.costs if self.adaptive is not None else None
        if costs is not None:
            missing = [(t, n) for t in range(len(self.tiers)) for n in buckets(self.batch) if (t, n) not in costs]
            if missing:
                raise ValueError(f"Adaptive.costs has no cost for (tier, bucket) {missing[0]}; it needs one for every "
                                 f"tier index and occupancy bucket {buckets(self.batch)} (the batch bucketed)")
        self._state = None
        self._inflight: collections.deque = collections.deque()  # (readback on the device, {row: request}, tier)
        self._chunk_programs: dict = {}  # (tier, sampled) -> the compiled chunk
        self._holders: dict[int, Handle] = {}  # row -> its request (running or parked)
        self._parked: dict[int, int] = {}  # row -> the next prompt slot its prefill takes
        self._waiting: collections.deque[Handle] = collections.deque()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False
        self.stats = {"rounds": 0, "chunks": 0, "prefill_passes": 0, "admitted": 0, "finished": 0, "cancelled": 0,
                      "tokens": 0, "accept_rounds": 0, "accept_tokens": 0, "startup_s": 0.0,
                      "tier_chunks": {tier_name(t): 0 for t in self.tiers}}

    @property
    def tier(self) -> str:
        """The tier the next chunk runs ("plain" or "S,K,N")."""
        return tier_name(self.tiers[self._tier])

    @property
    def spec(self) -> SpecConfig | None:
        """The SpecConfig of the tier in use (None: plain rounds)."""
        return self.tiers[self._tier]

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, *, max_new_tokens: int = 64, stop_token_ids=None, stop: str | Sequence[str] | None = None,
               **sampling) -> Handle:
        """Queues one request (a string or token ids; sampling values as `jspec.generate`,
        one value each; stop: strings that end the request where they appear in its text)
        -> its `Handle`. ValueError / TypeError for a bad request; `QueueFull` when
        `max_waiting` requests wait already."""
        reqs = rq.check_requests(self.params, prompt, max_new_tokens, stop_token_ids, sampling)
        if reqs.is_batch:
            raise TypeError("submit takes one prompt (a string or a list of token ids); submit a batch one by one")
        n, m = reqs.lens[0], reqs.max_new[0]
        if n > self.max_prompt_len:
            raise ValueError(f"prompt has {n} tokens; this engine takes prompts of at most {self.max_prompt_len} "
                             f"tokens (max_prompt_len)")
        if m > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={m}; this engine allows at most {self.max_new_tokens}")
        if len(reqs.stop_ids[0]) > self.plan.num_stop:
            raise ValueError(f"{len(reqs.stop_ids[0])} stop token ids; this engine takes at most {self.plan.num_stop}")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stops):
            raise TypeError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if stops and self.params.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        handle = Handle(self, reqs, stops)
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_waiting={self.max_waiting})")
            self._waiting.append(handle)
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

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._holders)

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One iteration (see the module): read back the oldest chunk in flight, evict,
        admit, prefill, dispatch the next chunk, deliver. While nothing waits for a row and
        no prompt is half prefilled, the next chunk is dispatched before the readback, so
        two chunks are in flight and the device never waits for the host (rows that finish
        then idle for one more chunk: nobody waits for them). Otherwise what does not
        depend on the readback (admissions into rows free already, the parked prompts'
        next blocks) is dispatched before it, and only the rows the chunk freed are
        admitted between the readback and the next chunk. -> whether any request is
        running or waiting, or a chunk is in flight."""
        self._ready()
        with self._lock:
            queue = bool(self._waiting or self._parked)
        if self._inflight and not queue and len(self._inflight) < 2 and self._outlasts_inflight():
            self._dispatch()
        started, prefilled = [], False
        if self._inflight and queue:  # rows free already and parked prompts: packed and dispatched while it runs
            started, prefilled = self._admit_waiting() + self._prefill_parked(), True
        back = snapshot = None
        if self._inflight:
            back_dev, snapshot, tier = self._inflight.popleft()
            back = jax.device_get(back_dev)
            self._count_rounds(back, snapshot, tier)
        ended = {row for row, h in (snapshot or {}).items() if back["finished"][row]}
        self._evict([row for row, h in self._holders.items()
                     if h.done or h.cancelled or (row in ended and snapshot[row] is h)])
        started += self._admit_waiting()  # into the rows that chunk freed
        if not prefilled:
            started += self._prefill_parked()
        if not self._inflight:
            self._dispatch()
        if back is not None:
            self._deliver(back, snapshot)
        for back_dev, rows in started:
            self._deliver(jax.device_get(back_dev), rows)
        return bool(self._holders or self._waiting or self._inflight)

    def _outlasts_inflight(self) -> bool:
        """Whether some running row may still be running after the chunks in flight (each
        of their rounds emits at least one token a running row): if not, no chunk is
        dispatched behind them."""
        ahead = self.rounds_per_chunk * len(self._inflight)
        return any(len(h.tokens) + ahead < h.reqs.max_new[0] for row, h in self._holders.items()
                   if row not in self._parked)

    def _dispatch(self) -> None:
        """The next chunk of the running rows, on the tier the chooser picks."""
        running = [row for row in self._holders if row not in self._parked]
        if not running:
            return
        if self._chooser is not None:
            self.use_tier(self._chooser.choose(self._tier, len(running)))
        sampled = any(self._holders[row].samples for row in running)
        self._inflight.append((self._advance(self.rounds_per_chunk, sampled),
                               {row: self._holders[row] for row in running}, self._tier))
        self.stats["chunks"] += 1
        self.stats["tier_chunks"][self.tier] += 1

    def _ready(self) -> None:
        """The state (every row free) and, for adaptive speculation, the round costs."""
        if self._state is None:
            with mesh_of(self.params):
                self._state = programs.init_jit(self.plan)
        if self.adaptive is not None and self._chooser is None:
            self._chooser = Chooser(self.adaptive, self.tiers, {}, self.batch)  # measuring: no choice yet
            t0 = time.perf_counter()
            costs = self.adaptive.costs if self.adaptive.costs is not None else measure_costs(self)
            self.stats["startup_s"] = time.perf_counter() - t0
            self._chooser.costs = dict(costs)
            self.stats["round_costs"] = {f"{tier_name(self.tiers[t])} @ {n}": c for (t, n), c in costs.items()}
            self.use_tier(self._first_tier)

    def use_tier(self, tier: int) -> None:
        """Runs the next chunks on tier `tier` (an index of `tiers`); the tiers share the
        state, so nothing moves."""
        self._tier = tier

    def _variant(self, plan, sampled: bool):
        """`plan` compiled with the sampling steps (some row samples or has penalties) or
        without them (every row greedy: an argmax, the same tokens for greedy rows)."""
        return dataclasses.replace(plan, sampling=sampled)

    def _advance(self, rounds: int, sampled: bool = True):
        key = (self._tier, sampled, rounds)
        if key not in self._chunk_programs:  # looked up once: the lookup hashes every weight's shape
            plan = self._variant(self.plans[self._tier], sampled)
            self._chunk_programs[key] = self.prog.program(programs.chunk_jit(rounds), self._state, plan=plan)
        self._state, back = self._chunk_programs[key](*self.prog.weights, self._state)
        return back

    def _admit_waiting(self) -> list:
        """Admits waiting requests into free rows -> [(readback, {row: request} of the rows
        that run from now)] (rows whose prompt goes on in later blocks are parked)."""
        with self._lock:
            free = [r for r in range(self.batch) if r not in self._holders]
            joining = []
            while free and self._waiting:
                h = self._waiting.popleft()
                if h.cancelled:
                    h._push([], None, self._output(h, "cancelled"))
                    continue
                joining.append((free.pop(0), h))
        if not joining:
            return []
        back = self._admit_rows([row for row, _ in joining], [h.reqs for _, h in joining])
        now = time.perf_counter()
        C = self.prefill_chunk
        for row, h in joining:
            h.admitted = now
            self._holders[row] = h
            if C and len(h.prompt) > C:
                self._parked[row] = C
        self.stats["admitted"] += len(joining)
        return [(back, {row: h for row, h in joining if row not in self._parked})]

    def _width(self, longest: int) -> int:
        """Prompt columns an admission passes: the longest prompt's bucket, at least 64 (a
        program each: fewer to compile), all of them, Tp, when it goes on in later blocks."""
        C, Tp = self.prefill_chunk, self.plan.prompt_len
        return Tp if C and longest > C else min(max(prompt_bucket(longest), 64), Tp)

    def _admission(self, rows: list[int], reqs_list: list[rq.Requests]):
        """(rows [A], Admission [A]) on the device for single requests into `rows`: a
        bucket of A = 1, 2, 4, ... requests, `_width` prompt columns."""
        A = min(1 << (len(rows) - 1).bit_length(), self.batch)
        width = self._width(max(len(r.prompts[0]) for r in reqs_list))
        reqs = rq.Requests(prompts=[r.prompts[0] for r in reqs_list], is_batch=True,
                           max_new=[r.max_new[0] for r in reqs_list],
                           sampling={k: [r.sampling[k][0] for r in reqs_list] for k in rq.SAMPLING_ARGS},
                           stop_ids=[r.stop_ids[0] for r in reqs_list])
        packed_rows, adm = rq.pack(self.plan, reqs, self.prog.cache)
        packed_rows[:len(rows)] = rows
        adm = adm.replace(prompt=adm.prompt[:, :width])
        return self.prog.put((packed_rows[:A], jax.tree.map(lambda a: a[:A], adm)))

    def _admit_rows(self, rows: list[int], reqs_list: list[rq.Requests]):
        """Dispatches the admission of single requests into `rows` -> its readback."""
        rows_dev, adm = self._admission(rows, reqs_list)
        plan = self._variant(self.plan, any(r.samples for r in reqs_list))  # the same for every tier
        admit = self.prog.program(programs.admit_jit, self._state, rows_dev, adm, plan=plan)
        self._state, back = admit(*self.prog.weights, self._state, rows_dev, adm)
        return back

    def warm_up(self, prompt_lens: Sequence[int] | None = None, sampled: bool = True) -> float:
        """Compiles what serving prompts of these lengths may run (None: the longest the
        engine takes), without running it: admissions of every bucket at their widths,
        prefill passes, and each tier's chunk, greedy and (sampled) sampling programs; for
        adaptive speculation the round costs are measured first. -> seconds (programs
        compiled before cost nothing)."""
        t0 = time.perf_counter()
        self._ready()
        by_width = {self._width(n): n for n in sorted(prompt_lens or [self.max_prompt_len])}  # a length a width
        for variant in (False, True) if sampled else (False,):
            plan = self._variant(self.plan, variant)
            for A in buckets(self.batch):
                for n in by_width.values():
                    reqs = rq.check_requests(self.params, [1] * n, 1, [], {})
                    self.prog.program(programs.admit_jit, self._state, *self._admission(list(range(A)), [reqs] * A),
                                      plan=plan)
                if self.prefill_chunk:
                    self.prog.program(programs.prefill_jit, self._state,
                                      *self.prog.put((np.zeros((A,), np.int32), np.zeros((A,), np.int32))), plan=plan)
            for tier_plan in self.plans:
                self.prog.program(programs.chunk_jit(self.rounds_per_chunk), self._state,
                                  plan=self._variant(tier_plan, variant))
        if not self._holders:
            self._free_rows([])  # an eviction of no row: compiles (and runs) the eviction program
        return time.perf_counter() - t0

    def _prefill_parked(self) -> list:
        """One block of every parked row's prompt -> [(readback, {row: request} of the rows
        whose prompt ended)]."""
        if not self._parked:
            return []
        rows = sorted(self._parked)
        A = min(1 << (len(rows) - 1).bit_length(), self.batch)
        row_arr = np.full((A,), self.batch, np.int32)
        start = np.zeros((A,), np.int32)
        row_arr[:len(rows)] = rows
        start[:len(rows)] = [self._parked[r] for r in rows]
        rows_dev, start_dev = self.prog.put((row_arr, start))
        plan = self._variant(self.plan, any(self._holders[r].samples for r in rows))
        prefill = self.prog.program(programs.prefill_jit, self._state, rows_dev, start_dev, plan=plan)
        self._state, back = prefill(*self.prog.weights, self._state, rows_dev, start_dev)
        self.stats["prefill_passes"] += 1
        starting = {}
        for r in rows:
            self._parked[r] += self.prefill_chunk
            if self._parked[r] >= len(self._holders[r].prompt):
                del self._parked[r]
                starting[r] = self._holders[r]
        return [(back, starting)] if starting else []

    def _evict(self, rows: list[int]) -> None:
        if not rows:
            return
        for row in rows:
            h = self._holders.pop(row)
            self._parked.pop(row, None)
            if h.cancelled and not h.done:
                h._push([], None, self._output(h, "cancelled"))
        self._free_rows(rows)

    def _free_rows(self, rows: list[int]) -> None:
        """Dispatches the eviction of `rows` (pages back to the pool, the rows free)."""
        padded = np.full((self.batch,), self.batch, np.int32)
        padded[:len(rows)] = rows
        with mesh_of(self.params):
            self._state = programs.evict_jit(self.plan, self._state, self.prog.put(padded))

    def _count_rounds(self, back: dict, snapshot: dict, tier: int) -> None:
        """The accept lengths of the rounds a chunk ran -> the tier choice and the stats."""
        if self.plan.proposer is None:
            return
        lens = []
        for row, h in snapshot.items():
            rounds = int(back["rounds"][row])
            lens.append(back["hist"][row, h.rounds_seen:rounds])
            h.rounds_seen = rounds
        lens = np.concatenate(lens) if lens else np.zeros((0,), np.int32)
        self.stats["accept_rounds"] += len(lens)
        self.stats["accept_tokens"] += int(np.sum(lens))
        if self._chooser is not None:
            self._chooser.observe(tier, lens)

    def _deliver(self, back: dict, holders: dict) -> None:
        """Hands each row's new tokens (and text) in a readback to its request (`holders`:
        the rows the readback covers); a finished row's request gets its output."""
        for row, h in holders.items():
            if h.done:
                continue
            n = len(h.prompt)
            g = int(back["generated"][row])
            new = [int(t) for t in back["tokens"][row, n + len(h.tokens): n + g]]
            finished = bool(back["finished"][row])
            reason = FINISH_REASONS[int(back["reason"][row])] if finished else None
            if h.stop_strings and new:
                new, cut = self._stop_string(h, new)
                if cut:
                    finished, reason = True, "stop"
            h.tokens.extend(new)
            self.stats["tokens"] += len(new)
            if finished:
                self.stats["rounds"] += int(back["rounds"][row])
                self.stats["finished"] += 1
            text = self._text(h, finished)
            h._push(new, text, self._output(h, reason) if finished else None)
    def _stop_string(self, h: Handle, new: list[int]) -> tuple[list[int], bool]:
        """new tokens -> (the tokens up to the one completing the first stop string, whether
        one completed); the request's text is cut before it."""
        tok = self.params.tokenizer
        for k in range(1, len(new) + 1):
            text = tok.decode(h.tokens + new[:k], skip_special_tokens=True)
            at = [text.find(s) for s in h.stop_strings if s in text]
            if at:
                h.text, h.cut = text[:min(at)], True
                return new[:k], True
        return new, False

    def _text(self, h: Handle, finished: bool) -> str | None:
        """The request's new text; while it runs, the last characters that may start a
        stop string are held back."""
        if self.params.tokenizer is None:
            return None
        if not h.cut:  # a stop string's match set the text already
            full = self.params.tokenizer.decode(h.tokens, skip_special_tokens=True)
            h.text = full if finished else full.rstrip("\ufffd")
        visible = h.text
        if not finished and h.stop_strings:
            visible = visible[:max(0, len(visible) - max(len(s) for s in h.stop_strings) + 1)]
        new = visible[h.shown_chars:]
        h.shown_chars = max(h.shown_chars, len(visible))
        return new

    def _output(self, h: Handle, reason: str) -> RequestOutput:
        if reason == "cancelled":
            self.stats["cancelled"] += 1
        now = time.perf_counter()
        started = h.admitted if h.admitted is not None else now
        text = None if self.params.tokenizer is None else h.text
        return RequestOutput(tokens=list(h.tokens), text=text, finish_reason=reason, prompt_tokens=len(h.prompt),
                             queued_s=started - h.submitted, run_s=now - started)

    # ------------------------------------------------------------------ the thread

    def start(self) -> "Engine":
        """Drives the engine from its own thread until `close`."""
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._run, name="jspec-engine", daemon=True)
            self._thread.start()
        return self

    def _wake(self) -> None:
        with self._lock:
            self._work.notify()

    def _run(self) -> None:
        while self._running:
            if not self.step():
                with self._lock:
                    self._work.wait_for(lambda: self._waiting or not self._running or any(
                        h.cancelled for h in self._holders.values()), timeout=1.0)

    def close(self) -> None:
        """Stops the thread (after the chunk it runs) and cancels what is left."""
        if self._thread is not None:
            self._running = False
            self._wake()
            self._thread.join()
            self._thread = None
        while self._inflight:  # the chunks in flight: their tokens are delivered
            back_dev, snapshot, _ = self._inflight.popleft()
            self._deliver(jax.device_get(back_dev), snapshot)
        for h in list(self._waiting) + list(self._holders.values()):
            if not h.done:
                h._push([], None, self._output(h, "cancelled"))
        self._waiting.clear()
        self._holders.clear()
        self._parked.clear()
        self._state, self._tier = None, self._first_tier

    def time_rounds(self, tier: int, prompts: list, rounds: int, repeats: int) -> float:
        """Seconds a round of tier `tier` (an index of `tiers`) takes with one placeholder
        request a prompt (token ids) running: admitted into an idle engine, a warm-up chunk
        of `rounds` rounds (compiling what is new), `repeats` timed chunks, then evicted
        (`jspec.serve.tiers.measure_costs`)."""
        while self._inflight or any(h.done or h.cancelled for h in self._holders.values()):
            self.step()  # finished requests evicted, chunks in flight read back
        if self._holders or self._waiting:
            raise RuntimeError("time_rounds needs an idle engine")
        self._ready()
        reqs = [rq.check_requests(self.params, p, self.max_new_tokens, [], {}) for p in prompts]
        rows = list(range(len(prompts)))
        self.use_tier(tier)
        jax.block_until_ready(self._admit_rows(rows, reqs))
        back = jax.device_get(self._advance(rounds, sampled=False))
        t0, step0 = time.perf_counter(), int(back["step"])
        for _ in range(repeats):
            back = self._advance(rounds, sampled=False)
        back = jax.device_get(back)
        seconds = time.perf_counter() - t0
        self._free_rows(rows)
        return seconds / max(int(back["step"]) - step0, 1)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
