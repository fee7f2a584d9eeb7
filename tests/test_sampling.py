"""Sampling: the processing (penalties, top-k, top-p, min-p) against numpy references, the
accept rules on their edge cases, and speculative sampling end to end: target-only
verification emits the very tokens plain sampling emits for the same seed (chain and
tree, every draft kind, dense and paged), sampled drafts are reproducible and independent
of the batch, and greedy rows in a sampled batch are unchanged. The distributions
themselves are tested in test_sampling_exact.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CACHES, PROMPTS

import jspec
from jspec import sampling
from jspec.loop import accept
from jspec.loop.tree import Tree, ancestors


def sp_rows(B, **kw):
    """SamplingParams of B rows: neutral values, overridden by kw (scalars or [B])."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0, seed=0)
    base.update(kw)
    dt = lambda k: jnp.int32 if k in ("top_k", "seed") else jnp.float32
    return sampling.SamplingParams(**{k: jnp.broadcast_to(jnp.asarray(v, dt(k)), (B,)) for k, v in base.items()})


def no_history(B, V):
    return sampling.History(in_prompt=jnp.zeros((B, V), bool), counts=jnp.zeros((B, V), jnp.int32))


# ----------------------------------------------------------------------------- processing

def reference_keep(x, k, p, m):
    """numpy: which entries top-k, then top-p (on the renormalised top-k set), then min-p keep."""
    keep = np.isfinite(x)
    if k > 0:
        keep &= x >= np.sort(x)[::-1][min(k, x.size) - 1]
    if p < 1:
        y = np.where(keep, x, -np.inf)
        order = np.argsort(-y, kind="stable")
        probs = np.exp(y[order] - y[order][0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        n = max(int(np.sum(before < p)), 1)
        keep &= y >= y[order][n - 1]
    if m > 0:
        keep &= x >= x[keep].max() + np.log(m)
    return keep


def test_filters_equal_a_sorting_reference():
    rng = np.random.RandomState(0)
    R, V = 96, 200
    x = rng.randn(R, V).astype(np.float32) * rng.choice([0.3, 1, 4], size=(R, 1)).astype(np.float32)
    x[:8, ::7] = x[:8, :1]  # ties with the row's first entry
    x[8:12, 5:] = -np.inf  # everything masked but five
    x[12, 1:] = -np.inf  # every token masked but one
    k = rng.choice([0, 1, 2, 5, 50, 199, 200, 500], size=R).astype(np.int32)
    p = rng.choice([1.0, 1e-6, 0.3, 0.8, 0.95, 0.999], size=R).astype(np.float32)
    m = rng.choice([0.0, 0.0, 0.05, 0.5, 1.0], size=R).astype(np.float32)
    got = np.isfinite(np.asarray(sampling.filter_logits(jnp.asarray(x), jnp.asarray(k), jnp.asarray(p),
                                                        jnp.asarray(m))))
    for r in range(R):
        want = reference_keep(x[r], k[r], p[r], m[r])
        assert (got[r] == want).all(), (r, k[r], p[r], m[r], np.flatnonzero(got[r] != want))
    assert got[12].sum() == 1


def test_candidate_search_equals_the_sorting_reference():
    """Rows with 0 < top-k <= cap, and rows with top-p alone whose candidates surely reach
    p of the mass, search only the values of the cap groups with the largest maxima; with
    ties (integer logits) and masked rows, the thresholds equal the full-row reference, in
    a batch of covered rows and in one with rows the candidates do not cover (top-k beyond
    the cap, or top-p over a flat row: searched whole)."""
    rng = np.random.RandomState(1)
    R, V, cap, group = 96, 203, 8, 4  # 51 groups, the last one padded
    x = rng.randn(R, V).astype(np.float32) * rng.choice([0.5, 8.0], size=(R, 1)).astype(np.float32)
    x[:32] = np.round(x[:32])  # ties within and across groups
    x[40:44, 7:] = -np.inf
    k = rng.choice([0, 0, 1, 2, 5, 8], size=R).astype(np.int32)
    p = rng.choice([1.0, 1e-6, 0.3, 0.8, 0.95], size=R).astype(np.float32)
    m = rng.choice([0.0, 0.05, 0.5], size=R).astype(np.float32)
    _, lowest = sampling.candidates(jnp.asarray(x), cap, group)
    top = x.max(axis=1, keepdims=True)
    total = np.exp(x - top).sum(axis=1)
    reach = np.array([np.exp(x[r][x[r] >= float(lowest[r])] - top[r]).sum() >= p[r] * total[r] for r in range(R)])
    covered = (k > 0) | (p >= 1) | reach
    assert ((k == 0) & (p < 1) & reach).sum() >= 10 and (~covered).sum() >= 5
    kk = k.copy()
    kk[np.flatnonzero(covered)[0]] = cap + 1
    no_m = np.zeros_like(m)  # min-p off: it would hide a wrong top-p threshold
    for rows, kk, mm in ((covered, k, no_m), (covered, k, m), (slice(None), k, m), (slice(None), kk, m)):
        got = np.isfinite(np.asarray(sampling.filter_logits(jnp.asarray(x[rows]), jnp.asarray(kk[rows]),
                                                            jnp.asarray(p[rows]), jnp.asarray(mm[rows]),
                                                            cap=cap, group=group)))
        for r, row in enumerate(np.arange(R)[rows]):
            assert (got[r] == reference_keep(x[row], kk[row], p[row], mm[row])).all(), (row, kk[row], p[row], mm[row])


def test_order_keys_keep_the_float_order():
    x = np.array([-np.inf, -3e38, -1.5, -1e-40, 0.0, 1e-40, 1e-30, 0.5, 2.0, 3e38, np.inf], np.float32)
    keys = sampling.order_keys(jnp.asarray(x))
    assert (np.diff(np.asarray(keys).astype(np.int64)) > 0).all()
    assert (np.asarray(sampling.from_order_key(keys)) == x).all()


def test_search_unrolled_equals_its_loop():
    """The threshold search's two forms (unrolled on a GPU, a loop elsewhere) find the same
    values, and each is the largest reaching its target."""
    rng = np.random.RandomState(2)
    x = rng.randn(64, 300).astype(np.float32) * 3
    x[:8] = np.round(x[:8])  # ties
    x[8:12, 4:] = -np.inf
    for weigh, target in ((jnp.ones_like, rng.randint(1, 300, 64)),
                          (jnp.exp, rng.uniform(0, 1, 64) * np.exp(x).sum(1))):
        target = jnp.asarray(target, jnp.float32)
        found = [np.asarray(jax.jit(lambda x, t, u=u: sampling.largest_value_reaching(x, weigh, t, unroll=u))(
            jnp.asarray(x), target)) for u in (True, False)]
        assert (found[0] == found[1]).all()
        w = np.asarray(weigh(jnp.asarray(x)))
        for r in range(64):
            if np.isfinite(found[0][r]):
                assert w[r][x[r] >= found[0][r]].sum() >= target[r] * (1 - 1e-6)
                above = x[r][x[r] > found[0][r]]
                assert above.size == 0 or w[r][x[r] >= above.min()].sum() < target[r]


def _random_tree(rng, B, N, V):
    parents = np.full((B, N), -1, np.int32)
    for i in range(1, N):
        parents[:, i] = rng.randint(0, i, size=B)
    tokens = rng.randint(0, V, size=(B, N)).astype(np.int32)
    tokens[:, 2] = tokens[:, 1]  # a duplicate (siblings or parent-child)
    depth, anc = ancestors(jnp.asarray(parents), N)
    return tokens, np.asarray(anc)


def test_penalties_count_each_nodes_own_path():
    """A node's context is the prompt, the generated tokens and its path below the root;
    the penalties are recomputed per node against a numpy reference that counts naively."""
    rng = np.random.RandomState(1)
    B, N, V = 3, 7, 11
    z = rng.randn(B, N, V).astype(np.float32) * 2
    tokens, anc = _random_tree(rng, B, N, V)
    in_prompt = rng.rand(B, V) < 0.3
    counts = rng.randint(0, 3, size=(B, V)) * (rng.rand(B, V) < 0.4)
    r, pres, freq = np.array([1.3, 1.0, 0.7]), np.array([0.5, 0.0, -0.2]), np.array([0.3, 0.1, 0.0])
    sp = sp_rows(B, repetition_penalty=r, presence_penalty=pres, frequency_penalty=freq)
    hist = sampling.History(in_prompt=jnp.asarray(in_prompt), counts=jnp.asarray(counts, jnp.int32))
    got = np.asarray(sampling.penalise(jnp.asarray(z), sp, hist, jnp.asarray(tokens), jnp.asarray(anc)))
    for b in range(B):
        for i in range(N):
            c = counts[b].copy()
            for j in range(1, N):
                if anc[b, i, j]:
                    c[tokens[b, j]] += 1
            seen = in_prompt[b] | (c > 0)
            want = np.where(seen, np.where(z[b, i] > 0, z[b, i] / r[b], z[b, i] * r[b]), z[b, i])
            want = want - freq[b] * c - pres[b] * (c > 0)
            np.testing.assert_allclose(got[b, i], want, rtol=1e-6, atol=1e-6)


def test_a_lone_kept_token_always_wins():
    """Every token masked but one: whatever the noise, the draw is that token."""
    B, V = 64, 40
    logits = jnp.full((B, 1, V), -1e9).at[:, 0, 17].set(-5.0)
    sp = sp_rows(B, min_p=1e-3, seed=np.arange(B))
    got = sampling.choose(True, logits, sp, jnp.zeros((B, 1), jnp.int32), no_history(B, V))
    assert (np.asarray(got) == 17).all()


# ----------------------------------------------------------------------------- accept rules

def _sampled_chain_rows(p0, p1, q0, n, u=None, monkeypatch=None, q_told=None):
    """n rows of a one-draft chain: the draft token drawn from q0 (numpy), accepted against
    p0 (the accept rule told q_told, default q0), bonus after it from p1 -> (first emitted
    token [n], accept_len [n])."""
    V = p0.size
    d = np.random.RandomState(3).choice(V, size=n, p=q0)
    tokens = jnp.asarray(np.stack([np.zeros(n, np.int32), d], 1))
    with np.errstate(divide="ignore"):
        logits = jnp.asarray(np.log(np.stack([p0, p1]))[None].repeat(n, 0), jnp.float32)
        logq = jnp.asarray(np.log(q0 if q_told is None else q_told)[None, None].repeat(n, 0), jnp.float32)
    if u is not None:
        monkeypatch.setattr(sampling, "uniform", lambda seed, pos, stream: jnp.full(pos.shape, u, jnp.float32))
    sp = sp_rows(n, seed=np.arange(n))
    anc = jnp.broadcast_to(jnp.tril(jnp.ones((2, 2), bool)), (n, 2, 2))
    accept_rows = jax.jit(lambda *a: accept.accept_sampled_chain(*a))  # one program, traced afresh (`uniform`)
    acc_len, _, bonus = accept_rows(tokens, logits, logq, sp, no_history(n, V), anc, jnp.zeros((n,), jnp.int32),
                                    jnp.ones((n, 2), bool))
    acc_len, bonus = np.asarray(acc_len), np.asarray(bonus)
    return np.where(acc_len > 1, d, bonus), acc_len


def test_sampled_drafts_emit_the_target_distribution():
    """min(1, p/q) acceptance with a max(0, p - q) correction: the first emitted token has
    distribution p0 whatever q0 is (20000 rows, 4.5 standard errors per token); accepting
    against the wrong q (the check's power) gives a visibly different distribution."""
    p0 = np.array([0.5, 0.2, 0.2, 0.1, 0.0])
    q0 = np.array([0.1, 0.1, 0.3, 0.2, 0.3])  # q puts mass where p has none
    p1 = np.full(5, 0.2)
    n = 20000
    first, acc_len = _sampled_chain_rows(p0, p1, q0, n)
    freq = np.bincount(first, minlength=5) / n
    se = np.sqrt(p0 * (1 - p0) / n) + 1e-9
    assert np.all(np.abs(freq - p0) <= 4.5 * se), (freq, p0)
    assert freq[4] == 0  # zero target probability: never emitted
    assert abs(np.mean(acc_len > 1) - np.minimum(p0, q0).sum()) < 4.5 * np.sqrt(0.25 / n)
    wrong, _ = _sampled_chain_rows(p0, p1, q0, n, q_told=np.full(5, 0.2))  # drafts from q0, accepted as if uniform
    assert np.max(np.abs(np.bincount(wrong, minlength=5) / n - p0) / se) > 10


@pytest.mark.parametrize("u", [0.0, float(np.nextafter(np.float32(1), np.float32(0)))])
def test_sampled_drafts_at_uniform_extremes(u, monkeypatch):
    """u = 0 keeps every draft with p > 0 and never one with p = 0; u just below 1 keeps a
    draft exactly when p >= q (up to rounding) and the correction comes from p - q > 0."""
    p0 = np.array([0.0, 0.6, 0.3, 0.1])
    q0 = np.array([0.4, 0.3, 0.2, 0.1])
    first, acc_len = _sampled_chain_rows(p0, np.full(4, 0.25), q0, 4000, u=u, monkeypatch=monkeypatch)
    d = np.random.RandomState(3).choice(4, size=4000, p=q0)
    if u == 0:
        assert ((acc_len > 1) == (p0[d] > 0)).all()
    else:
        assert ((acc_len > 1) == (p0[d] > q0[d])).all() or ((acc_len > 1) == (p0[d] >= q0[d])).all()
    assert (p0[first] > 0).all()
    rejected = acc_len == 1
    assert (p0[first[rejected]] > q0[first[rejected]]).all()  # drawn from max(0, p - q)


def test_duplicate_siblings_emit_the_choice_sequence():
    """Two children of the root carry the same token; whichever is walked, the emitted
    tokens are the target's choices in order."""
    parents = jnp.asarray([[-1, 0, 0, 2, 1]])
    depth, anc = ancestors(parents, 3)
    tree = Tree(tokens=jnp.asarray([[9, 4, 4, 6, 7]]), parents=parents, depth=depth, anc=anc,
                valid=jnp.ones((1, 5), bool))
    # choice at node: root -> 4; node 1 -> 5 (its child 7 is wrong); node 2 -> 6; node 3 -> 8
    choice = jnp.asarray([[4, 5, 6, 8, 0]])
    acc_len, path, bonus = accept.accept_tree(tree, choice, 2)
    assert int(acc_len[0]) == 3 and np.asarray(path)[0, :3].tolist() == [0, 2, 3] and int(bonus[0]) == 8


# ----------------------------------------------------------------------------- end to end

# Rows: greedy; temperature; top-k + penalties; top-p + min-p + repetition penalty.
ROWS = dict(temperature=[0.0, 1.0, 0.8, 0.9], top_k=[0, 0, 20, 0], top_p=[1.0, 1.0, 1.0, 0.9],
            min_p=[0.0, 0.0, 0.0, 0.02], repetition_penalty=[1.0, 1.0, 1.0, 1.3], presence_penalty=[0.0, 0.0, 0.5, 0.0],
            frequency_penalty=[0.0, 0.0, 0.4, 0.0], seed=[0, 11, 12, 13])
BATCH = PROMPTS + [[40, 41, 42, 43]]
KW = dict(max_new_tokens=10, stop_token_ids=[])


@pytest.fixture(scope="module")
def plain_sampled(target):
    return jspec.generate(target, BATCH, **KW, **ROWS).tokens


@pytest.mark.parametrize("kind,spec,cache", [
    ("eagle3_reduced", jspec.SpecConfig(num_steps=3), "dense"),
    ("standalone", jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), "paged16"),
    pytest.param("eagle", jspec.SpecConfig(num_steps=2), "paged1", marks=pytest.mark.slow),
])  # EAGLE-3 over its full vocabulary: the tree mode of test_sampling_exact.py
def test_target_only_emits_plain_sampling(with_draft, target, plain_sampled, kind, spec, cache):
    """Target-only verification draws the target's token at each position with that
    position's noise, so a speculative run emits what plain sampling emits for the same
    seeds: token for token, with every processing step on, greedy rows included (which
    also equal plain greedy decoding)."""
    out = jspec.generate(with_draft(kind), BATCH, spec=spec, cache=CACHES[cache], **KW, **ROWS)
    assert out.tokens == plain_sampled
    assert out.tokens[0] == jspec.generate(target, BATCH[0], **KW).tokens


@pytest.mark.parametrize("kind", ["standalone"])  # other kinds: test_sampling_exact.py
def test_sampled_drafts_seeds_and_batches(with_draft, target, kind):
    """Sampled drafts: the same seeds give the same tokens, other seeds other tokens; a
    request's tokens do not depend on its batch mates or its row; greedy rows and the
    degenerate filters (top_k = 1, a tiny top_p, min_p = 1) give greedy output."""
    p = with_draft(kind)
    spec = jspec.SpecConfig(num_steps=3, sample_drafts=True)
    prog = jspec.compile(p, BATCH, spec=spec, **KW, **ROWS)
    a, b = prog.run(), prog.run()
    assert a.tokens == b.tokens
    assert a.tokens[0] == jspec.generate(target, BATCH[0], **KW).tokens
    other = prog.run(seed=[0, 21, 22, 23]).tokens
    assert all(other[i] != a.tokens[i] for i in (1, 2, 3))
    moved = prog.run([BATCH[3], BATCH[1], BATCH[2], BATCH[0]], **KW,
                     **{k: [v[3], v[1], v[2], v[0]] for k, v in ROWS.items()})
    assert moved.tokens[0] == a.tokens[3] and moved.tokens[1] == a.tokens[1]
    mates = prog.run([BATCH[3], [50, 51], [52], [53, 54, 55]], **KW, temperature=[0.9, 1.0, 1.0, 1.0],
                     top_k=[0, 0, 0, 0], top_p=[0.9, 1.0, 1.0, 1.0], min_p=[0.02, 0, 0, 0],
                     repetition_penalty=[1.3, 1, 1, 1], presence_penalty=0.0, frequency_penalty=0.0,
                     seed=[13, 1, 2, 3])
    assert mates.tokens[0] == a.tokens[3]
    greedy = jspec.generate(target, BATCH, **KW).tokens
    degenerate = prog.run(temperature=1.5, top_k=[1, 0, 0, 0], top_p=[1.0, 1e-6, 1.0, 1.0],
                          min_p=[0.0, 0.0, 1.0, 0.0], repetition_penalty=1.0, presence_penalty=0.0,
                          frequency_penalty=0.0, seed=[5, 6, 7, 8]).tokens
    assert degenerate[:3] == greedy[:3]
