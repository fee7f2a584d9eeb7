"""A serving engine: requests submitted at any time join a running batch between chunks
of rounds and leave it the moment they finish.

The engine owns one loop state of `max_batch` rows (`jspec.loop.state`) and drives the
loop's compiled entry points (`jspec.loop.programs`) from the host, one iteration at a
time (`Engine.step`), either called directly or from its own thread (`Engine.start`):
1. rows whose request finished or was cancelled are evicted (`evict`: pages back to the
   pool, the row free);
2. waiting requests go into free rows (`admit`: their prompts prefilled, their first
   token chosen), in buckets of 1, 2, 4, ... requests so that one admission does not pay
   for a full batch's prefill;
3. one chunk of `rounds_per_chunk` rounds runs (`advance`), and the rows' new tokens are
   read back and handed to their requests (`Handle`), with their text; stop strings are
   matched on the host, ending the request at the first match.
A request's tokens depend only on the request itself (its prompt, values and seed: see
`jspec.loop.rows`), so they are the same whatever shares the batch and whenever it joined.

Not here yet (issue 39): prefill in chunks interleaved with decoding (a prompt is
admitted whole), adaptive speculation tiers, the host preparing admissions while the
device runs a chunk, and the HTTP server.
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
from jspec.loop import programs
from jspec.loop.state import FINISH_REASONS
from jspec.params import Params


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
        self.finished_at: float | None = None
        self.cut = False  # a stop string ended it (`text` is cut before it)
        self.shown_chars = 0  # characters of `text` handed out
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
            if tokens and self.first_token_at is None:
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
    """Continuous batching over one compiled loop of `max_batch` rows.

    params: a `jspec.Params` (with a draft: speculative rounds, `spec` or its default).
    max_prompt_len, max_new_tokens: the largest request the engine takes (they size the
    compiled programs and the caches; a larger one is refused at `submit`). cache, spec,
    tuning: as `jspec.compile`. rounds_per_chunk: rounds between admissions (smaller:
    new requests start sooner, more host round trips). max_waiting: requests that may
    wait for a row before `submit` raises `QueueFull`.

        engine = jspec.Engine(params, max_batch=8)
        with engine:                                  # a thread drives it
            h = engine.submit("def fib(n):", max_new_tokens=64)
            for tokens, text in h:
                print(text, end="")
    """

    def __init__(self, params: Params, *, max_batch: int = 8, max_prompt_len: int = 512, max_new_tokens: int = 256,
                 cache=None, spec=None, tuning=None, rounds_per_chunk: int = 4, max_waiting: int = 256):
        rq.check_params(params)
        for name, v, low in (("max_batch", max_batch, 1), ("max_prompt_len", max_prompt_len, 1),
                             ("max_new_tokens", max_new_tokens, 1), ("rounds_per_chunk", rounds_per_chunk, 1),
                             ("max_waiting", max_waiting, 0)):
            if not rq.is_int(v) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        self.params = params
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.rounds_per_chunk, self.max_waiting = int(rounds_per_chunk), int(max_waiting)
        # The programs' shape: max_batch requests of the largest size, sampling compiled in
        # (greedy rows stay exact), up to 8 stop ids a request.
        shape = rq.check_requests(params, [[0] * self.max_prompt_len] * max_batch, self.max_new_tokens,
                                  [list(range(8))] * max_batch, {"temperature": 1.0})
        self.prog = Compiled(params, shape, rq.cache_config(cache), rq.spec_config(params, spec),
                             rq.tuning_config(tuning), eager=False)
        self.plan = self.prog.plan
        self.batch = self.plan.batch
        self._state = None
        self._step = 0  # the state's round count, as the last readback said (no sync to read it)
        self._holders: dict[int, Handle] = {}  # row -> its request
        self._waiting: collections.deque[Handle] = collections.deque()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False
        self.stats = {"rounds": 0, "chunks": 0, "admitted": 0, "finished": 0, "cancelled": 0, "tokens": 0,
                      "accept_rounds": 0, "accept_tokens": 0}

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
        """One iteration: evict, admit, one chunk of rounds, deliver. -> whether any
        request was running or waiting."""
        if self._state is None:
            with mesh_of(self.params):
                self._state = programs.init_jit(self.plan)
        self._evict([row for row, h in self._holders.items() if h.done or h.cancelled])
        with self._lock:
            free = [r for r in range(self.batch) if r not in self._holders]
            joining = []
            while free and self._waiting:
                h = self._waiting.popleft()
                if h.cancelled:
                    h._push([], None, self._output(h, "cancelled"))
                    continue
                joining.append((free.pop(0), h))
        if joining:
            self._admit(joining)
        if not self._holders:
            return bool(self._waiting)
        tw, pw = self.prog.weights
        st = self._state
        advance = self.prog.program(programs.advance_jit, st, np.int32(0))
        self._state, back = advance(tw, pw, st, np.int32(self._step + self.rounds_per_chunk))
        self.stats["chunks"] += 1
        self._deliver(jax.device_get(back))
        return True

    def _admit(self, joining: list[tuple[int, Handle]]) -> None:
        A = 1 << (len(joining) - 1).bit_length()  # a bucket of 1, 2, 4, ... requests
        A = min(A, self.batch)
        reqs = rq.Requests(prompts=[h.prompt for _, h in joining], is_batch=True,
                           max_new=[h.reqs.max_new[0] for _, h in joining],
                           sampling={k: [h.reqs.sampling[k][0] for _, h in joining] for k in rq.SAMPLING_ARGS},
                           stop_ids=[h.reqs.stop_ids[0] for _, h in joining])
        rows, adm = rq.pack(self.plan, reqs, self.prog.cache)
        rows[:len(joining)] = [row for row, _ in joining]
        rows, adm = self.prog.put((rows[:A], jax.tree.map(lambda a: a[:A], adm)))
        tw, pw = self.prog.weights
        admit = self.prog.program(programs.admit_jit, self._state, rows, adm)
        self._state, back = admit(tw, pw, self._state, rows, adm)
        now = time.perf_counter()
        for row, h in joining:
            h.admitted = now
            self._holders[row] = h
        self.stats["admitted"] += len(joining)
        self._deliver(jax.device_get(back))

    def _evict(self, rows: list[int]) -> None:
        if not rows:
            return
        for row in rows:
            h = self._holders.pop(row)
            if not h.done:
                h._push([], None, self._output(h, "cancelled"))
        padded = np.full((self.batch,), self.batch, np.int32)
        padded[:len(rows)] = rows
        with mesh_of(self.params):
            self._state = programs.evict_jit(self.plan, self._state, self.prog.put(padded))

    def _deliver(self, back: dict) -> None:
        """Hands each running row's new tokens (and text) to its request; a finished row's
        request gets its output (the row is evicted at the next step)."""
        self._step = int(back["step"])
        for row, h in list(self._holders.items()):
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
                if self.plan.proposer is not None:
                    rounds = int(back["rounds"][row])
                    self.stats["accept_rounds"] += rounds
                    self.stats["accept_tokens"] += int(np.sum(back["hist"][row, :rounds]))
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
        for h in list(self._waiting) + list(self._holders.values()):
            if not h.done:
                h._push([], None, self._output(h, "cancelled"))
        self._waiting.clear()
        self._holders.clear()
        self._state, self._step = None, 0

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
