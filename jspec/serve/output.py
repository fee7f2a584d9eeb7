"""The serving engine's output processor: token ids into text, incrementally, and stop
strings, off the thread that drives the device.

The engine hands it each request's new tokens (and their logprobs) as readbacks arrive
(`deliver`); it decodes only the new tokens against a few before them
(`IncrementalText`: the text of the tokens since the last stable point, minus the text
they had without the new ones, as vLLM's detokenizer does), so a request's text costs
O(its length) in all, not O(length squared). Stop strings are searched for only in the
new tail of the text (plus the last characters before it, where a stop string may have
started). A match ends the request: its text is cut before the stop string (or after
it, `include_stop_str_in_output`), its tokens end with the one that completed it, and the
engine is told to free its row (`on_stop`). While a request runs, the last characters
that may still become the start of a stop string are held back from its stream.

With its own thread (`start`), deliveries queue and are processed there; without one
(an engine driven by `Engine.step`), `deliver` processes them at once.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, NamedTuple

from jspec.results import TokenLogprob

log = logging.getLogger("jspec.serve")


class Delta(NamedTuple):
    """What a request's stream hands out at a time: new token ids, their new text (None
    without a tokenizer) and their `TokenLogprob`s (None unless the request asked)."""

    tokens: list[int]
    text: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class RequestOutput:
    """A finished request: its generated token ids (a stop token included, tokens after a
    stop string's end left out), their text (None without a tokenizer; cut at a stop
    string), finish_reason ('stop', 'length', 'cache_full', 'cancelled', 'timeout' or
    'error'), the prompt's token count, the times it waited and ran (seconds), its
    logprobs and prompt logprobs (`jspec.TokenLogprob`s; None unless asked; the prompt's
    first is None), the stop string that ended it, and the error's message."""

    tokens: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    queued_s: float
    run_s: float
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    stop_string: str | None = None
    error: str | None = None


class IncrementalText:
    """The text of a growing list of token ids, decoded a few tokens at a time: `add(ids)`
    returns the text they add, holding back a trailing U+FFFD (a character whose bytes are
    split between tokens) until it completes; `finish()` returns what is held back."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids before this decode to text handed out already, and are context only
        self.read = 0  # ids before this are covered by the text handed out

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]

    def mark(self) -> tuple[int, int, int]:
        """A point to come back to (`rewind`): the ids and offsets now."""
        return len(self.ids), self.prefix, self.read

    def rewind(self, mark: tuple[int, int, int]) -> None:
        n, self.prefix, self.read = mark
        del self.ids[n:]

    def finish(self) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


class Handle:
    """A submitted request. Iterating it yields `Delta`s (new token ids, new text, their
    logprobs) as chunks commit (blocking); `result()` waits for the `RequestOutput`;
    `cancel()` ends it at the next chunk boundary and frees its row. `stream()` and
    `wait()` are the asyncio forms. `tokens`: the ids handed out so far; `seed`: the seed
    it samples with (drawn afresh when the request gave none)."""

    def __init__(self, request, cancel: Callable[["Handle"], None]):
        self.request, self._cancel = request, cancel
        self.prompt = request.prompt
        self.seed = request.reqs.sampling["seed"][0]
        self.output: RequestOutput | None = None
        self.tokens: list[int] = []  # the token ids handed out so far
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.token_times: list[tuple[float, int]] = []  # (when, how many) of each delivery of tokens
        self.finished_at: float | None = None
        self._events: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waiters: list = []  # (asyncio loop, asyncio.Event) pairs to wake

    @property
    def done(self) -> bool:
        return self.output is not None

    def cancel(self) -> None:
        if not self.done:
            self._cancel(self)

    def push(self, delta: Delta | None, output: RequestOutput | None = None) -> None:
        """Hands out a delta and/or the final output (the output processor's thread)."""
        now = time.perf_counter()
        with self._cond:
            if self.output is not None:
                return
            if delta is not None and (delta.tokens or delta.text):
                self._events.append(delta)
                self.tokens.extend(delta.tokens)
                if delta.tokens:
                    self.token_times.append((now, len(delta.tokens)))
                    if self.first_token_at is None:
                        self.first_token_at = now
            if output is not None:
                self.output, self.finished_at = output, now
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

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
        """Async iterator of `Delta`s."""
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


@dataclasses.dataclass
class Delivery:
    """A request's progress from one readback: new token ids, their logprobs (or None),
    prompt logprobs (or None), and its finish reason once it ended (None: it goes on)."""

    handle: Handle
    tokens: list[int]
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    finish: str | None = None
    error: str | None = None


class RequestText:
    """The output processor's state of one request: its tokens, text and logprobs so far,
    stop strings and what was handed out."""

    def __init__(self, handle: Handle, tokenizer, options: dict):
        self.handle = handle
        self.stops: tuple[str, ...] = tuple(options.get("stop") or ())
        self.include_stop = bool(options.get("include_stop_str_in_output"))
        self.min_tokens = handle.request.reqs.min_tokens[0]
        self.text = IncrementalText(tokenizer, options.get("skip_special_tokens", True)) if tokenizer else None
        self.tokens: list[int] = []
        self.logprobs: list | None = [] if handle.request.token_logprobs else None
        self.prompt_logprobs: list | None = None
        self.full = ""  # the decoded text so far
        self.shown = 0  # characters of `full` handed out
        self.stop_string: str | None = None
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # characters held back while running
        self.floor = 0  # stop strings count once they end after this many characters (min_tokens)

    def add(self, d: Delivery) -> tuple[Delta | None, RequestOutput | None, bool]:
        """-> (the delta to hand out, the output if it finished, whether a stop string ended it)."""
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or [None]) + d.prompt_logprobs
        new = list(d.tokens)
        lps = d.logprobs
        stopped = False
        if self.text is not None:
            if self.stops and new:
                new, lps, stopped = self._stop_search(new, lps)
            else:
                self.full += self.text.add(new)
            if d.finish is not None and not stopped:
                self.full += self.text.finish()
        self.tokens += new
        if self.logprobs is not None and lps:
            self.logprobs += lps
        done = d.finish is not None or stopped
        visible = len(self.full) if done else max(self.shown, len(self.full) - (self.hold if self.stops else 0))
        text = self.full[self.shown:visible] if self.text is not None else None
        self.shown = max(self.shown, visible)
        delta = Delta(new, text, lps if self.logprobs is not None else None)
        if not done:
            return delta, None, False
        return delta, self.output("stop" if stopped else d.finish, d.error), stopped

    def _stop_search(self, new: list[int], lps):
        """Adds `new`, looking for a stop string in the new tail -> (the tokens up to the one
        completing it, their logprobs, whether one completed); `full` is cut there. A stop
        string counts once it ends after the text of the first min_tokens tokens."""
        start = len(self.full)
        mark = self.text.mark()
        need = self.min_tokens - len(self.tokens)  # tokens still to come before stop strings count
        if need >= len(new):
            self.full += self.text.add(new)
            return new, lps, False
        if need > 0:
            self.full += self.text.add(new[:need])
            self.floor = len(self.full)
        self.full += self.text.add(new[max(need, 0):])
        hit = self._find(max(0, start - self.hold, self.floor - self.hold))
        if hit is None:
            return new, lps, False
        at, stop = hit
        end = at + len(stop)
        self.text.rewind(mark)  # replay token by token to the one completing it
        full = self.full[:start]
        for k in range(1, len(new) + 1):
            full += self.text.add(new[k - 1:k])
            if len(full) >= end or k == len(new):
                break
        self.full = full[:end] if self.include_stop else full[:at]
        self.stop_string = stop
        return new[:k], (lps[:k] if lps else lps), True

    def _find(self, lo: int):
        """The stop string that ends first in full[lo:], after the min_tokens text -> (where
        it starts, which) or None."""
        best = None
        for s in self.stops:
            i = self.full.find(s, lo)
            while i >= 0 and i + len(s) <= self.floor:
                i = self.full.find(s, i + 1)
            if i >= 0 and (best is None or i + len(s) < best[0] + len(best[1])):
                best = (i, s)
        return best

    def output(self, reason: str, error: str | None = None) -> RequestOutput:
        h = self.handle
        q = h.request
        now = time.perf_counter()
        started = q.admitted_at if q.admitted_at is not None else now
        return RequestOutput(tokens=list(self.tokens), text=self.full if self.text is not None else None,
                             finish_reason=reason, prompt_tokens=len(q.prompt), queued_s=started - q.arrival,
                             run_s=now - started, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                             stop_string=self.stop_string, error=error)


class OutputProcessor:
    """See the module. tokenizer: the model's (None: no text); on_stop(handle): a stop
    string ended the request (the engine frees its row); on_finish(handle, output): every
    request's end (the engine's statistics); on_error(exception): processing failed (the
    engine fails every request)."""

    def __init__(self, tokenizer, on_stop: Callable[[Handle], None],
                 on_finish: Callable[[Handle, RequestOutput], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None):
        self.tokenizer, self.on_stop, self.on_finish, self.on_error = tokenizer, on_stop, on_finish, on_error
        self.requests: dict[Handle, RequestText] = {}
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None

    def open(self, handle: Handle, options: dict[str, Any]) -> None:
        """A request's text options: stop, include_stop_str_in_output, skip_special_tokens."""
        self.requests[handle] = RequestText(handle, self.tokenizer, options)

    def deliver(self, deliveries: list[Delivery]) -> None:
        if not deliveries:
            return
        if self._queue is not None:
            self._queue.put(deliveries)
        else:
            self.process(deliveries)

    def process(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            state = self.requests.get(d.handle)
            if state is None:  # ended already (a stop string; what the device did since is dropped)
                continue
            delta, output, stopped = state.add(d)
            if output is not None:
                del self.requests[d.handle]
                if stopped:
                    self.on_stop(d.handle)
                if self.on_finish is not None:
                    self.on_finish(d.handle, output)
            d.handle.push(delta, output)

    def start(self) -> None:
        if self._thread is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="jspec-output", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self.process(item)
            except Exception as err:  # noqa: BLE001  (a failure here must not strand the requests)
                for d in item:  # these at least; the engine fails the rest
                    if d.handle in self.requests:
                        state = self.requests.pop(d.handle)
                        d.handle.push(None, state.output("error", f"{type(err).__name__}: {err}"))
                if self.on_error is not None:
                    self.on_error(err)

    def stop(self) -> None:
        """Processes what is queued, then ends the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread, self._queue = None, None
