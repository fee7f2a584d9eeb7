"""The serving engine's scheduler (`jspec.serve.scheduler`), with no model and no device:
readbacks are made up as the runner would return them.

- Waiting requests take free rows first come first served, grouped by admission width;
  a request with prompt logprobs is admitted alone; long prompts get one block per call
  until they run.
- A chunk is dispatched when rows run and none is in flight, and a second one behind it
  only while nothing waits, no prompt is half prefilled and some row outlasts it.
- The device's finish ends a request, its row is evicted at the next call and taken by the
  next request in that call; host ends (cancel, stop string, timeout) drop what the device
  did since; a full queue raises QueueFull.
"""
from __future__ import annotations

import numpy as np
import pytest

from jspec import requests as rq
from jspec.serve.pages import PagePool
from jspec.serve.scheduler import DONE, PREFILLING, RUNNING, WAITING, QueueFull, Request, Scheduler


def request(prompt_len: int, max_new: int = 8, prompt_logprobs=None, arrival=0.0, deadline=None,
            speculative=True) -> Request:
    reqs = rq.Requests(prompts=[list(range(1, prompt_len + 1))], is_batch=False, max_new=[max_new],
                       sampling={k: [v] for k, v in {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                                      "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                                      "frequency_penalty": 0.0, "seed": 1}.items()},
                       stop_ids=[[2]], prompt_logprobs=[prompt_logprobs], speculative=[speculative])
    return Request(reqs, arrival=arrival, deadline=deadline)


def scheduler(batch=4, chunk=8, max_waiting=16):
    return Scheduler(batch, prefill_chunk=chunk, width_class=lambda n: 64 if n <= 64 else 128, rounds_per_chunk=2,
                     max_waiting=max_waiting)


def back(batch, rows: dict, finished=(), reasons=None, rounds=None):
    """A readback: rows {row: generated}, `finished` rows ended ('stop' unless reasons say)."""
    g = np.zeros(batch, np.int32)
    f = np.ones(batch, bool)
    r = np.zeros(batch, np.int32)
    for row, n in rows.items():
        g[row] = n
        f[row] = row in finished
        r[row] = (reasons or {}).get(row, 1) if row in finished else 0
    out = {"generated": g, "finished": f, "reason": r, "rounds": np.zeros(batch, np.int32),
           "rounds_from": np.zeros(batch, np.int32), "hist": np.zeros((batch, 0), np.int32)}
    if rounds is not None:
        out["rounds"] = np.array([len(rounds.get(i, [])) for i in range(batch)], np.int32)
        width = max((len(v) for v in rounds.values()), default=0)
        out["hist"] = np.array([list(rounds.get(i, [])) + [0] * (width - len(rounds.get(i, []))) for i in range(batch)],
                               np.int32)
    return out


def test_admission_order_groups_blocks_and_dispatch():
    s = scheduler()
    qs = [request(5), request(20), request(3, prompt_logprobs=1), request(100), request(4), request(6)]
    for q in qs:
        s.add(q)
    d = s.schedule(now=1.0)
    # Four rows, first come first served; widths 64 (5, 20) and 128 (100); the prompt-logprob one alone.
    admitted = {q_id: row for group in d.admit for row, q in group for q_id in [qs.index(q)]}
    assert admitted == {0: 0, 1: 1, 2: 2, 3: 3}
    groups = sorted(sorted(qs.index(q) for _, q in g) for g in d.admit)
    assert groups == [[0, 1], [2], [3]]
    assert [q.state for q in qs] == [RUNNING, PREFILLING, RUNNING, PREFILLING, WAITING, WAITING]
    assert qs[1].prefilled == 8 and qs[3].prefilled == 8 and qs[0].admitted_at == 1.0
    assert d.dispatch and sorted(d.running) == [0, 2] and not d.prefill
    # Next call: one more block of each long prompt; nothing is dispatched while a chunk is in flight
    # and prompts are half prefilled.
    d = s.schedule(now=2.0)
    assert d.prefill == [[(1, 8), (3, 8)]] and not d.dispatch and not d.admit
    d = s.schedule(now=3.0)
    assert d.prefill == [[(1, 16), (3, 16)]] and qs[1].state == RUNNING and qs[3].state == PREFILLING
    s.update(back(4, {0: 2, 2: 2}), {0: qs[0], 2: qs[2]}, chunk=True)
    d = s.schedule(now=4.0)
    assert d.dispatch and sorted(d.running) == [0, 1, 2]


def test_passes_take_at_most_pass_rows():
    """An admission and a prefill pass take at most `pass_rows` rows (the engine's
    max_batched_tokens over the block): five long prompts in groups of two, two, one."""
    s = Scheduler(8, prefill_chunk=8, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16, pass_rows=2)
    qs = [request(20) for _ in range(5)]
    for q in qs:
        s.add(q)
    d = s.schedule(0.0)
    assert sorted(len(g) for g in d.admit) == [1, 2, 2]
    assert sorted(r for g in d.admit for r, _ in g) == [0, 1, 2, 3, 4]
    d = s.schedule(1.0)
    assert [len(g) for g in d.prefill] == [2, 2, 1] and sorted(r for g in d.prefill for r, _ in g) == [0, 1, 2, 3, 4]


def test_short_last_blocks_pass_apart():
    """A block in which the prompt ends within `narrow_block` tokens passes apart from the
    full blocks (the narrower program): prompts of 12 and 20 in blocks of 8, narrow 4."""
    s = Scheduler(4, prefill_chunk=8, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16, narrow_block=4)
    a, b = request(12), request(20)
    s.add(a)
    s.add(b)
    s.schedule(0.0)
    d = s.schedule(1.0)
    assert d.prefill == [[(1, 8)], [(0, 8)]]  # b's full block, a's last 4 tokens
    assert s.short_block(a, 8) and not s.short_block(b, 8) and s.short_block(b, 16)


def test_a_pass_that_stops_soon_takes_the_narrow_block():
    """Where a hybrid's pool aligns passes to blocks (states saved at their ends), a pass
    from slot 12 of a 40-token prompt stops at 16, 4 tokens on: it is a short block (the
    narrower program, 8) though the prompt goes on; from slot 4 it takes 12, a full block.
    Without a pool that keeps snapshots the pass from 12 runs a whole block (to 28)."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731
    hybrid = Scheduler(2, prefill_chunk=16, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16,
                       pool=PagePool(60, 4, snapshots=8, boundary=16), pages_at=pages_at, chunk_slots=2,
                       narrow_block=8)
    plain = Scheduler(2, prefill_chunk=16, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16,
                      narrow_block=8)
    q = request(40)
    assert hybrid.short_block(q, 12) and not hybrid.short_block(q, 4) and hybrid.short_block(q, 32)
    assert not plain.short_block(q, 12) and plain.short_block(q, 32)


def test_a_lone_prompt_takes_wide_blocks():
    """A lone prompt (the only full block to pass, no row decoding) passes `wide_block`
    tokens while at least half of that is left, then blocks of C; with a row decoding, or
    two prompts to pass, blocks of C. Blocks of 8, wide 32, narrow 4: a prompt of 50
    passes 8 (its admission), 32, 8 (10 left: less than half of 32), 4 (narrow)."""
    s = Scheduler(4, prefill_chunk=8, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16, narrow_block=4,
                  wide_block=32)
    a = request(50, max_new=20)
    s.add(a)
    s.schedule(0.0)
    seen = []
    while a.state == PREFILLING:
        d = s.schedule(1.0)
        seen.append((d.prefill, d.widths))
    assert seen == [([[(0, 8)]], [32]), ([[(0, 40)]], [8]), ([[(0, 48)]], [4])]
    # a runs now: the next prompt's blocks are of 8 (its rows would wait behind a wide pass)
    b = request(60)
    s.add(b)
    s.schedule(2.0)
    s.update(back(4, {0: 2}), {0: a}, chunk=True)
    d = s.schedule(3.0)
    assert d.prefill == [[(1, 8)]] and d.widths == [8]
    # two prompts, nothing running: blocks of 8 for both
    s2 = Scheduler(4, prefill_chunk=8, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16, wide_block=32)
    for q in (request(60), request(60)):
        s2.add(q)
    s2.schedule(0.0)
    d = s2.schedule(1.0)
    assert d.prefill == [[(0, 8), (1, 8)]] and d.widths == [8]


def test_prompt_logprob_rows_prefill_alone():
    s = scheduler()
    a, b = request(20, prompt_logprobs=2), request(20)
    s.add(a)
    s.add(b)
    d = s.schedule(0.0)
    assert sorted(len(g) for g in d.admit) == [1, 1]
    d = s.schedule(0.0)
    assert sorted(d.prefill) == sorted([[(1, 8)], [(0, 8)]])


def test_finish_evicts_and_frees_the_row_for_the_next():
    s = scheduler(batch=2)
    qs = [request(4, max_new=20) for _ in range(3)]
    for q in qs:
        s.add(q)
    d = s.schedule(0.0)
    assert d.dispatch and s.inflight == 1
    # Nothing waits for... request 2 waits: no second chunk behind the first.
    assert not s.schedule(0.0).dispatch
    progress = s.update(back(2, {0: 5, 1: 3}, finished={0}), d.running, chunk=True)
    assert [(p.row, p.before, p.now, p.finish) for p in progress] == [(0, 0, 5, "stop"), (1, 0, 3, None)]
    assert qs[0].state == DONE and s.inflight == 0
    d = s.schedule(1.0)
    assert [r for r, _ in d.evict] == [0] and d.admit == [[(0, qs[2])]] and d.dispatch
    # A readback that still names the old request for row 0 changes nothing of it.
    assert [p.request for p in s.update(back(2, {0: 9, 1: 4}), {0: qs[0], 1: qs[1]}, chunk=True)] == [qs[1]]
    assert qs[0].generated == 5


def test_second_chunk_only_while_nothing_waits():
    s = scheduler(batch=2)
    q = request(4, max_new=3)
    s.add(q)
    assert s.schedule(0.0).dispatch
    s.update(back(2, {0: 1}), {0: q}, chunk=False)  # the admission's first token
    # max_new 3: after the chunk in flight (2 rounds, >= 2 tokens) it may be done: no chunk behind it.
    assert not s.schedule(0.0).dispatch
    long = request(4, max_new=50)
    s2 = scheduler(batch=2)
    s2.add(long)
    s2.schedule(0.0)
    s2.update(back(2, {0: 1}), {0: long}, chunk=False)
    d = s2.schedule(0.0)
    assert d.dispatch and s2.inflight == 2  # nothing waits: a second chunk behind the first
    assert not s2.schedule(0.0).dispatch  # never a third


def test_host_ends_timeouts_and_queue_full():
    s = scheduler(batch=1, max_waiting=2)
    a, b = request(4, max_new=20), request(4, deadline=5.0)
    s.add(a)
    s.add(b)
    with pytest.raises(QueueFull, match="max_waiting=2"):
        s.add(request(4))
    d = s.schedule(0.0)
    assert d.admit == [[(0, a)]]
    assert s.end(a, "cancelled") and not s.end(a, "cancelled")
    assert s.update(back(1, {0: 7}), d.running, chunk=True) == []  # dropped: ended on the host
    d = s.schedule(10.0)  # b's deadline passed while it waited
    assert [r for r, _ in d.evict] == [0] and d.ended == [b] and b.finish == "timeout" and not d.admit
    c = request(4, deadline=20.0)
    s.add(c)
    s.schedule(11.0)
    d = s.schedule(30.0)
    assert c.finish == "timeout" and [q for _, q in d.evict] == [c]
    assert not s.has_work or s.inflight


class RecordingChooser:
    """Always tier 1; records what `observe` and `choose` are given."""

    def __init__(self):
        self.seen, self.got = [], []

    def choose(self, current, running):
        self.got.append([(q.row, [(t, list(lens)) for t, lens in q.accepts]) for q in running])
        return 1

    def observe(self, tier, lens):
        self.seen.append((tier, list(lens)))


def chunk_on_two_rows():
    """A scheduler of 2 rows with a RecordingChooser, a speculating request and one with
    speculation off admitted, and one chunk of 2 rounds on tier 1 read back."""
    s = scheduler(batch=2)
    s.chooser = RecordingChooser()
    a, b = request(4, max_new=30), request(4, max_new=30, speculative=False)
    s.add(a)
    s.add(b)
    d = s.schedule(0.0)
    s.update(back(2, {0: 6, 1: 3}, rounds={0: [3, 2], 1: [1, 1]}), d.running, chunk=True, tier=1)
    return s, a, b, d


def test_chooser_sees_speculating_rows_accept_lengths():
    s, a, b, d = chunk_on_two_rows()
    assert d.tier == 1
    assert s.chooser.seen == [(1, [3, 2])] and a.rounds == 2 and b.rounds == 2


def test_chooser_gets_the_running_requests_and_their_own_accept_lengths():
    s, a, b, d = chunk_on_two_rows()
    s.schedule(1.0)
    # rows with speculation off: none
    assert s.chooser.got == [[(0, []), (1, [])], [(0, [(1, [3, 2])]), (1, [])]]
    s.pinned = 0  # a pinned tier: nothing is kept for a choice that is not made
    d = s.schedule(2.0)
    s.update(back(2, {0: 8, 1: 5}, rounds={0: [3, 2, 1, 1], 1: [1, 1, 1, 1]}), d.running, chunk=True, tier=0)
    assert len(a.accepts) == 1


def test_admission_by_pages():
    """With a page pool, a request is admitted only while the pages it may hold fit beside
    those of every request in a row; the head of the queue waits for pages and keeps the
    rest waiting (first come, first served); eviction returns a request's pages."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731 (pages of 4 tokens)
    s = Scheduler(4, prefill_chunk=0, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16,
                  pool=PagePool(10, 4, prefix_caching=False), pages_at=pages_at)
    qs = [request(8, 8), request(12, 8), request(4, 4), request(4, 4)]  # 4, 5, 2, 2 pages
    for q in qs:
        s.add(q)
    d = s.schedule(now=0.0)
    # 4 + 5 fit (9 of 10); the third (2 pages) waits though a row is free, and so does the fourth.
    assert [q.state for q in qs] == [RUNNING, RUNNING, WAITING, WAITING] and s.pages_free == 1
    assert [len(q.pages) for q in qs] == [4, 5, 0, 0] and d.dispatch
    assert sorted(d.pages) == sorted((q.row, j, p) for q in qs[:2] for j, p in enumerate(q.pages))
    assert len({p for q in qs for p in q.pages}) == 9  # no page in two rows
    s.update(back(4, {0: 8, 1: 3}, finished=[0]), {0: qs[0], 1: qs[1]}, chunk=True)
    d = s.schedule(now=1.0)  # the first evicted: its 4 pages take both waiting requests
    assert d.evict == [(0, qs[0])] and [q.state for q in qs[2:]] == [RUNNING, RUNNING]
    assert s.pages_free == 10 - 5 - 2 - 2


def test_page_accounting_conserves_pages():
    """10,000 random operations (submissions, readbacks that finish rows, host ends): the
    pages held by the requests in rows never exceed the pool and no page is in two rows,
    every request in a row holds exactly the pages of its whole limit, the free count is
    the pool less theirs, and every request is served whole in the end."""
    rng = np.random.default_rng(0)
    pool, B = 40, 6
    pages_of = lambda q: -(-(len(q.prompt) + q.max_new) // 8)  # noqa: E731
    s = Scheduler(B, prefill_chunk=0, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=10_000,
                  pool=PagePool(pool, 8, prefix_caching=False), pages_at=lambda q, slots: pages_of(q))
    submitted, finished = [], []
    for step in range(10_000):
        op = rng.random()
        if op < 0.3 and len(s.waiting) < 50:
            q = request(int(rng.integers(1, 120)), int(rng.integers(1, 100)))
            s.add(q)
            submitted.append(q)
        elif op < 0.35 and s.rows:
            q = list(s.rows.values())[int(rng.integers(len(s.rows)))]
            s.end(q, "cancelled")
        d = s.schedule(now=float(step))
        finished += [q for _, q in d.evict] + d.ended
        held = [q for q in s.rows.values()]
        pages = [p for q in held for p in q.pages]
        assert len(pages) == len(set(pages)) <= pool
        assert all(len(q.pages) == pages_of(q) for q in held)
        assert s.pages_free == s.pool.available == pool - len(pages)
        if d.dispatch:
            done = [r for r in d.running if rng.random() < 0.3]
            gen = {r: q.max_new if r in done else min(q.generated + 1, q.max_new - 1) for r, q in d.running.items()}
            s.update(back(B, gen, finished=done), dict(d.running), chunk=True)
    while s.has_work:  # drain: every row finishes
        d = s.schedule(now=1e9)
        finished += [q for _, q in d.evict] + d.ended
        if d.dispatch:
            s.update(back(B, {r: q.max_new for r in d.running for q in [d.running[r]]}, finished=list(d.running)),
                     dict(d.running), chunk=True)
    assert len(finished) == len(submitted) and {id(q) for q in finished} == {id(q) for q in submitted}
    assert s.pages_free == pool


def test_preemption_order_and_resume():
    """Admission by the pages held now (prompt, a first token and a chunk's growth); when
    the rows' growth no longer fits, no chunk goes ahead of the one in flight, and with
    none in flight the latest admitted requests are preempted: their rows evicted, each
    back at the front of the queue with its output appended to its prompt (`resumed`),
    max_new and min_tokens less what it generated."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731 (pages of 4)
    s = Scheduler(3, prefill_chunk=0, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16,
                  pool=PagePool(9, 4, prefix_caching=False), pages_at=pages_at, preempting=True, chunk_slots=2)
    qs = [request(4, 12), request(4, 12), request(4, 12), request(4, 12)]
    for q in qs:
        s.add(q)
    d = s.schedule(now=0.0)  # each needs 4 + 1 + 2 = 7 slots, 2 pages: three fit, the fourth waits (a row short)
    assert [q.state for q in qs] == [RUNNING, RUNNING, RUNNING, WAITING] and d.dispatch
    assert s.pages_free == 9 - 3 * 2
    for q in qs[:3]:
        q.output = [7, 8, 9, 10]
    s.update(back(3, {0: 4, 1: 4, 2: 4}), dict(d.running), chunk=True)  # 8 slots each, 2 chunks ahead: 3 pages
    d = s.schedule(now=1.0)
    assert not d.preempt and d.dispatch  # 4 + 4 + 2 = 10 slots: 3 pages each, 9 in all
    s.update(back(3, {0: 6, 1: 6, 2: 6}), dict(d.running), chunk=True)
    for q in qs[:3]:
        q.output = [7, 8, 9, 10, 11, 12]
    d = s.schedule(now=2.0)  # 4 + 6 + 2 = 12 slots: 3 pages each... and the latest must go when short
    assert not d.preempt
    s.inflight = 1  # a chunk in flight and the rows short: nothing queued ahead of it
    for q in qs[:3]:
        q.generated = 8
    assert s.pages_free < 0 and not s.schedule(now=3.0).dispatch
    s.inflight = 0
    d = s.schedule(now=4.0)  # none in flight: the latest admitted (row 2) is preempted
    assert [(r, q) for r, q in d.preempt] == [(2, qs[2])] and d.dispatch and sorted(d.running) == [0, 1]
    q = qs[2]
    assert q.state == WAITING and s.waiting[0] is q and q.preemptions == 1
    assert q.prompt == [1, 2, 3, 4, 7, 8, 9, 10, 11, 12] and q.max_new == 12 - 6 and q.reqs.resumed == [6]
    assert q.generated == 0 and q.row is None and s.pages_free >= 0


def test_prefix_cache_hits_share_pages():
    """Pages of 4, blocks of 8: a request's full prompt pages are cached once their pass is
    dispatched (an admission's at once, a later block's at the next call); a request whose
    prompt begins with them shares those pages (the same page ids in its row's first
    columns), is admitted with no pass (`Decisions.cached`) and gets its first block from
    the slot past them in the same call; a request that would find a block more once a
    row's passes are cached waits for them; pages shared count once against the pool; an
    evicted row's output pages are cached too, short of `cache_margin`."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731
    pool = PagePool(40, 4)
    s = Scheduler(3, prefill_chunk=8, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16, pool=pool,
                  pages_at=pages_at, preempting=True, chunk_slots=2, cache_margin=1)
    a = request(20, 8)  # tokens 1..20: its first block (8 tokens) is in its admission
    b = request(20, 8)  # the same prompt (a second sample, say)
    s.add(a)
    s.add(b)
    d = s.schedule(now=0.0)
    assert [len(g) for g in d.admit] == [1] and d.admit[0][0][1] is a and not d.cached
    # b finds a's pages 0-1 (slots 0-7, cached with a's admission) and waits for a's next block
    assert b.state == WAITING and pool.query_tokens == 20 and pool.hit_tokens == 0
    d = s.schedule(now=1.0)  # a's block 8-15
    assert b.state == WAITING and d.prefill == [[(0, 8)]]
    d = s.schedule(now=2.0)  # a's last block (16-19); its pages 2-3 cached: b finds 16 tokens, all it can
    assert d.cached == [[(1, b)]] and b.cached == 4 and b.pages[:4] == a.pages[:4]
    assert d.prefill == [[(0, 16), (1, 16)]] and b.prefilled == 20 and b.state == a.state == RUNNING
    assert {(1, j, a.pages[j]) for j in range(4)} <= set(d.pages)
    assert pool.query_tokens == 40 and pool.hit_tokens == 16
    held = {p for q in (a, b) for p in q.pages}
    assert pool.available == 40 - len(held) and len(held) == len(a.pages) + len(b.pages) - 4
    # a third with a new ending after 12 of a's tokens: 2 pages (page 8-11's key holds token 12, a's 13)
    c = request(20, 8)
    c.prompt = c.prompt[:12] + [99] * 8
    s.add(c)
    d = s.schedule(now=3.0)
    assert d.cached == [[(2, c)]] and c.cached == 2 and c.pages[:2] == a.pages[:2] and d.prefill == [[(2, 8)]]
    # a finishes after 6 tokens (prompt 20 + 6: 25 slots known, 24 less the margin): pages 0-5
    a.output = [50, 51, 52, 53, 54, 55]
    s.update(back(3, {0: 6}, finished=[0]), {0: a}, chunk=False)
    pages, tokens = list(a.pages), a.tokens
    s.schedule(now=4.0)
    assert a.pages == []
    assert pool.lookup(tokens + [99], len(tokens))[0] == pages[:6]  # a second turn finds 6 pages


def test_snapshots_of_a_cached_admission_attach_where_they_were_saved():
    """A hybrid's pool (snapshots at every block of 8, pages of 4): a request admitted past
    a cached prefix (8 tokens with a state, 12 cached) saves its states where the cached
    prefix ends (its first pass stops there) and at the ends of its later blocks (the next
    pass stops at 16), and each attaches to the page that ends there (its pages counted
    from the first past the prefix), so that its own prompt looked up again finds the
    state saved at its deepest boundary."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731
    pool = PagePool(60, 4, snapshots=8, boundary=8)
    s = Scheduler(2, prefill_chunk=8, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16, pool=pool,
                  pages_at=pages_at, chunk_slots=2)
    a = request(30, 4)
    s.add(a)
    for t in range(6):
        s.schedule(now=float(t))  # a's blocks, its pages and states cached
    b = request(36, 4)
    b.prompt = a.prompt[:16] + [90 + i for i in range(20)]  # a's first 16 tokens, then its own
    s.add(b)
    saved = {}
    for t in range(6, 12):
        d = s.schedule(now=float(t))
        if t == 6:
            assert d.cached == [[(1, b)]] and b.cached == 2  # a's 8 tokens with a state (page 3's key holds token 16)
        saved.update({b.prefilled: slot for row, slot in d.save if row == 1})
    assert sorted(saved) == [12, 16, 24, 32]
    pages, _, slot = pool.lookup(b.prompt, len(b.prompt) - 1)  # a's pages while they match (b's copies stay its own)
    assert pages == a.pages[:3] + b.pages[3:8] and slot == saved[32]


def test_a_follower_waits_for_the_state_it_will_find():
    """A hybrid's pool (states saved at block ends, blocks of 8, pages of 4, keys without
    the next token): two requests of one 24-token prefix arrive at once; the second waits
    while the first's passes are yet to save and attach the state at a block deeper than
    it finds (its pages registered are not enough), and is admitted past all 24 tokens."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731
    pool = PagePool(60, 4, snapshots=8, boundary=8, next_token=False)
    s = Scheduler(2, prefill_chunk=8, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16, pool=pool,
                  pages_at=pages_at, chunk_slots=2)
    a, b = request(28, 4), request(28, 4)
    b.prompt = a.prompt[:24] + [90, 91, 92, 93]
    s.add(a)
    s.add(b)
    for t in range(3):  # a's blocks end at 8, 16, 24, each state saved there: b waits for each
        d = s.schedule(now=float(t))
        assert b.state == WAITING and d.save == [(0, a.snaps[8 * (t + 1)])], t
        assert pool.lookup(b.prompt, 27)[0] == a.pages[:2 * t]  # the states attached a call later
    d = s.schedule(now=3.0)  # the state at 24 attached: b finds all 24 shared tokens
    assert d.cached == [[(1, b)]] and b.cached == 6 and b.pages[:6] == a.pages[:6] and pool.hit_tokens == 24
    assert d.restore == [(1, pool.lookup(b.prompt, 27)[2])]


def test_a_pass_stops_at_the_prompts_last_page_boundary():
    """A hybrid's pool (blocks of 16, pages of 4): a 14-token prompt's admission pass stops
    at 12 (`Decisions.stops`), its last page boundary short of its last token, where its
    state is saved; a narrow pass in the same call takes the last 2 tokens
    (`Decisions.tails`), so it runs at once. A second request of the same prompt (`n`
    samples) waits for that state and is admitted past 12 tokens. A prompt whose logprobs
    are recorded is passed whole, and so is one whose last page boundary lies less than a
    narrow block (8) past a block's end: its state saved at the block's end, its last 6
    tokens pass in the same call (a tail)."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731

    def hybrid():
        pool = PagePool(60, 4, snapshots=8, boundary=16)
        return pool, Scheduler(2, prefill_chunk=16, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16,
                               pool=pool, pages_at=pages_at, chunk_slots=2, narrow_block=8)
    pool, s = hybrid()
    a, b = request(14, 4), request(14, 4)
    s.add(a)
    s.add(b)
    d = s.schedule(now=0.0)
    assert d.admit == [[(0, a)]] and d.stops == {0: 12} and b.state == WAITING
    assert d.save == [(0, a.snaps[12])] and d.tails == [[(0, 12)]] and a.state == RUNNING and d.dispatch
    d = s.schedule(now=1.0)
    assert d.cached == [[(1, b)]] and b.cached == 3 and b.pages[:3] == a.pages[:3] and pool.hit_tokens == 12
    assert d.restore == [(1, pool.lookup(b.prompt, 13)[2])] and d.prefill == [[(1, 12)]]
    assert d.stops == {1: 14} and b.state == RUNNING and not d.save and not d.tails
    _, s = hybrid()
    c, e = request(14, 4, prompt_logprobs=1), request(22, 4)  # e: its last page boundary 20, 4 past a block's end
    e.prompt = [50 + i for i in range(22)]  # nothing in common with c
    s.add(c)
    s.add(e)
    d = s.schedule(now=0.0)
    assert d.stops == {0: 14, 1: 16} and c.state == RUNNING and d.save == [(1, e.snaps[16])]
    assert d.tails == [[(1, 16)]] and e.state == RUNNING


def test_a_shared_prefix_past_the_last_state_is_saved_for_the_next_request():
    """A hybrid's pool (blocks of 16, pages of 4, keys with the next token): three requests
    of one 22-token prefix arrive together. The first is admitted and its states saved at
    16 (a block's end) and 28 (its last page boundary). The second waits for the state at
    16, then for the first's passes to register the pages they share (to 20: page 20-24's
    key holds token 24, not shared), and is admitted past 16 with 20 tokens cached: its
    first pass stops at 20, where its state is saved and attached to the first's page.
    The third waits for that state and finds all 20 (its own pass stops at 28, its last
    page boundary)."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731
    pool = PagePool(60, 4, snapshots=8, boundary=16)
    s = Scheduler(3, prefill_chunk=16, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16, pool=pool,
                  pages_at=pages_at, chunk_slots=2, narrow_block=4)
    a, b, c = request(30, 4), request(30, 4), request(30, 4)
    b.prompt, c.prompt = (a.prompt[:22] + [90 + i + k for i in range(8)] for k in (0, 10))
    for q in (a, b, c):
        s.add(q)
    name = {id(a): "a", id(b): "b", id(c): "c"}
    saved, admitted, running = [], {}, {}
    for t in range(6):
        d = s.schedule(now=float(t))
        saved += [(name[id(s.rows[r])], d.stops[r]) for r, _ in d.save]
        running.update({name[id(q)]: t for q in (a, b, c) if q.state == RUNNING and name[id(q)] not in running})
        admitted.update({name[id(q)]: (t, q.cached, d.stops[r]) for g in d.admit + d.cached for r, q in g})
    assert admitted == {"a": (0, 0, 16), "b": (2, 4, 20), "c": (3, 5, 28)}  # (call, pages found, first pass's end)
    assert b.shared == 20 and pool.hit_tokens == 16 + 20 and c.pages[:5] == a.pages[:5]
    assert [p for n, p in saved if n == "a"] == [16, 28] and ("b", 20) in saved
    assert running["a"] == 1  # its last 2 tokens passed in the call that saved its state at 28 (`tails`)


def test_a_row_with_its_last_block_in_the_call_is_not_preempted():
    """Preempting: a row whose last prompt block is queued in the call that finds the
    running rows short is not the one preempted (its block would run in a freed row)."""
    pages_at = lambda q, slots: -(-min(slots, len(q.prompt) + q.max_new) // 4)  # noqa: E731
    s = Scheduler(2, prefill_chunk=8, width_class=lambda n: 64, rounds_per_chunk=2, max_waiting=16,
                  pool=PagePool(12, 4, prefix_caching=False), pages_at=pages_at, preempting=True, chunk_slots=2)
    a, x = request(4, 40), request(24, 8)
    s.add(a)
    s.add(x)
    d = s.schedule(now=0.0)  # a runs (2 pages), x's first block (its 7 pages)
    assert d.dispatch and a.state == RUNNING and x.state == PREFILLING
    d = s.schedule(now=1.0)  # x's second block, the chunk in flight
    s.update(back(2, {0: 20}), {0: a}, chunk=True)  # a grew: 24 slots + a chunk ahead, 7 pages
    d = s.schedule(now=2.0)  # x's last block, and a's growth does not fit beside x's pages
    assert d.prefill == [[(1, 16)]] and x.state == RUNNING
    assert all(r != 1 for r, _ in d.preempt) and 1 in s.rows
    assert [q for _, q in d.preempt] == [a] and not d.dispatch or s.pages_free >= 0
