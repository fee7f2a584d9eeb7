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

Pages (a paged cache): the scheduler holds the engine's page pool (`jspec.serve.pages.
PagePool`) and decides which pages each request holds; the runner writes them into the
device's page table before the calls that use them (`Decisions.pages`). Two policies.
Reserving (`preempting` False, a pool that holds every row's whole room, or preemption
off): a request is admitted only while the pages of its whole limit (`pages_at` of its
prompt, max_new and a round's slack) are free, and holds them until its row is evicted.
Preempting: a request is admitted while its prompt and a chunk's growth fit beside the
growth the rows in flight will need; before each chunk every running row is given the
pages of the chunks in flight and the next one (`chunk_slots` a chunk, a row); when they
do not fit, no chunk is queued ahead, and with none in flight the most recently admitted
requests are preempted (`Decisions.preempt`): their rows are evicted and each goes back to
the front of the queue, its prompt followed by its output so far (`resumed`), to be
prefilled again and go on where it stopped (its noise is keyed by position: the same
tokens). Either way the device never runs out of pages. A request that waits for pages
keeps the ones behind it waiting (first come, first served).

Prefix caching (a pool with `prefix_caching`, prompts passed in blocks): a request's
prompt is looked up when it is admitted; the pages of its longest cached prefix (at most
its prompt less one token) are shared into its row, which is set up with no pass
(`Decisions.cached`) and prefilled from the first slot past them. A request whose prompt
begins with at least a block more than it finds, of a prompt in a row whose passes will
cache it, waits for them (and the queue behind it), as SGLang's in-batch prefix check
does: `n` samples of one prompt and requests that arrive together with a new common
prefix compute it once. Full pages are
registered in the cache once the call whose pass writes them is dispatched: an
admission's at once (the device runs calls in order, so a pass in a later call reads them
written: requests with a new common prefix admitted together share it), a prefill
block's at the next `schedule` (a block of a request admitted in the same call may run
in the same pass); when a row is evicted, those of its output too (`cache_margin` slots
short of its end, where a draft's cache may lag). A hybrid target's recurrent states are
saved where a prompt block ends inside the prompt and at its *state points*: the prompt's
last page boundary before its last token, and the end of a cached prefix it found deeper
than a saved state (`_state_points`: the pass that would cross one stops there,
`Decisions.stops`, its state is saved, and the rest passes in the same call when it lies
within a narrow block, `Decisions.tails`, else in the next; so does the rest past a
block's end where the state is saved); each is attached to the
page that ends there at the next call; a hit restores them (`Decisions.restore`).

Order of work in one `schedule`: cache the pages (and hybrid states) of the passes of
earlier calls; evict the rows of done requests; the next block of every prompt that is
being prefilled; admit waiting requests into free rows (first come, first served; groups
of one program call each); the tails of prompts stopped at a state point; preempt if the running rows' growth does not fit (none with a
pass in this call); then whether to dispatch a chunk of rounds now, giving the running
rows their pages. With no request waiting and no prompt half prefilled, a second chunk is dispatched
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
from jspec.serve.pages import PagePool

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
    pages: list = dataclasses.field(default_factory=list)  # the pages its row holds, in order (a page pool)
    cached: int = 0  # of which the first `cached` were a cached prefix at its admission
    node: int = 0  # the prefix-cache node of its last registered page (`PagePool.register`; < 0: none)
    nodes: list = dataclasses.field(default_factory=list)  # the cache node of each page it registered, from `cached` on
    registered: int = 0  # its pages registered in (or found in) the prefix cache
    snaps: dict = dataclasses.field(default_factory=dict)  # prompt slot -> the pending state snapshot saved there
    shared: int = 0  # the cached prefix it found deeper than a saved state (a hybrid's; a state point)
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

    @property
    def tokens(self) -> list[int]:
        """The tokens its row holds: its prompt and the output since its last admission."""
        return self.prompt + self.output[self.reqs.resumed[0]:]

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
        self.state, self.row, self.prefilled, self.generated, self.rounds = WAITING, None, 0, 0, 0
        self.pages, self.cached, self.node, self.nodes, self.registered, self.snaps = [], 0, 0, [], 0, {}
        self.shared = 0
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
    next block starts at); the hybrid states saved (save); the tails of prompts whose pass
    stopped at a state point (tails: groups like prefill's, in passes of the narrow width,
    else the block's); a chunk of
    rounds (dispatch) on `tier`, with the sampling steps
    (sampled) and logprobs recorded (logprobs) or not. ended: requests the scheduler ended
    without a row to evict (cancelled or timed out while waiting)."""

    evict: list[tuple[int, Request]] = dataclasses.field(default_factory=list)
    admit: list[list[tuple[int, Request]]] = dataclasses.field(default_factory=list)
    prefill: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    widths: list[int] = dataclasses.field(default_factory=list)  # each prefill pass's block width (tokens a row)
    dispatch: bool = False
    tier: int = 0
    sampled: bool = False
    logprobs: bool = False
    running: dict[int, Request] = dataclasses.field(default_factory=dict)  # the rows the chunk runs
    ended: list[Request] = dataclasses.field(default_factory=list)
    preempt: list[tuple[int, Request]] = dataclasses.field(default_factory=list)  # rows to evict, requests requeued
    pages: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (row, column, page) to set
    cached: list[list[tuple[int, Request]]] = dataclasses.field(default_factory=list)  # admissions with no pass
    restore: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, snapshot) after `cached`
    save: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, snapshot) after the passes
    stops: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> the slot its pass in this call stops at
    tails: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)  # after `save`: (row, its stop)


class Scheduler:
    """See the module. batch: rows; prefill_chunk: C, prompt tokens a pass takes (0: whole
    prompts in one pass); width_class(prompt length) -> the admission program's prompt
    width, which groups admissions; rounds_per_chunk: rounds a chunk runs; max_waiting:
    requests that may wait before `add` raises `QueueFull`; chooser: the adaptive tier
    choice (`jspec.serve.tiers.Chooser`) or None; tier: the tier without a chooser (and
    the chooser's first); pool: the page pool (None: no page accounting, a dense cache);
    pages_at(request, slots) -> the pages that hold that many of its slots (within its
    limit); preempting: the policy (see the module); chunk_slots: the slots a chunk may add
    to a row; cache_margin: slots short of an evicted row's end that its cached pages stay;
    pass_rows: rows a pass takes at most; narrow_block: the width of a narrower block
    program for a prompt's short last block (0: none); wide_block: the width of a wider
    block program of one row, for a lone prompt (0: none; see `_prefill_blocks`)."""

    def __init__(self, batch: int, *, prefill_chunk: int, width_class: Callable[[int], int], rounds_per_chunk: int,
                 max_waiting: int, chooser=None, tier: int = 0, pool: PagePool | None = None,
                 pages_at: Callable[[Request, int], int] | None = None, preempting: bool = False,
                 chunk_slots: int = 0, cache_margin: int = 0, pass_rows: int | None = None,
                 narrow_block: int = 0, wide_block: int = 0):
        if pool is not None and pages_at is None:
            raise ValueError("a page pool needs pages_at")
        self.pool, self.pages_at, self.preempting, self.chunk_slots = pool, pages_at, preempting, chunk_slots
        self.cache_margin = cache_margin
        self.batch, self.prefill_chunk, self.width_class = batch, prefill_chunk, width_class
        self.pass_rows = pass_rows or batch  # rows one admission or prefill pass takes at most
        self.narrow_block = narrow_block  # a narrower block program's width (0: none)
        self.wide_block = wide_block  # a wider block program's width, for one row (0: none)
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
        """Pages of the pool free after the rows in flight got their growth (preempting:
        the pages of the chunks in flight and the next one; below 0: they do not fit)."""
        if self.pool is None:
            return 0
        return self.pool.available - sum(self._growth(q) for q in self.rows.values())

    def _growth(self, q: Request) -> int:
        """Pages request q (in a row) needs beyond those it holds before the next chunk."""
        if not self.preempting or q.state != RUNNING:
            return 0
        want = self.pages_at(q, len(q.prompt) + q.generated + (self.inflight + 1) * self.chunk_slots)
        return max(0, want - len(q.pages))

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
        if self.pool is not None and self.pool.prefix_caching:
            for q in self.rows.values():  # the pages and states of the passes dispatched in earlier calls
                self._register(q, q.prompt, q.prefilled)
                self._attach(q)
        d.evict = [(r, q) for r, q in self.rows.items() if q.state == DONE]
        for r, q in d.evict:
            del self.rows[r]
            self._let_go(q)
        d.prefill, d.widths = self._prefill_blocks(d)  # rows parked before this call: their next blocks
        d.admit, d.cached = self._admissions(now, d)
        d.tails = self._tails(d)
        short = self.pages_free < 0
        if short and self.inflight == 0:  # not the rows with a pass in this call (they need no more pages)
            d.preempt = self._preempt({r for g in d.admit + d.cached + d.prefill for r, _ in g})
            short = False
        running = self.running
        queue = bool(self.waiting or self.prefilling)
        ahead = self.inflight == 1 and not queue and self._outlasts(running)
        if running and not short and (self.inflight == 0 or ahead):
            for r in running:
                self._give(r, self.rows[r], self._growth(self.rows[r]), d)
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

    def _give(self, row: int, q: Request, n: int, d: Decisions) -> None:
        """n more pages for request q in `row` (set on the device by `d.pages`)."""
        if n <= 0:
            return
        pages = self.pool.take(n)
        d.pages += [(row, len(q.pages) + i, p) for i, p in enumerate(pages)]
        q.pages += pages

    def _let_go(self, q: Request) -> None:
        """Request q leaves its row: its full pages go into the prefix cache (its tokens known
        up to the end, less `cache_margin`), then all its pages back to the pool."""
        if self.pool is None:
            return
        if q.prefilled == len(q.prompt):  # a prompt half prefilled was registered as far as its passes went
            self._register(q, q.tokens, len(q.tokens) - 1 - self.cache_margin)
        self._attach(q)
        self.pool.release(q.pages)
        for slot in q.snaps.values():
            self.pool.drop_slot(slot)
        q.pages, q.snaps = [], {}

    def _register(self, q: Request, tokens: list[int], known: int) -> None:
        """q's pages up to slot `known` (and, where the pool's keys hold it, whose token after
        is in `tokens`) into the cache."""
        P = self.pool.page_size
        upto = min(max(known, 0), len(tokens) - self.pool.next_token) // P
        if upto <= q.registered:
            return
        for j in range(q.registered, min(upto, len(q.pages))):
            if q.node < 0:
                break
            q.node = self.pool.register(q.node, tokens[j * P:j * P + self.pool.key_len], q.pages[j])
            q.nodes.append(q.node)
        q.registered = max(q.registered, min(upto, len(q.pages)))

    def _attach(self, q: Request) -> None:
        """q's states saved in earlier calls, where their pages are registered, into the
        cache (not in the call that saves them: a request admitted in it would restore
        them before they are saved)."""
        P = self.pool.page_size
        for b in [b for b in q.snaps if q.cached < b // P <= q.cached + len(q.nodes)]:
            self.pool.attach(q.nodes[b // P - 1 - q.cached], q.snaps.pop(b))  # the node of the page ending at b

    def _preempt(self, passing: set) -> list[tuple[int, Request]]:
        """The most recently admitted running requests (not those with a pass in this call:
        `passing`) leave their rows and go back to the front of the queue until the rest fit
        (see the module)."""
        out = []
        for r, q in sorted(self.rows.items(), key=lambda rq_: (-rq_[1].admitted_at, -rq_[0])):  # latest first
            if self.pages_free >= 0:
                break
            if r in passing or q.state != RUNNING:
                continue
            del self.rows[r]
            self._let_go(q)
            q.resume()
            self.waiting.appendleft(q)
            out.append((r, q))
        return out

    def _outlasts(self, running: list[int]) -> bool:
        """Whether a running request may still run after the chunk in flight (each of its
        rounds emits at least a token a running row): if not, no chunk is queued behind."""
        return any(self.rows[r].generated + self.rounds_per_chunk < self.rows[r].max_new for r in running)

    def _admissions(self, now: float, d: Decisions) -> tuple[list, list]:
        """Waiting requests into free rows while their pages fit, first come first served,
        grouped by program: the admission's prompt width (`width_class`) and whether it
        records prompt logprobs (such a request is admitted alone: its pass computes logits
        at every prompt position) -> (admissions with a pass, admissions of cached prefixes
        with none, whose first blocks join `d.prefill`)."""
        free = [r for r in range(self.batch) if r not in self.rows]
        groups: dict[tuple, list] = {}
        full: list = []  # groups of pass_rows rows
        cached: list = []
        while free and self.waiting:
            head = self.waiting[0]
            hit, node = [], 0
            slot = None
            caching = self.pool is not None and self.pool.prefix_caching and self.prefill_chunk
            if self.pool is not None:
                if caching and not head.prompt_logprobs:
                    hit, node, slot = self.pool.lookup(head.prompt, len(head.prompt) - 1)
                    if self._follows(head, len(hit) * self.pool.page_size):
                        break
                    if self.pool.snapshots:  # once, as it is admitted
                        head.shared = self.pool.cached_depth(head.prompt, len(head.prompt) - 1)
                slots = len(head.prompt) + 1 + self.chunk_slots if self.preempting else 1 << 62
                new = max(self.pages_at(head, slots) - len(hit), 0)
                if new + self.pool.cost(hit) > self.pages_free:
                    break
            q = self.waiting.popleft()
            row = free.pop(0)
            q.state, q.row, q.admitted_at = PREFILLING, row, now
            if self.pool is not None:
                if caching:
                    self.pool.count(len(q.prompt), len(hit) * self.pool.page_size)
                self.pool.share(hit)
                q.pages, q.cached, q.node, q.registered = list(hit), len(hit), node, len(hit)
                d.pages += [(row, j, p) for j, p in enumerate(hit)]
                self._give(row, q, new, d)
            self.rows[row] = q
            if hit:
                q.prefilled = len(hit) * self.pool.page_size
                cached.append((row, q))
                if slot is not None:
                    d.restore.append((row, slot))
                self._next_block(row, q, d)
                continue
            q.prefilled = d.stops[row] = self._pass_end(q, 0, self.prefill_chunk or len(q.prompt))
            if q.prefilled == len(q.prompt):
                q.state = RUNNING
            if self.pool is not None:
                self._register(q, q.prompt, q.prefilled)
                self._snapshot(row, q, d)
            key = ("alone", row) if q.prompt_logprobs else ("width", self.width_class(len(q.prompt)))
            if len(groups.setdefault(key, [])) == self.pass_rows:
                full.append(groups.pop(key))
            groups.setdefault(key, []).append((row, q))
        return full + list(groups.values()), [cached] if cached else []

    def _follows(self, head: Request, found: int) -> bool:
        """Whether a request in a row will cache at least a block more of head's prompt
        than the `found` tokens head finds now, or (pools that keep snapshots) its prefix
        up to its state point, deeper than `found` (its prompt begins with those tokens and
        its passes have not cached them yet): head then waits for it, rather than compute
        what it computes (`n` samples of one prompt, requests with a new common prefix)."""
        nt = self.pool.next_token  # a page's key holds the token after it too: head must share that one
        for q in self.rows.values():
            if q.state == DONE:
                continue
            for t in {found + self.prefill_chunk, *self._state_points(q)}:  # a block's worth more; q's state points
                if found < t <= len(head.prompt) - 1 and self._will_cache(q, t) \
                        and q.prompt[:t + nt] == head.prompt[:t + nt]:
                    return True
            if self.pool.snapshots and self._will_register(q, head, found):
                return True
        return False

    def _will_register(self, q: Request, head: Request, found: int) -> bool:
        """(Pools that keep snapshots.) Whether q's passes are yet to register the pages of
        a prefix head's prompt shares with q's, at least a narrow block (a page at least)
        deeper than the `found` tokens head finds with a state: head waits for them, then
        finds them cached past that state, and its first pass stops at their end to save
        the state there (`shared`), which the requests after it find whole. (One
        comparison of the prompts, after a page's: unrelated rows cost a page's.)"""
        P, nt = self.pool.page_size, self.pool.next_token
        need = max(found + max(self.narrow_block, P), (q.registered + 1) * P)  # a page q has not registered
        need = -(-need // P) * P
        k = need + nt  # the tokens whose keys find the pages up to `need`
        if k > min(len(q.prompt), len(head.prompt) - 1) or q.prompt[found:found + P] != head.prompt[found:found + P]:
            return False
        return q.prompt[:k] == head.prompt[:k]

    def _will_cache(self, q: Request, t: int) -> bool:
        """Whether q's passes are yet to make a hit of its first t prompt tokens findable:
        their pages not registered yet, or (pools that keep snapshots, where a hit needs a
        saved state at its end) the state at t neither attached nor passed by without one."""
        if self.pool.snapshots:
            at = t % self.pool.boundary == 0 or t in self._state_points(q)
            return t < len(q.prompt) and at and (t in q.snaps or t > q.prefilled)
        return q.registered * self.pool.page_size < t <= len(q.prompt) - 1

    def short_block(self, q: Request, start: int) -> bool:
        """Whether q's pass from `start` takes at most `narrow_block` tokens (its prompt
        ends that soon, or the pass stops that soon at a block's end or a state point:
        `_pass_end`), so that it may take the narrower program."""
        return bool(self.narrow_block) and not q.prompt_logprobs \
            and self._pass_end(q, start, self.prefill_chunk) - start <= self.narrow_block

    def _next_block(self, row: int, q: Request, d: Decisions) -> None:
        """The first block of a cached admission (with no prompt logprobs) joins a prefill
        group of this call with room, whose blocks are as short or as long as its own."""
        width = self.narrow_block if self.short_block(q, q.prefilled) else self.prefill_chunk
        group = next((g for g, w in zip(d.prefill, d.widths) if w == width and len(g) < self.pass_rows and all(
            not self.rows[r].prompt_logprobs for r, _ in g)), None)
        if group is None:
            group = []
            d.prefill.insert(0, group)
            d.widths.insert(0, width)
        group.append((row, q.prefilled))
        self._advance(row, q, d, width)

    def _advance(self, row: int, q: Request, d: Decisions, width: int) -> None:
        """A block of q's prompt, `width` tokens wide, was dispatched: how far it got. (Its
        pages are cached at the next call: a request admitted in this one may have its first
        block in the same prefill pass, which must not read pages that pass writes.)"""
        q.prefilled = d.stops[row] = self._pass_end(q, q.prefilled, width)
        if q.prefilled == len(q.prompt):
            q.state = RUNNING
        elif self.pool is not None:
            self._snapshot(row, q, d)

    @property
    def _saves_states(self) -> bool:
        """Whether prompt passes save a hybrid's states for prefix caching: a pool that
        keeps snapshots and caches, prompts passed in blocks."""
        return self.pool is not None and bool(self.pool.snapshots) and self.pool.prefix_caching \
            and bool(self.prefill_chunk)

    def _state_points(self, q: Request) -> list[int]:
        """Where a pool that keeps snapshots saves q's state besides its blocks' ends, in
        order: the end of the cached prefix it found deeper than a saved state (`shared`:
        another request's prompt began so; the requests that share it after q find it
        whole), and the last page boundary before its prompt's last token, as deep as a
        later request with the same prompt can find it (`PagePool.lookup` takes all but the
        last token). Each only where it lies at least `narrow_block` tokens past the last
        block's end before it (the pass it adds costs about a narrow block's); none for a
        prompt whose logprobs are recorded, or a pool that keeps no snapshots."""
        if not self._saves_states or q.prompt_logprobs:
            return []
        last = (len(q.prompt) - 1) // self.pool.page_size * self.pool.page_size
        return sorted({t for t in (q.shared, last) if t % self.prefill_chunk >= max(self.narrow_block, 1)})

    def _pass_end(self, q: Request, start: int, width: int) -> int:
        """Where a pass of `width` tokens of q's prompt from slot `start` stops: the prompt's
        end or the block's, or q's first state point between (the pass then stops there,
        its state saved, and the next pass takes the rest: a prefix other requests share,
        a short prompt's, or a long one's past its last whole block, is found by later
        requests). Where the pool keeps snapshots a pass that starts past a state point
        (or a hit there) stops at the next multiple of the block, so that the later passes
        end, and save their states, at whole blocks."""
        end = min(len(q.prompt), start + width)
        if self._saves_states:
            end = min(end, (start // self.prefill_chunk + 1) * self.prefill_chunk)
        return next((t for t in self._state_points(q) if start < t < end), end)

    def _tails(self, d: Decisions) -> list[list[tuple[int, int]]]:
        """Rows whose pass in this call stops at a state point, or (with a narrow program)
        at a block's end where its state is saved, with the rest of the prompt within a
        narrow block (or a block, with no narrow program: the last page boundary before a
        prompt's last token): that rest passes in the same call, after the state is saved
        (`Decisions.tails`, passes of that width and at most pass_rows rows), so a state
        point or a prompt's last short block costs no engine iteration before the first
        token."""
        width = self.narrow_block or self.prefill_chunk
        saved = {r for r, _ in d.save} if self.narrow_block else set()
        rows = [r for r, t in d.stops.items() if t < len(self.rows[r].prompt)
                and (t in self._state_points(self.rows[r]) or r in saved)
                and self._pass_end(self.rows[r], t, width) == len(self.rows[r].prompt)]
        for r in rows:
            q = self.rows[r]
            q.prefilled, q.state = len(q.prompt), RUNNING
        P = self.pass_rows
        return [[(r, d.stops[r]) for r in rows[i:i + P]] for i in range(0, len(rows), P)]

    def _snapshot(self, row: int, q: Request, d: Decisions) -> None:
        """A pass that ends inside q's prompt on a snapshot boundary (a block's end, or its
        state point): its state saved there (pools that keep snapshots)."""
        b = q.prefilled
        if self._saves_states and b < len(q.prompt) and (b % self.pool.boundary == 0 or b in self._state_points(q)):
            slot = self.pool.snapshot_slot()
            if slot is not None:
                q.snaps[b] = slot
                d.save.append((row, slot))

    def _prefill_blocks(self, d: Decisions) -> tuple[list[list[tuple[int, int]]], list[int]]:
        """The next block of every prompt being prefilled, in passes of at most pass_rows
        rows -> (the passes, each pass's block width). Blocks where the prompt ends within
        `narrow_block` tokens pass apart from the others (the narrower program), rows with
        prompt logprobs alone. A lone prompt (the only one with a full block to pass, no row
        decoding) takes `wide_block` tokens a pass while at least half of that is left:
        nothing waits behind its passes but the requests that will share its prefix, so it
        gets to its first token in fewer engine iterations."""
        longer, short, alone = [], [], []
        for r in self.prefilling:
            q = self.rows[r]
            if q.prompt_logprobs:
                alone.append([(r, q.prefilled)])
            else:
                (short if self.short_block(q, q.prefilled) else longer).append((r, q.prefilled))
        wide = (self.wide_block and len(longer) == 1 and not self.running
                and len(self.rows[longer[0][0]].prompt) - longer[0][1] >= self.wide_block // 2)
        P, C = self.pass_rows, self.prefill_chunk
        passes = [(g[i:i + P], w) for g, w in ((longer, self.wide_block if wide else C), (short, self.narrow_block))
                  for i in range(0, len(g), P)] + [(g, C) for g in alone]
        for blocks, width in passes:
            for r, _ in blocks:
                self._advance(r, self.rows[r], d, width)
        return [g for g, _ in passes], [w for _, w in passes]

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
