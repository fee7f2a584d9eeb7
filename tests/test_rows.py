"""Requests joining and leaving a running batch (`jspec.loop.rows`: admit, evict).

- A request admitted into a running batch produces exactly the tokens it produces alone
  (greedy, and sampled with the same seed), for every proposer, dense and paged: the
  batch runs, requests are admitted into free rows between chunks of rounds, finished
  rows are evicted and reused; every request's tokens equal its run alone in an empty
  batch, in another row.
- admit and evict leave every other row bit for bit as it was (state rows, cache slots
  and pages, proposer state).
- After 1,000 admit/evict cycles (some running rounds in between) every page is back in
  the pool.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import jspec
from conftest import CACHES
from jspec import requests as rq
from jspec.loop import programs
from jspec.loop.plan import make_plan
from jspec.loop.state import unpack_window

B = 4
MAX_NEW = 14
PROMPTS = [[5, 7, 9, 11, 13, 5, 7], [20, 21, 22], list(range(30, 45)), [8, 9, 8, 9, 8], [40, 41], [3, 100, 7, 3]]


class Batch:
    """A running batch driven the way a serving engine drives it: requests admitted into
    rows between chunks of rounds, rows evicted once read."""

    def __init__(self, params, cache, spec=None, samples=False):
        self.params, self.cache = params, cache
        reqs = rq.check_requests(params, PROMPTS, MAX_NEW, [], {"temperature": 0.7 if samples else 0.0})
        self.plan = make_plan(params, reqs.lens, reqs.max_new, 0, samples, cache, rq.spec_config(params, spec))
        self.weights = (params.weights, params.draft.weights if params.draft is not None else None)

    def fresh(self):
        return programs.init_jit(self.plan)

    def admit(self, st, row: int, i: int, **sampling):
        """Request i (PROMPTS[i]) into `row`."""
        reqs = rq.check_requests(self.params, [PROMPTS[i]], MAX_NEW, [], sampling)
        rows, adm = rq.pack(self.plan, reqs, self.cache)
        rows[0] = row
        return programs.admit_jit(self.plan, *self.weights, st, rows, adm)

    def advance(self, st, rounds: int):
        return programs.advance_jit(self.plan, *self.weights, st, st.step + rounds)

    def evict(self, st, row: int):
        return programs.evict_jit(self.plan, *self.weights, st, np.array([row], np.int32))

    def output(self, back, row: int, i: int):
        back = jax.device_get(back)
        n = len(PROMPTS[i])
        assert back["finished"][row]
        return back["tokens"][row, n: n + back["generated"][row]].tolist()

    def alone(self, i: int, row: int, **sampling):
        st, back = self.admit(self.fresh(), row, i, **sampling)
        st, back = self.advance(st, MAX_NEW)
        return self.output(back, row, i)


def run_interleaved(b: Batch, seeds=None):
    """Requests 0..5 through B = 4 rows: 0, 1, 2 start; 3 joins after 2 rounds; each
    finished row is read, evicted and given the next waiting request -> {request: tokens}."""
    def sampling(i):
        return {} if seeds is None else {"temperature": 0.7, "seed": seeds[i]}
    st = b.fresh()
    for row, i in enumerate((0, 1, 2)):
        st, back = b.admit(st, row, i, **sampling(i))
    st, back = b.advance(st, 2)
    st, back = b.admit(st, 3, 3, **sampling(3))
    holder, waiting, outputs = {0: 0, 1: 1, 2: 2, 3: 3}, [4, 5], {}
    while holder:
        st, back = b.advance(st, 1)
        done = jax.device_get(back["finished"])
        for row in [r for r in holder if done[r]]:
            i = holder.pop(row)
            outputs[i] = b.output(back, row, i)
            st = b.evict(st, row)
            if waiting:
                j = waiting.pop(0)
                st, _ = b.admit(st, row, j, **sampling(j))  # its readback: the admitted rows' first tokens only
                holder[row] = j
    return outputs


CASES = [("plain", "dense"), ("eagle3", "paged16"), ("ngram", "dense"),
         pytest.param("eagle", "paged1", marks=pytest.mark.slow), pytest.param("standalone", "dense",
                                                                                marks=pytest.mark.slow),
         pytest.param("eagle3", "dense", marks=pytest.mark.slow), pytest.param("ngram", "paged16",
                                                                               marks=pytest.mark.slow)]


def _params(target, with_draft, kind):
    if kind == "plain":
        return target
    if kind == "ngram":
        return target.with_draft(jspec.NgramDraft(min_n=1, max_n=3))
    return with_draft(kind)


@pytest.mark.parametrize("kind,cache", CASES)
def test_admitted_request_equals_alone(target, with_draft, kind, cache):
    b = Batch(_params(target, with_draft, kind), CACHES[cache])
    together = run_interleaved(b)
    for i in range(len(PROMPTS)):
        assert together[i] == b.alone(i, row=(i + 1) % B), i
        assert len(together[i]) == MAX_NEW


@pytest.mark.parametrize("kind,cache", [("eagle3", "dense"), pytest.param("ngram", "paged16", marks=pytest.mark.slow)])
def test_sampled_request_equals_alone(target, with_draft, kind, cache):
    b = Batch(_params(target, with_draft, kind), CACHES[cache], samples=True)
    seeds = [11, 12, 13, 14, 15, 16]
    together = run_interleaved(b, seeds)
    for i in range(len(PROMPTS)):
        assert together[i] == b.alone(i, row=(i + 2) % B, temperature=0.7, seed=seeds[i]), i


def _rows_of(st, plan, rows):
    """The parts of a state that belong to `rows`: every [B, ...] leaf's rows, each dense
    cache row's slots (the trash slot aside), and for a paged pool the pages those rows
    hold -> a list of numpy arrays."""
    B = plan.batch
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(st):
        a = np.asarray(leaf)
        name = jax.tree_util.keystr(path)
        if "cache" in name or ".kv" in name:
            if plan.layout.paged:  # [num_pages + 1, P, ...]: the rows' pages
                table = np.asarray(st.pages.page_table)[rows]
                pages = np.unique(table[table < plan.layout.num_pages])
                out.append(a[pages])
            else:  # [B, C + 1, ...]
                out.append(a[rows, : plan.layout.capacity])
        elif "pages" in name:  # the rows' page-table rows and page counts (the free stack is shared)
            if "page_table" in name or "num_alloc" in name:
                out.append(a[rows])
        elif a.ndim and a.shape[0] == B:
            out.append(a[rows])
    return out


@pytest.mark.parametrize("cache", ["dense", "paged16"])
def test_admit_and_evict_leave_other_rows_alone(target, with_draft, cache):
    """Rows 0, 1 and 3 run; row 2 is admitted, later evicted: every part of rows 0, 1, 3
    (their state rows, cache slots, pages and page-table rows, the draft's cache and
    first level) is bit for bit what it was."""
    b = Batch(with_draft("eagle3"), CACHES[cache])
    st = b.fresh()
    for row, i in ((0, 0), (1, 1), (3, 2)):
        st, _ = b.admit(st, row, i)
    st, _ = b.advance(st, 2)
    others = [0, 1, 3]
    before = _rows_of(st, b.plan, others)
    st, _ = b.admit(st, 2, 3)
    after = _rows_of(st, b.plan, others)
    assert len(before) == len(after) > 10
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)
    st = b.evict(st, 2)
    for x, y in zip(before, _rows_of(st, b.plan, others)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("cache", ["paged1", "paged16"])
def test_chunk_of_fixed_rounds_equals_rounds_until_done(target, with_draft, cache):
    """`programs.chunk` (a static number of rounds, the pages of all of them reserved
    before the loop) leaves what rounds to the end leave: chunks of 3 rounds against
    `advance` 3 rounds at a time, rows of unequal prompts finishing mid-chunk (the room
    reserved ahead is capped at a row's slot limit: none ends cache_full), same tokens,
    lengths, finish reasons; every page returns once the rows are evicted. A chunk's window
    readback holds exactly the tokens its rounds emitted."""
    b = Batch(with_draft("eagle3"), CACHES[cache])
    states = []
    for step in (lambda st: b.advance(st, 3), lambda st: programs.chunk_jit(3)(b.plan, *b.weights, st)):
        st = b.fresh()
        for row, i in ((0, 0), (1, 2), (2, 4), (3, 5)):
            st, _ = b.admit(st, row, i)
        backs = []
        while True:
            before = np.asarray(st.generated)
            st, back = step(st)
            backs.append(jax.device_get({k: getattr(st, k) for k in ("tokens", "generated", "finished", "reason")}))
            if "ints" in back:  # the chunk's window: from each row's first new position
                window = unpack_window(jax.device_get(back))
                for row, i in ((0, 0), (1, 2), (2, 4), (3, 5)):
                    n, g = len(PROMPTS[i]), int(window["generated"][row])
                    assert int(window["tokens_from"][row]) == n + before[row]
                    np.testing.assert_array_equal(window["tokens"][row, :g - before[row]],
                                                  backs[-1]["tokens"][row, n + before[row]: n + g])
            if backs[-1]["finished"].all():
                break
        states.append(backs)
        for row in range(4):
            st = b.evict(st, row)
        assert int(st.pages.num_free) == b.plan.layout.num_pages
    assert len(states[0]) == len(states[1]) > 2
    for x, y in zip(*states):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert (states[1][-1]["generated"][:4] == MAX_NEW).all()


def test_thousand_admit_evict_cycles_return_every_page(target):
    """Paged pool, plain and n-gram rows: 1,000 single-row admissions of random prompts,
    every tenth followed by a few rounds, each evicted (some mid-generation, some
    finished) -> the free stack holds every page exactly once, and while rows run the
    pool's count matches the pages they hold."""
    params = target.with_draft(jspec.NgramDraft())
    cache = jspec.CacheConfig("paged", page_size=4)
    b = Batch(params, cache)
    plan = b.plan
    admit = jax.jit(lambda st, rows, adm: programs.admit_fn(plan, *b.weights, st, rows, adm)[0], donate_argnums=0)
    evict = jax.jit(lambda st, rows: programs.evict_fn(plan, *b.weights, st, rows), donate_argnums=0)
    rng = np.random.RandomState(0)
    st = b.fresh()
    for cycle in range(1000):
        row = cycle % B
        prompt = rng.randint(3, 200, size=rng.randint(1, 16)).tolist()
        reqs = rq.check_requests(params, [prompt], int(rng.randint(1, MAX_NEW + 1)), [], {})
        rows, adm = rq.pack(plan, reqs, cache)
        one = jax.tree.map(lambda a: a[:1], adm)
        st = admit(st, np.array([row], np.int32), one)
        if cycle % 10 == 9:
            st, _ = b.advance(st, 3)
            held = np.asarray(st.pages.num_alloc).sum()
            assert int(st.pages.num_free) + held == plan.layout.num_pages
        if cycle % 3:  # the rest stay until their row is reused (admit returns a row's old pages)
            st = evict(st, np.array([row], np.int32))
    st = evict(st, np.arange(B, dtype=np.int32))
    pages = st.pages
    assert int(pages.num_free) == plan.layout.num_pages
    assert sorted(np.asarray(pages.free).tolist()) == list(range(plan.layout.num_pages))
    assert (np.asarray(pages.page_table) == plan.layout.num_pages).all() and not np.asarray(pages.num_alloc).any()


@pytest.mark.slow
def test_mtp_request_admitted_equals_alone(tmp_path_factory):
    """A DeepSeek-V3 target drafting with its own MTP layer (its latent caches, MLA and
    MoE), dense: admitted requests emit what they emit alone (paged rows: the tests above,
    whose row-to-page mapping the latent cache shares)."""
    cache = "dense"
    from test_mtp import mtp_checkpoint
    path = str(tmp_path_factory.mktemp("rows_mtp"))
    mtp_checkpoint(path)
    b = Batch(jspec.load(path, dtype="float32", draft="mtp"), CACHES[cache], spec=jspec.SpecConfig(num_steps=2))
    together = run_interleaved(b)
    for i in range(len(PROMPTS)):
        assert together[i] == b.alone(i, row=(i + 1) % B), i



def test_hybrid_request_admitted_equals_alone(tmp_path_factory):
    """A Qwen3.5 target (per-row conv and delta-rule states beside paged KV) drafting a tree
    with its own MTP layer: a request admitted into a reused row starts from zero states and
    emits what it emits alone; the other rows' states are untouched by the admission."""
    from test_qwen3_next import make_hybrid
    path = str(tmp_path_factory.mktemp("rows_hybrid"))
    make_hybrid(path, "qwen3_5")
    b = Batch(jspec.load(path, dtype="float32", draft="mtp"), CACHES["paged16"],
              spec=jspec.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4))
    together = run_interleaved(b)
    for i in range(len(PROMPTS)):
        assert together[i] == b.alone(i, row=(i + 1) % B), i
    st = b.advance(b.admit(b.admit(b.fresh(), 0, 0)[0], 1, 1)[0], 2)[0]
    before = [np.asarray(a) for a in st.tcache.ssm + st.tcache.conv]  # (admit donates its state)
    after = b.admit(st, 2, 2)[0]
    for old, new in zip(before, after.tcache.ssm + after.tcache.conv):
        np.testing.assert_array_equal(old[[0, 1, 3]], np.asarray(new)[[0, 1, 3]])
        assert np.abs(np.asarray(new)[2]).max() > 0


def _row_slots(st, plan, row: int, n: int):
    """Every cache buffer's entries at slots 0..n-1 of `row` (gathered through the page
    table) -> a list of numpy arrays."""
    table = np.asarray(st.pages.page_table)[row]
    P = plan.layout.page_size
    slots = np.arange(n)
    flat = table[slots // P] * P + slots % P
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path((st.tcache, st.proposal.cache)):
        a = np.asarray(leaf)
        out.append(a.reshape((-1,) + a.shape[2:])[flat])
    return out


@pytest.mark.parametrize("cache", ["paged1", "paged16"])
def test_prompt_in_blocks_fills_caches_as_a_whole_prefill(target, with_draft, cache):
    """A 15-token prompt admitted with prefill_chunk=4 (a first block, then three more
    passes that attend to the earlier blocks in the cache) leaves the target's and the
    draft's caches at its slots, its first token, root, L and the draft's kept hidden (its
    head gives the first level) as a whole-prompt admission does (float32; the other
    rows' parts bit for bit alone); the row waits, parked, until its last block."""
    params = with_draft("eagle3")
    whole = Batch(params, CACHES[cache])
    blocks = Batch(params, CACHES[cache])
    blocks.plan = dataclasses.replace(blocks.plan, prefill_chunk=4)
    i, row = 2, 1  # PROMPTS[2]: 15 tokens
    st_w = whole.fresh()
    st_b = blocks.fresh()
    for b, st in ((whole, st_w), (blocks, st_b)):  # another row runs meanwhile
        st, _ = b.admit(st, 0, 0)
        st, _ = b.advance(st, 2)
        if b is whole:
            st_w, _ = b.admit(st, row, i)
        else:
            st_b = st
    others = _rows_of(st_b, blocks.plan, [0])
    st_b, back = blocks.admit(st_b, row, i)
    for start in (4, 8, 12):
        back = unpack_window(jax.device_get(back))
        assert bool(back["finished"][row]) and int(back["generated"][row]) == 0  # parked
        st_b, back = programs.prefill_jit(blocks.plan, *blocks.weights, st_b, np.array([row, B], np.int32),
                                          np.array([start, 0], np.int32))
    back = unpack_window(jax.device_get(back))
    assert not bool(back["finished"][row]) and int(back["generated"][row]) == 1
    for x, y in zip(others, _rows_of(st_b, blocks.plan, [0])):
        np.testing.assert_array_equal(x, y)
    n = len(PROMPTS[i])
    for x, y in zip(_row_slots(st_w, whole.plan, row, n), _row_slots(st_b, blocks.plan, row, n)):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5)
    for name in ("root", "L", "generated"):
        assert int(getattr(st_w, name)[row]) == int(getattr(st_b, name)[row]), name
    np.testing.assert_array_equal(np.asarray(st_w.tokens[row]), np.asarray(st_b.tokens[row]))
    np.testing.assert_allclose(np.asarray(st_w.proposal.hidden[row]), np.asarray(st_b.proposal.hidden[row]),
                               rtol=2e-5, atol=2e-5)


def test_hybrid_prompt_in_blocks_as_the_engine_passes_it(tmp_path_factory):
    """A Qwen3.5 row's 15-token prompt passed as the engine passes it (prefill_chunk=4: the
    admission's first block, then `prefill` of that row alone, the pass's other entry no
    row) while another row runs: its conv and delta-rule states, first token and root
    equal a whole-prompt admission's, and the running row's states are untouched."""
    from test_qwen3_next import make_hybrid
    path = str(tmp_path_factory.mktemp("rows_hybrid_blocks"))
    make_hybrid(path, "qwen3_5")
    params = jspec.load(path, dtype="float32", draft="mtp")
    whole = Batch(params, CACHES["paged16"], spec=jspec.SpecConfig(num_steps=2))
    blocks = Batch(params, CACHES["paged16"], spec=jspec.SpecConfig(num_steps=2))
    blocks.plan = dataclasses.replace(blocks.plan, prefill_chunk=4)
    i, row = 2, 1  # PROMPTS[2]: 15 tokens
    states = []
    for b in (whole, blocks):
        st, _ = b.admit(b.fresh(), 0, 0)
        st, _ = b.advance(st, 2)
        running = [np.asarray(a)[0] for a in st.tcache.conv + st.tcache.ssm]
        st, _ = b.admit(st, row, i)
        for start in (4, 8, 12) if b is blocks else ():
            st, _ = programs.prefill_jit(b.plan, *b.weights, st, np.array([row, B], np.int32),
                                         np.array([start, 0], np.int32))
        for x, y in zip(running, st.tcache.conv + st.tcache.ssm):
            np.testing.assert_array_equal(x, np.asarray(y)[0])
        states.append(st)
    st_w, st_b = states
    for x, y in zip(st_w.tcache.conv + st_w.tcache.ssm, st_b.tcache.conv + st_b.tcache.ssm):
        np.testing.assert_allclose(np.asarray(x)[row], np.asarray(y)[row], rtol=1e-4, atol=1e-5)
    assert int(st_w.root[row]) == int(st_b.root[row]) and int(st_w.L[row]) == int(st_b.L[row])
