"""The serving engine's scheduler: pure host logic over requests and rows, with no device,
model or thread (tested on its own, `tests/test_scheduler.py`).

It owns the waiting queue, which request holds which of the batch's rows, how far each
prompt was prefilled, the speculation tier (`jspec.serve.tiers`) and the end of every
request, and turns them into `Decisions` each time the engine asks (`schedule`); the
engine's runner executes them on the device. What the device reports after a call (a
window readback, `jspec.loop.state.readback_window`) comes back through `update`, which
says how far each request got.

A request moves WAITING -> PREFILLING (a row is its; its prompt is passed a block at a
time) -> RUNNING (its rounds run in every chunk) -> DONE (finished on the device, or ended
on the host: cancelled, a stop string, its time out, an engine error). A row whose request
is done is evicted at the next `schedule` and can take the next request in the same call.

Pages (a paged cache), two policies. Reserving (`pages_at` None): a request is admitted
only while the pages it may come to hold (`pages_of`: its prompt, max_new and a round's
slack) fit the pool (`pool_pages`) beside those of every request in a row, and holds them
until its row is evicted. Preempting (`pages_at` given): a request is admitted while its
prompt and a chunk's growth fit beside what the rows hold now and will hold after the
chunks in flight and the next one (`chunk_slots` a chunk, a row); when the rows' growth
would not fit, no chunk is queued ahead, and with none in flight the most recently
admitted requests are preempted (`Decisions.preempt`): their rows are evicted and each goes
back to the front of the queue, its prompt followed by its output so far (`resumed`), to
be prefilled again and go on where it stopped (its noise is keyed by position: the same
tokens). Either way the device never runs out of pages, however small the pool: it hands
them out as rows grow, within each row's limit. A request that waits for pages keeps the
ones behind it waiting (first come, first served).

Order of work in one `schedule`: evict the rows of done requests; admit waiting requests
into free rows (first come, first served; groups of one program call each); the next
block of every prompt that is being prefilled; then whether to dispatch a chunk of rounds
now. With no request waiting and no prompt half prefilled, a second chunk is dispatched
behind the one in flight (the device never waits for the host); otherwise the engine
reads the chunk in flight back first, so that the rows it frees take new requests at the
very next chunk.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import numpy as np

from jspec import requests as rq
from jspec.loop.state import FINISH_REASONS

WAITING, PREFILLING, RUNNING, DONE = "waiting", "prefilling", "running", "done"


class QueueFull(RuntimeError):
    """The engine's waiting queue is full (a server answers 429 with Retry-After)."""


@dataclasses.dataclass(eq=False)
class Request:
    """One request as the scheduler sees it. reqs: the checked request (one prompt);
    arrival, deadline: seconds on the engine's clock (deadline None: no time limit)."""

    reqs: rq.Requests
    arrival: float = 0.0
    deadline: float | None = None
    state: str = WAITING
    row: int | None = None
    prefilled: int = 0  # prompt tokens whose pass was dispatched
    generated: int = 0  # tokens the device reported
    rounds: int = 0  # rounds the device reported (accept lengths counted up to here)
    finish: str | None = None  # why it ended, once DONE
    admitted_at: float | None = None
    pages: int = 0  # pages reserved from admission to eviction (a paged cache; `Scheduler.pool_pages`)
    output: list = dataclasses.field(default_factory=list)  # the tokens generated so far (the engine appends them)
    preemptions: int = 0
    accepts: list = dataclasses.field(default_factory=list)  # (tier, accept lengths) a chunk, until the chooser reads them

    def __post_init__(self):
        r = self.reqs
        self.prompt: list[int] = r.prompts[0]
        self.max_new: int = r.max_new[0]
        self.processing: bool = r.samples  # it needs the programs with the sampling steps (`Plan.sampling`)
        self.token_logprobs: bool = r.logprobs[0] is not None
        self.prompt_logprobs: bool = r.prompt_logprobs[0] is not None
        self.speculative: bool = r.speculative[0]

    def resume(self) -> None:
        """Back to WAITING after a preemption: the prompt followed by the output so far,
        to be prefilled again (`rq.Requests.resumed`), the rest of max_new and min_tokens;
        its prompt's logprobs were delivered already."""
        r = self.reqs
        done = len(self.output) - r.resumed[0]  # generated since the last (re)admission
        self.reqs = dataclasses.replace(r, prompts=[r.prompts[0] + self.output[r.resumed[0]:]],
                                        max_new=[r.max_new[0] - done], min_tokens=[max(r.min_tokens[0] - done, 0)],
                                        prompt_logprobs=[None], resumed=[len(self.output)])
        self.__post_init__()
        self.state, self.row, self.prefilled, self.generated, self.rounds, self.pages = WAITING, None, 0, 0, 0, 0
        self.preemptions += 1


@dataclasses.dataclass
class Progress:
    """What a readback says of one request: tokens generated before and now, and its
    finish reason if the device ended it."""

    request: Request
    row: int
    before: int
    now: int
    finish: str | None
    accept_lens: np.ndarray | None = None  # the accept lengths of its rounds in a chunk (speculating rows)


@dataclasses.dataclass
class Decisions:
    """One call's work, in this order: evict rows; admissions (each group one program
    call: rows and their requests); prefill passes (each group: rows and the slot their
    next block starts at); a chunk of rounds (dispatch) on `tier`, with the sampling steps
    (sampled) and logprobs recorded (logprobs) or not. ended: requests the scheduler ended
    without a row to evict (cancelled or timed out while waiting)."""

    evict: list[tuple[int, Request]] = dataclasses.field(default_factory=list)
    admit: list[list[tuple[int, Request]]] = dataclasses.field(default_factory=list)
    prefill: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    dispatch: bool = False
    tier: int = 0
    sampled: bool = False
    logprobs: bool = False
    running: dict[int, Request] = dataclasses.field(default_factory=dict)  # the rows the chunk runs
    ended: list[Request] = dataclasses.field(default_factory=list)
    preempt: list[tuple[int, Request]] = dataclasses.field(default_factory=list)  # rows to evict, requests requeued


class Scheduler:
    """See the module. batch: rows; prefill_chunk: C, prompt tokens a pass takes (0: whole
    prompts in one pass); width_class(prompt length) -> the admission program's prompt
    width, which groups admissions; rounds_per_chunk: rounds a chunk runs; max_waiting:
    requests that may wait before `add` raises `QueueFull`; chooser: the adaptive tier
    choice (`jspec.serve.tiers.Chooser`) or None; tier: the tier without a chooser (and
    the chooser's first); pool_pages: the page pool (0: no page accounting, a dense
    cache); pages_of(request) -> the pages it may come to hold; pages_at(request, slots)
    -> the pages that hold that many of its slots (within its limit), given to preempt
    instead of reserving; chunk_slots: the slots a chunk may add to a row."""

    def __init__(self, batch: int, *, prefill_chunk: int, width_class: Callable[[int], int], rounds_per_chunk: int,
                 max_waiting: int, chooser=None, tier: int = 0, pool_pages: int = 0,
                 pages_of: Callable[[Request], int] | None = None,
                 pages_at: Callable[[Request, int], int] | None = None, chunk_slots: int = 0):
        if pool_pages and pages_of is None:
            raise ValueError("pool_pages needs pages_of")
        self.pool_pages, self.pages_of, self.pages_at, self.chunk_slots = pool_pages, pages_of, pages_at, chunk_slots
        self.batch, self.prefill_chunk, self.width_class = batch, prefill_chunk, width_class
        self.rounds_per_chunk, self.max_waiting = rounds_per_chunk, max_waiting
        self.chooser, self.tier = chooser, tier
        self.pinned: int | None = None  # a tier every chunk runs, whatever the chooser says
        self.waiting: collections.deque[Request] = collections.deque()
        self.rows: dict[int, Request] = {}  # row -> the request holding it (any state but WAITING)
        self.inflight = 0  # chunks dispatched and not yet read back (`update` counts them down)
        self.ended_waiting: list[Request] = []

    # ------------------------------------------------------------------ requests

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_waiting={self.max_waiting})")
        self.waiting.append(request)

    def end(self, request: Request, reason: str) -> bool:
        """Ends a request on the host (cancelled, a stop string, timeout, error) -> whether
        it was still going. Its row, if it has one, is evicted at the next `schedule`."""
        if request.state == DONE:
            return False
        if request.state == WAITING:
            self.waiting.remove(request)
            self.ended_waiting.append(request)
        request.state, request.finish = DONE, reason
        return True

    @property
    def running(self) -> list[int]:
        return [r for r, q in self.rows.items() if q.state == RUNNING]

    @property
    def prefilling(self) -> list[int]:
        return [r for r, q in self.rows.items() if q.state == PREFILLING]

    @property
    def pages_free(self) -> int:
        """Pages of the pool that no request in a row holds (preempting: may hold once the
        chunks in flight and the next one ran)."""
        return self.pool_pages - sum(self._held(q, self.inflight + 1) for q in self.rows.values())

    def _held(self, q: Request, ahead: int) -> int:
        """The pages request q (in a row) holds: reserving, all it may ever hold; preempting,
        its prompt and output so far and `ahead` chunks' growth."""
        if self.pages_at is None:
            return q.pages
        return self.pages_at(q, len(q.prompt) + q.generated + ahead * self.chunk_slots)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.rows or self.inflight or self.ended_waiting)

    # ------------------------------------------------------------------ decisions

    def schedule(self, now: float) -> Decisions:
        for q in list(self.waiting) + list(self.rows.values()):
            if q.deadline is not None and now > q.deadline and q.state != DONE:
                self.end(q, "timeout")
        d = Decisions(tier=self.tier, ended=self.ended_waiting)
        self.ended_waiting = []
        d.evict = [(r, q) for r, q in self.rows.items() if q.state == DONE]
        for r, _ in d.evict:
            del self.rows[r]
        d.prefill = self._prefill_blocks()  # rows parked before this call: their next blocks
        d.admit = self._admissions(now)
        short = self.pool_pages and self.pages_at is not None and self.pages_free < 0
        if short and self.inflight == 0:
            d.preempt = self._preempt({r for g in d.admit for r, _ in g})
            short = False
        running = self.running
        queue = bool(self.waiting or self.prefilling)
        ahead = self.inflight == 1 and not queue and self._outlasts(running)
        if running and not short and (self.inflight == 0 or ahead):
            d.dispatch = True
            d.running = {r: self.rows[r] for r in running}
            if self.pinned is not None:
                self.tier = self.pinned
            elif self.chooser is not None:
                self.tier = self.chooser.choose(self.tier, list(d.running.values()))
            d.tier = self.tier
            d.sampled = any(self.rows[r].processing for r in running)
            d.logprobs = any(self.rows[r].token_logprobs for r in running)
            self.inflight += 1
        return d

    def _preempt(self, admitted: set) -> list[tuple[int, Request]]:
        """The most recently admitted running requests (not those admitted in this call)
        leave their rows and go back to the front of the queue until the rest fit (see the
        module)."""
        out = []
        for r, q in sorted(self.rows.items(), key=lambda rq_: (-rq_[1].admitted_at, -rq_[0])):  # latest first
            if self.pages_free >= 0:
                break
            if r in admitted or q.state != RUNNING:  # a prompt half prefilled has a block queued in this call
                continue
            del self.rows[r]
            q.resume()
            self.waiting.appendleft(q)
            out.append((r, q))
        return out

    def _outlasts(self, running: list[int]) -> bool:
        """Whether a running request may still run after the chunk in flight (each of its
        rounds emits at least a token a running row): if not, no chunk is queued behind."""
        return any(self.rows[r].generated + self.rounds_per_chunk < self.rows[r].max_new for r in running)

    def _admissions(self, now: float) -> list[list[tuple[int, Request]]]:
        """Waiting requests into free rows while their pages fit, first come first served,
        grouped by program: the admission's prompt width (`width_class`) and whether it
        records prompt logprobs (such a request is admitted alone: its pass computes logits
        at every prompt position)."""
        free = [r for r in range(self.batch) if r not in self.rows]
        pages = self.pages_free
        groups: dict[tuple, list] = {}
        while free and self.waiting:
            head = self.waiting[0]
            need = 0
            if self.pool_pages:
                need = (self.pages_of(head) if self.pages_at is None else
                        self.pages_at(head, len(head.prompt) + 1 + self.chunk_slots))
            if need > pages:
                break
            q = self.waiting.popleft()
            pages -= need
            row = free.pop(0)
            q.state, q.row, q.admitted_at, q.pages = PREFILLING, row, now, need
            q.prefilled = min(len(q.prompt), self.prefill_chunk or len(q.prompt))
            if q.prefilled == len(q.prompt):
                q.state = RUNNING
            self.rows[row] = q
            key = ("alone", row) if q.prompt_logprobs else ("width", self.width_class(len(q.prompt)))
            groups.setdefault(key, []).append((row, q))
        return list(groups.values())

    def _prefill_blocks(self) -> list[list[tuple[int, int]]]:
        """The next block of every prompt being prefilled (rows with prompt logprobs alone)."""
        shared, alone = [], []
        for r in self.prefilling:
            q = self.rows[r]
            (alone.append([(r, q.prefilled)]) if q.prompt_logprobs else shared.append((r, q.prefilled)))
            q.prefilled = min(len(q.prompt), q.prefilled + self.prefill_chunk)
            if q.prefilled == len(q.prompt):
                q.state = RUNNING
        return ([shared] if shared else []) + alone

    # ------------------------------------------------------------------ what the device reported

    def update(self, back: dict, rows: dict[int, Request], chunk: bool, tier: int | None = None) -> list[Progress]:
        """A readback (host arrays) of a call that covered `rows` (row -> request); chunk:
        it was a chunk of rounds (`inflight` counts it down; tier: the tier it ran) ->
        the progress of each request still going. A request the device finished is DONE
        (its row evicted at the next `schedule`)."""
        if chunk:
            self.inflight -= 1
        out, lens = [], []
        for row, q in rows.items():
            if q.row != row or q.state == DONE:
                continue  # ended already (on the device or the host): what the device did since is dropped
            now = int(back["generated"][row])
            reason = FINISH_REASONS[int(back["reason"][row])] if back["finished"][row] else None  # None: parked
            accepted = None
            if chunk and back["hist"].shape[1]:
                rounds, start = int(back["rounds"][row]), int(back["rounds_from"][row])
                if q.speculative:
                    accepted = back["hist"][row, q.rounds - start: rounds - start]
                    lens.append(accepted)
                    if self.chooser is not None and self.pinned is None and tier is not None:
                        q.accepts.append((tier, accepted))
                q.rounds = rounds
            out.append(Progress(q, row, q.generated, now, reason, accepted))
            q.generated = now
            if reason is not None:
                q.state, q.finish = DONE, reason
        if chunk and self.chooser is not None and tier is not None:
            self.chooser.observe(tier, np.concatenate(lens) if lens else np.zeros((0,), np.int32))
        return out
