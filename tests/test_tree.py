"""Tree drafting (topk > 1) with KV compaction: exactness, tree building, compaction and
the cache invariant, with property tests against plain-Python references."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jspec
from jspec.cache import kv as kvc
from jspec.cache import layout as lay
from jspec.loading import load_draft
from jspec.models import family_for
from jspec.loop import accept
from jspec.loop.tree import Tree, ancestors, select_tree, vocab_top_k
from conftest import CACHES, PROMPTS, loop_state

# Tree shapes (S, K, N): the smallest, the default, a deep one and one of many nodes; each
# test gives two shapes to each of its (draft kind, cache) pairs, so every shape meets a
# neural tree twice.
SMALL, DEFAULT, DEEP, WIDE = (2, 2, 4), (3, 4, 8), (5, 4, 16), (6, 10, 60)


def _slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.mark.parametrize("kind,cache,shape", [("eagle3", "dense", DEFAULT), _slow("eagle3", "dense", WIDE),
                                              _slow("standalone", "paged1", SMALL),
                                              _slow("standalone", "paged1", DEEP)])
def test_tree_greedy_equals_target(with_draft, hf_greedy, kind, cache, shape):
    S, K, N = shape
    p = with_draft(kind)
    out = jspec.generate(p, PROMPTS, max_new_tokens=12, stop_token_ids=[], cache=CACHES[cache],
                         spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N))
    assert out.tokens == [hf_greedy(q, 12) for q in PROMPTS]


@pytest.mark.parametrize("kind,cache,shape", [("eagle", "paged1", DEFAULT), _slow("eagle", "paged1", DEEP),
                                              _slow("standalone", "paged16", SMALL),
                                              _slow("standalone", "paged16", WIDE)])
def test_tree_with_agreeing_draft_accepts_whole_depth(perm, kind, cache, shape):
    S, K, N = shape
    p = jspec.load(perm["target"], draft=perm[kind])
    prompts = [[5, 7, 9], [20, 21, 22, 23, 24, 25, 26]]
    out = jspec.generate(p, prompts, max_new_tokens=16, stop_token_ids=[], cache=CACHES[cache],
                         spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N))
    pi = perm["pi"]
    for q, toks in zip(prompts, out.tokens):
        want, t = [], q[-1]
        for _ in range(16):
            t = int(pi[t])
            want.append(t)
        assert toks == want
    assert all(a == S + 1 for row in out.stats.accept_lengths for a in row)


@pytest.mark.slow
def test_tree_reduced_vocab_draft_equals_target(with_draft, hf_greedy):
    """A tree from an EAGLE-3 head over a reduced draft vocabulary (candidates mapped to
    target ids through d2t) still decodes exactly the target's greedy output."""
    p = with_draft("eagle3_reduced")
    assert p.draft.config.draft_vocab_size < p.config.vocab_size and "d2t" in p.draft.weights
    out = jspec.generate(p, PROMPTS, max_new_tokens=12, stop_token_ids=[],
                         spec=jspec.SpecConfig(num_steps=3, topk=4, num_draft_tokens=8))
    assert out.tokens == [hf_greedy(q, 12) for q in PROMPTS]


def test_tree_reduced_vocab_candidates_are_target_ids(perm, tmp_path):
    """The agreeing EAGLE-3 head of the permutation family cut down to half the vocabulary
    (with d2t): a round from root r accepts its first draft exactly when pi(r) is in the
    draft vocabulary. A candidate left in draft ids (d2t not applied) would never match."""
    from jspec.export import save_draft
    pi = perm["pi"]
    V = len(pi)
    full = load_draft(perm["eagle3"], jspec.load(perm["target"]))
    ids = np.sort(np.random.RandomState(1).choice(V, V // 2, replace=False))
    w = jax.tree.map(np.array, full.weights)
    w["params"]["lm_head"]["kernel"] = w["params"]["lm_head"]["kernel"][:, ids]
    w["d2t"] = (ids - np.arange(len(ids))).astype(np.int32)
    save_draft(str(tmp_path / "d"), dataclasses.replace(full.config, draft_vocab_size=len(ids)), w, V)
    p = jspec.load(perm["target"], draft=str(tmp_path / "d"))
    assert p.draft.config.draft_vocab_size == V // 2
    prompts = [[5, 7, 9], [20, 21, 22, 23, 24, 25, 26]]
    out = jspec.generate(p, prompts, max_new_tokens=24, stop_token_ids=[],
                         spec=jspec.SpecConfig(num_steps=3, topk=4, num_draft_tokens=8))
    in_vocab = set(ids.tolist())
    seen = set()
    for q, toks, acc in zip(prompts, out.tokens, out.stats.accept_lengths):
        want, t = [], q[-1]
        for _ in range(24):
            t = int(pi[t])
            want.append(t)
        assert toks == want
        for r in range(len(acc)):
            root = toks[sum(acc[:r])]  # the bonus of the previous round (the prefill's token first)
            hit = int(pi[root]) in in_vocab
            seen.add(hit)
            assert (acc[r] >= 2) == hit, (r, root, acc)
    assert seen == {True, False}  # both cases occur


def test_tree_too_many_nodes_fails_early():
    with pytest.raises(ValueError, match="exceeds the 6 candidates"):
        jspec.SpecConfig(num_steps=2, topk=2, num_draft_tokens=8)
    assert jspec.SpecConfig(num_steps=2, topk=2, num_draft_tokens=7).max_candidates == 6
    assert jspec.SpecConfig(num_steps=5, topk=4).num_draft_tokens == 21  # default S*K+1
    assert jspec.SpecConfig(num_steps=1, topk=4).num_draft_tokens == 5  # capped: every candidate
    assert jspec.SpecConfig(num_steps=4).num_draft_tokens == 5  # a chain: S+1


# ------------------------------------------------------------------ cache invariant

@pytest.mark.parametrize("kind,shape,cache,prompts", [
    pytest.param("eagle3", (3, 4, 8), "dense", PROMPTS, marks=pytest.mark.slow),
    pytest.param("eagle3", (3, 4, 8), "paged1", PROMPTS, marks=pytest.mark.slow),
    pytest.param("eagle3", (3, 4, 8), "paged16", PROMPTS, marks=pytest.mark.slow),
    pytest.param("standalone", (5, 4, 16), "paged16", PROMPTS, marks=pytest.mark.slow),
    pytest.param("standalone", (3, 4, 8), "dense", PROMPTS[:1], marks=pytest.mark.slow)],  # one dense row: block writes, not scatters
    ids=["eagle3-3x4x8-dense", "eagle3-3x4x8-paged1", "eagle3-3x4x8-paged16", "standalone-5x4x16-paged16",
         "standalone-3x4x8-dense-one-row"])
def test_cache_holds_what_plain_decoding_writes(with_draft, kind, shape, cache, prompts):
    """After the loop, target cache slots [0, L) of every request equal a fresh prefill of
    its committed tokens, and every draft layer's keys and values equal a fresh draft
    prefill: an EAGLE-3 draft's slots [0, L) fed with the target's features of those tokens,
    a standalone draft's slots [0, L] (its slot i holds token i, the root included).
    Compaction, tree drafting and draft-extend left nothing stale."""
    S, K, N = shape
    p = with_draft(kind)
    spec = jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N)
    plan, st = loop_state(p, prompts, 30, CACHES[cache], spec, rounds=4)  # stop while every request still runs
    lens = [len(q) for q in prompts]
    d = p.draft.config
    for b, n in enumerate(lens):
        assert not st.finished[b] and int(st.L[b]) >= n + 4
        seq, hidden, aux = check_target_cache(st, plan, p, b, tuple(d.target_layers))
        # The draft: slot i pairs token i+1 with the target feature at i (EAGLE-3, lag 0),
        # or holds token i itself (standalone, lag 1).
        L = int(st.L[b])
        nd = L + d.lag
        tokens = np.zeros((1, len(seq)), np.int32)
        tokens[0, :nd] = seq[1 - d.lag: L + 1]
        dfresh = draft_prefill(p.config, d, p.weights, p.draft.weights, jnp.asarray(tokens),
                               d.target_features(hidden, aux), nd)
        check_cache(st, plan, st.proposal.cache, dfresh, b, nd, "draft")


def fresh_prefill(n, T, cache_kind):
    """An empty one-row cache of T slots and the AttnMeta of a prefill of T tokens into it,
    the first n (a scalar, traced or not) of them real, the rest masked and not written."""
    layout = lay.CacheLayout(paged=False, capacity=T)
    meta = lay.prefill_meta(jnp.reshape(n, (1,)).astype(jnp.int32), T)
    return cache_kind.init(layout, 1), lay.make_meta(
        layout, None, positions=meta.positions, prefix_len=jnp.zeros(1, jnp.int32), local_mask=meta.local_mask,
        write_valid=meta.valid, prefill=True)


@functools.partial(jax.jit, static_argnums=(0, 1))
def target_prefill(config, capture, weights, tokens, n):
    """A fresh prefill of tokens [1, T] (the first n real) -> (hidden [1, T, D], the
    captured layer inputs, the one-row target cache)."""
    family = family_for(config)
    cache, meta = fresh_prefill(n, tokens.shape[1], family.cache_kind(config))
    return family.forward(config, weights, tokens, cache, meta, capture=capture)


@functools.partial(jax.jit, static_argnums=(0, 1))
def draft_prefill(tconfig, dconfig, tw, dw, tokens, feats, n):
    """A fresh draft prefill of tokens [1, T] with target features feats (the first n
    real) -> the one-row draft cache."""
    cache, meta = fresh_prefill(n, tokens.shape[1], dconfig.cache_kind())
    return dconfig.forward(tconfig, tw, dw, tokens, feats, cache, meta, True)[1]


def check_cache(st, plan, got_cache, want_cache, b, n, what):
    """Slots [0, n) of row b of a loop's KV cache equal a one-row cache's."""
    paged = plan.layout.paged
    table = st.pages.page_table[b: b + 1] if paged else None
    assert len(got_cache.kv) == len(want_cache.kv)
    for layer, (buf, want) in enumerate(zip(got_cache.kv, want_cache.kv)):
        got = kvc.read_kv(buf if paged else buf[b: b + 1], table)[0, :n]  # [n, 2, Hkv, Dh]
        for part, name in enumerate(("keys", "values")):
            np.testing.assert_allclose(np.asarray(got[:, part]), np.asarray(want[0, :n, part]), atol=2e-5,
                                       err_msg=f"{what} {name} layer {layer}, request {b}")


def check_target_cache(st, plan, params, b, capture=()):
    """Target cache slots [0, L) of row b equal a fresh prefill of its committed tokens ->
    (the tokens up to the root [T], padded with zeros to the loop's token buffer; the
    prefill's hidden states [1, T, D] and captured layer inputs)."""
    L = int(st.L[b])
    seq = np.zeros(st.tokens.shape[1], np.int32)
    seq[: L + 1] = np.asarray(st.tokens[b, : L + 1])
    hidden, aux, fresh = target_prefill(params.config, capture, params.weights, jnp.asarray(seq[None]), L)
    check_cache(st, plan, st.tcache, fresh, b, L, "target")
    return seq, hidden, aux


# ------------------------------------------------------------------ property tests

def _py_select(cand_tokens, cand_scores, cand_parents, n):
    order = sorted(range(len(cand_scores)), key=lambda i: (-cand_scores[i], i))[: n - 1]
    keep = sorted(order)
    node_of = {c: i + 1 for i, c in enumerate(keep)}
    parents = [-1] + [0 if cand_parents[c] < 0 else node_of[cand_parents[c]] for c in keep]
    tokens = [cand_tokens[c] for c in keep]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    anc = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return tokens, parents, depth, anc


@st.composite
def candidate_sets(draw):
    """EAGLE-2 shaped candidates: K at level 1, K*K per later level, each child of one of
    the K best nodes of the previous level, scores = parent score x probability."""
    S, K = draw(st.integers(1, 4)), draw(st.integers(2, 4))
    rng = np.random.RandomState(draw(st.integers(0, 2 ** 31 - 1)))
    probs = rng.dirichlet(np.ones(K) * 0.5)
    tokens = list(rng.choice(50, K, replace=False))
    scores, parents = list(np.sort(probs)[::-1]), [-1] * K
    level = list(range(K))
    for _ in range(1, S):
        start = len(scores)
        for par in level:
            p = np.sort(rng.dirichlet(np.ones(K) * 0.5))[::-1]
            for c in range(K):
                scores.append(scores[par] * p[c])
                parents.append(par)
                tokens.append(int(rng.randint(50)))
        new = list(range(start, len(scores)))
        level = sorted(new, key=lambda i: (-scores[i], i))[:K]
    M = len(scores)
    n = draw(st.integers(2, M + 1))
    return S, np.array(tokens, np.int32), np.array(scores, np.float32), np.array(parents, np.int32), n


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(candidate_sets())
def test_select_tree_matches_python(case):
    S, tok, score, par, n = case
    tree = jax.jit(select_tree, static_argnums=(4, 5))(jnp.array([99]), jnp.array(tok[None]), jnp.array(score[None]),
                                                       jnp.array(par[None]), n, S)
    tokens, parents, depth, anc = _py_select(list(tok), list(score), list(par), n)
    assert tree.tokens[0].tolist() == [99] + [int(t) for t in tokens]
    assert tree.parents[0].tolist() == parents
    assert tree.depth[0].tolist() == depth
    assert (np.asarray(tree.anc[0]) == anc).all()


@st.composite
def random_trees(draw):
    n = draw(st.integers(2, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 3)) for _ in range(n)]
    choice = [draw(st.integers(0, 3)) for _ in range(n)]
    return parents, tokens, choice


@functools.partial(jax.jit, static_argnums=3)
def _accept_tree(parents, tokens, choice, S):
    """`accept.accept_tree` of the tree these parents [1,n] and tokens [1,n] make (one program
    per shape, not one per operation)."""
    depth, anc = ancestors(parents, S)
    tree = Tree(tokens=tokens, parents=parents, depth=depth, anc=anc, valid=jnp.ones(parents.shape, bool))
    return accept.accept_tree(tree, choice, S)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(random_trees())
def test_accept_tree_matches_python(case):
    parents, tokens, choice = case
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    S = max(depth)
    # Reference: walk down from the root, following a child whose token matches.
    node, path = 0, [0]
    while True:
        kids = [i for i in range(n) if parents[i] == node and tokens[i] == choice[node]]
        if not kids:
            break
        node = kids[0]  # several matching siblings: the first (the kernel keeps any deepest)
        path.append(node)
    acc, got_path, bonus = _accept_tree(jnp.array([parents], jnp.int32), jnp.array([tokens], jnp.int32),
                                        jnp.array([choice], jnp.int32), max(S, 1))
    acc = int(acc[0])
    got = got_path[0, :acc].tolist()
    # With duplicate sibling tokens any deepest matching path is right: check it is valid.
    assert got[0] == 0 and all(parents[b] == a and tokens[b] == choice[a] for a, b in zip(got, got[1:]))
    if len(set((parents[i], tokens[i]) for i in range(1, n))) == n - 1:  # no duplicate siblings
        assert got == path
    assert acc >= len(path) and int(bonus[0]) == choice[got[-1]]


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.sampled_from([0, 1, 3, 16]))
def test_compaction_matches_python(seed, page_size):
    """Moving each row's accepted path to L.. equals a Python list rewrite, and touches
    nothing else (dense when page_size == 0)."""
    rng = np.random.RandomState(seed)
    B, S1, cap = 3, 4, 48
    L = rng.randint(0, cap - 16, size=B)
    acc = rng.randint(1, S1 + 1, size=B)
    path = np.zeros((B, S1), np.int32)
    for b in range(B):
        path[b, : acc[b]] = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 12), acc[b] - 1, replace=False))])
    if page_size:
        G = cap // page_size
        num_pages = B * G + 2
        table = rng.permutation(num_pages)[: B * G].reshape(B, G).astype(np.int32)
        buf = rng.randn(num_pages + 1, page_size, 2, 1, 2).astype(np.float32)  # + the trash page
        layout = lay.CacheLayout(paged=True, capacity=cap, page_size=page_size, num_pages=num_pages)
        pages = lay.init_page_state(B, G, num_pages).replace(page_table=jnp.asarray(table))
        logical = lambda b: np.asarray(buf[table[b]].reshape(-1, 2, 1, 2))
    else:
        buf = rng.randn(B, cap + 1, 2, 1, 2).astype(np.float32)  # + each row's trash slot
        layout, pages = lay.CacheLayout(paged=False, capacity=cap), None
        logical = lambda b: buf[b, :cap]
    seqs = [logical(b).copy() for b in range(B)]
    for b in range(B):
        moved = [seqs[b][L[b] + path[b, d]].copy() for d in range(acc[b])]
        for d in range(acc[b]):
            seqs[b][L[b] + d] = moved[d]
    kind = kvc.KVCacheKind(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, dtype="float32")
    new = kind.commit(kvc.KVCache(kv=(jnp.asarray(buf),)), layout, pages, jnp.asarray(L, jnp.int32),
                      jnp.asarray(path), jnp.asarray(acc, jnp.int32), jnp.ones((B,), bool))
    buf = np.asarray(new.kv[0])
    for b in range(B):
        np.testing.assert_array_equal(logical(b), seqs[b])


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2 ** 31 - 1))
def test_page_allocation_matches_python(seed):
    """alloc_pages/free_pages against a Python model of the pool: rows served in order,
    pages never held twice, every page either held or free."""
    rng = np.random.RandomState(seed)
    B, G, P, num_pages = 4, 6, 2, 14
    state = lay.init_page_state(B, G, num_pages)
    held = [0] * B
    for _ in range(6):
        need = rng.randint(0, G * P + 3, size=B)
        active = rng.rand(B) < 0.8
        free_before = int(state.num_free)
        state, ok = lay.alloc_pages(state, jnp.asarray(need), jnp.asarray(active), P, G)
        taken, blocked = 0, False
        for b in range(B):
            pages = -(-need[b] // P)
            want = max(pages - held[b], 0) if active[b] and pages <= G else 0
            fits = not active[b] or (pages <= G and (want == 0 or (not blocked and taken + want <= free_before)))
            if active[b] and want > 0 and not fits:
                blocked = True
            if active[b] and pages > G:
                fits = False
            assert bool(ok[b]) == fits, (b, need, active, held)
            if fits and active[b]:
                held[b] += want
                taken += want
        assert [int(x) for x in state.num_alloc] == held
        table = np.asarray(state.page_table)
        used = [int(x) for b in range(B) for x in table[b, : held[b]]]
        assert len(used) == len(set(used)) and all(0 <= x < num_pages for x in used)
        assert sorted(used + np.asarray(state.free)[: int(state.num_free)].tolist()) == list(range(num_pages))
        release = rng.rand(B) < 0.3
        state = lay.free_pages(state, jnp.asarray(release))
        held = [0 if r else h for r, h in zip(release, held)]


def test_reserve_needs_no_retry_loop_when_the_pool_cannot_run_dry():
    """A pool of pages_per_seq pages a row (the default) serves every row that fits its
    limit in one allocation: no while loop in the program (XLA would read its predicate on
    the host), every row served, the pages held once each; a smaller pool keeps the loop."""
    B, G, P = 4, 6, 2
    rng = np.random.RandomState(0)
    full_pool = lay.CacheLayout(paged=True, capacity=G * P, page_size=P, num_pages=B * G)
    small_pool = lay.CacheLayout(paged=True, capacity=G * P, page_size=P, num_pages=B * G - 1)
    cap = jnp.full((B,), G * P, jnp.int32)
    for layout, loops in ((full_pool, False), (small_pool, True)):
        state = layout.init_pages(B)
        jaxpr = str(jax.make_jaxpr(lambda s, n, a: lay.reserve(layout, s, n, a, cap, G))(
            state, jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool)))
        assert ("while" in jaxpr) == loops
    state = full_pool.init_pages(B)
    for _ in range(8):
        need = jnp.asarray(rng.randint(0, G * P + 3, size=B))
        active = jnp.asarray(rng.rand(B) < 0.8)
        state, full = lay.reserve(full_pool, state, need, active, cap, G)
        np.testing.assert_array_equal(np.asarray(full), np.asarray(active & (need > cap)))
        served = np.asarray(active & ~full)
        held = np.asarray(state.num_alloc)
        assert (held[served] >= -(-np.asarray(need)[served] // P)).all()
        table = np.asarray(state.page_table)
        used = [int(x) for b in range(B) for x in table[b, : held[b]]]
        assert len(used) == len(set(used)) and int(state.num_free) == B * G - len(used)
        state = lay.free_pages(state, jnp.asarray(rng.rand(B) < 0.3))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.integers(1, 9), st.integers(1, 3000), st.sampled_from([16, 64]),
       st.booleans())
def test_vocab_top_k_equals_lax_top_k(seed, k, V, chunk, ties):
    """The two-stage top-k gives lax.top_k's values; its indices too when values are
    distinct, and with ties indices that hold those values, each once."""
    rng = np.random.RandomState(seed)
    x = rng.randint(0, 5, size=(2, 3, V)) if ties else rng.randn(2, 3, V)
    x = jnp.asarray(x, jnp.float32)
    k = min(k, V)
    v, i = jax.jit(vocab_top_k, static_argnums=1, static_argnames="chunk")(x, k, chunk=chunk)  # one program
    rv, ri = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(x), np.asarray(i), -1), np.asarray(v))
    assert all(len(set(row)) == k for row in np.asarray(i).reshape(-1, k).tolist())
    if not ties:
        np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
