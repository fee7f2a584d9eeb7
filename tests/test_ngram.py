"""N-gram (prompt lookup) drafts: the on-device lookup against a plain-Python reference,
bad settings refused before anything compiles, greedy output equal to plain greedy
output (chains S = 1..5 and trees, dense and paged caches, unequal batches), and whole
accepted chains where the text repeats its prompt. Sampled exactness: the statistical
tests of test_sampling_exact.py run n-gram chains and trees too."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from conftest import CACHES, loop_state
from jspec import api
from jspec.loop import programs
from jspec.loop.proposers.ngram import ngram_tree

# ----------------------------------------------------------------------------- the lookup


def reference_tree(seq, min_n, max_n, S, K, N):
    """The documented rule in plain Python: seq is a row's tokens up to its root (the last
    one) -> (tokens, parents, valid) of the N-node tree (placeholders: token 0, parent 0)."""
    L = len(seq) - 1
    cands = []
    for j in range(L):
        n = 0
        while n < max_n and j - n >= 0 and seq[j - n] == seq[L - n]:
            n += 1
        if n >= min_n:
            cands.append((n, j))
    cands = sorted(cands, reverse=True)[:K]  # longest match first, then the latest
    conts = [[seq[j + 1 + d % (L - j)] for d in range(S)] for _, j in cands]
    tokens, parents, valid = [seq[L]] + [0] * (N - 1), [-1] + [0] * (N - 1), [True] + [False] * (N - 1)
    if K == 1:  # a chain: the best continuation as it is
        for d, t in enumerate(conts[0] if conts else []):
            tokens[d + 1], parents[d + 1], valid[d + 1] = t, d, True
        return tokens, parents, valid
    node, count = {}, 1
    for c in conts:
        for d in range(S):
            prefix = tuple(c[: d + 1])
            if prefix in node:
                continue
            if count == N:
                return tokens, parents, valid
            node[prefix] = count
            tokens[count], parents[count], valid[count] = c[d], node[prefix[:-1]] if d else 0, True
            count += 1
    return tokens, parents, valid


@pytest.mark.parametrize("min_n,max_n,S,K,N", [(1, 3, 4, 1, 5), (2, 4, 3, 1, 4), (1, 2, 3, 3, 8), (1, 4, 4, 4, 17),
                                              (3, 3, 2, 2, 4), (1, 1, 5, 3, 7)])
def test_lookup_equals_the_python_reference(min_n, max_n, S, K, N):
    """Random rows over a small vocabulary (many repeats, ties and periodic tails), ragged
    lengths (history shorter than min_n included) -> the same drafts, parents and validity."""
    rng = np.random.RandomState(min_n * 100 + max_n * 10 + S + K + N)
    B, W = 48, 40
    L = rng.randint(0, W - 1, size=B)
    L[:3] = [0, 1, min_n - 1]
    tokens = rng.randint(0, 4, size=(B, W))
    tokens[4] = 7  # one repeated token: the period-1 tail
    tree = jax.jit(ngram_tree, static_argnums=(2, 3, 4, 5, 6))(jnp.asarray(tokens, jnp.int32),
                                                               jnp.asarray(L, jnp.int32), min_n, max_n, S, K, N)
    found = 0
    for b in range(B):
        want_tokens, want_parents, want_valid = reference_tree(tokens[b, : L[b] + 1].tolist(), min_n, max_n, S, K, N)
        valid = np.asarray(tree.valid[b])
        assert valid.tolist() == want_valid, b
        assert np.asarray(tree.tokens[b])[valid].tolist() == [t for t, v in zip(want_tokens, want_valid) if v], b
        assert np.asarray(tree.parents[b])[valid].tolist() == [p for p, v in zip(want_parents, want_valid) if v], b
        found += sum(want_valid) > 1
        anc, depth = np.asarray(tree.anc[b]), np.asarray(tree.depth[b])
        for i in range(1, N):  # placeholders hang under the root; depth and ancestors follow the parents
            p = int(tree.parents[b, i])
            assert depth[i] == depth[p] + 1 and anc[i, p] and anc[i, i]
    assert found >= 5  # the rows do exercise matches


def test_validity_gates_acceptance():
    """A node that was not proposed is never accepted, even when its token is the target's
    choice (a chain stops there; a tree walks its valid nodes only)."""
    from jspec.loop import accept
    from jspec.loop.tree import ancestors, chain_tree

    tokens = jnp.asarray([[5, 6, 7, 8]])
    choice = jnp.asarray([[6, 7, 8, 9]])  # every draft right
    for valid, want in [([True] * 4, 4), ([True, True, False, True], 2), ([True, False, True, True], 1)]:
        n, _, bonus = accept.accept_chain(tokens, choice, jnp.asarray([valid]))
        assert int(n[0]) == want and int(bonus[0]) == int(choice[0, want - 1])
    parents = jnp.asarray([[-1, 0, 1, 0]])
    depth, anc = ancestors(parents, 2)
    tree = chain_tree(tokens).replace(parents=parents, depth=depth, anc=anc,
                                      tokens=jnp.asarray([[5, 6, 7, 6]]), valid=jnp.asarray([[True, False, True, True]]))
    n, path, _ = accept.accept_tree(tree, jnp.asarray([[6, 7, 8, 7]]), 2)
    assert int(n[0]) == 2 and np.asarray(path)[0, :2].tolist() == [0, 3]


# ----------------------------------------------------------------------------- settings

@pytest.mark.parametrize("kw,msg", [(dict(min_n=0), "NgramDraft.min_n must be an int >= 1, got 0"),
                                    (dict(max_n=0), "NgramDraft.max_n must be an int >= 1, got 0"),
                                    (dict(min_n=3, max_n=2), "NgramDraft: min_n (3) must be at most max_n (2)"),
                                    (dict(max_n=65), "NgramDraft.max_n must be at most 64, got 65"),
                                    (dict(min_n=1.5), "NgramDraft.min_n must be an int >= 1, got 1.5"),
                                    (dict(max_n=True), "NgramDraft.max_n must be an int >= 1, got True")])
def test_bad_settings(kw, msg):
    with pytest.raises(ValueError, match=f"^{msg.replace('(', '[(]').replace(')', '[)]')}$"):
        jspec.NgramDraft(**kw)


def test_refused_specs_before_compiling(llama_dir, monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled despite bad input")
    monkeypatch.setattr(programs.generate_jit, "lower", no_compile)
    params = jspec.load(llama_dir[0], draft="ngram")
    assert params.draft.config == jspec.NgramDraft()
    with pytest.raises(ValueError, match="sample_drafts needs a draft model's distribution; n-gram drafts have none"):
        jspec.generate(params, [1, 2, 3], temperature=0.5, spec=jspec.SpecConfig(num_steps=2, sample_drafts=True))
    with pytest.raises(ValueError, match="an n-gram tree of topk=2 candidates of num_steps=3 tokens has at most 6 "
                                         "nodes besides the root; num_draft_tokens must be at most 7"):
        jspec.compile(params, [1, 2, 3], spec=jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=9))
    with pytest.raises(TypeError, match="draft must be a directory, 'mtp', 'ngram' or a jspec.NgramDraft, got int"):
        jspec.load(llama_dir[0], draft=3)


# ----------------------------------------------------------------------------- generation

MAX_NEW = 24


@pytest.fixture(scope="module")
def cycle_case(perm):
    """The permutation target (its greedy next token is pi(t), a cycle through every
    token) and prompts whose continuations the lookup gets right, partly right and wrong:
    a stretch of the cycle closed by its first token (every later token repeats the
    prompt), the same stretch with one token edited (drafts right up to the edit), two
    earlier occurrences of the suffix with different continuations (the later one,
    ranked first, wrong; the other right for two tokens: a tree finds it, a chain does
    not), and a short prompt with nothing to repeat. -> (target, prompts, plain tokens)."""
    target = jspec.load(perm["target"])
    c = [4]
    for _ in range(39):
        c.append(int(perm["pi"][c[-1]]))
    edited = c[:12]
    edited[6] = c[30]
    prompts = [c[:30] + [c[0]], edited + [c[0]], [c[0], c[1], c[2], c[3], c[35], c[0], c[1], c[36], c[37], c[0]],
               [11, 12, 13]]
    return target, prompts, jspec.generate(target, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[]).tokens


@pytest.mark.parametrize("S,K,N,cache", [
    (3, 1, 4, "dense"), (4, 3, 10, "paged16"),
    pytest.param(1, 1, 2, "dense", marks=pytest.mark.slow), pytest.param(2, 1, 3, "paged1", marks=pytest.mark.slow),
    pytest.param(4, 1, 5, "paged16", marks=pytest.mark.slow), pytest.param(5, 1, 6, "dense", marks=pytest.mark.slow),
    pytest.param(3, 2, 6, "dense", marks=pytest.mark.slow), pytest.param(5, 4, 12, "paged1", marks=pytest.mark.slow)])
def test_greedy_equals_plain(cycle_case, S, K, N, cache):
    """Chains S = 1..5 and trees, dense and paged, an unequal batch: the target's own
    tokens, and the accept lengths the prompts call for."""
    target, prompts, plain = cycle_case
    out = jspec.generate(target.with_draft(jspec.NgramDraft(min_n=1, max_n=3)), prompts, max_new_tokens=MAX_NEW,
                         stop_token_ids=[], cache=CACHES[cache],
                         spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N))
    assert out.tokens == plain
    acc = out.stats.accept_lengths
    assert acc[0][:-1] == [S + 1] * (len(acc[0]) - 1)  # the repeated stretch: whole chains
    assert acc[1][0] == min(S, 4) + 1  # drafts right up to the edited token (the 5th draft)
    assert acc[2][0] == (min(S, 2) + 1 if K > 1 else 1)  # the second candidate: a tree's only
    assert acc[3][0] == 1


def test_random_model_equals_plain(target):
    """A model with real attention whose text does not repeat: no draft is accepted, the
    placeholders are verified and never taken, the output is plain decoding's."""
    prompts = [[5, 7, 9, 11, 5, 7, 9, 11, 5, 7], [20, 21, 22], list(range(30, 47)) + list(range(30, 40))]
    plain = jspec.generate(target, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[]).tokens
    for spec, cache in ((jspec.SpecConfig(num_steps=3), "paged1"), (jspec.SpecConfig(4, 3, 8), "dense")):
        out = jspec.generate(target.with_draft(jspec.NgramDraft()), prompts, max_new_tokens=MAX_NEW,
                             stop_token_ids=[], spec=spec, cache=CACHES[cache])
        assert out.tokens == plain


@pytest.mark.parametrize("cache", ["paged16", pytest.param("dense", marks=pytest.mark.slow)])
def test_cache_holds_what_plain_decoding_writes(cycle_case, cache):
    """After rounds of n-gram trees with whole and partly accepted paths, the target cache
    slots [0, L) of those rows equal a fresh prefill of their committed tokens."""
    from test_tree import check_target_cache
    target, prompts, _ = cycle_case
    params = target.with_draft(jspec.NgramDraft(min_n=1, max_n=3))
    plan, st = loop_state(params, prompts, MAX_NEW, CACHES[cache],
                          jspec.SpecConfig(num_steps=4, topk=3, num_draft_tokens=10), rounds=3)  # every request still runs
    assert int(st.L[0]) == len(prompts[0]) + 3 * 5  # three whole chains committed after the prompt
    assert not st.finished.any()
    for b in (0, 2):  # whole chains; a second candidate's path, moved into place
        check_target_cache(st, plan, params, b)


def test_compile_and_stream_with_stops_per_request(cycle_case):
    """`jspec.compile` reruns other prompts without recompiling, and `jspec.stream`'s chunks
    concatenate to `generate`'s tokens; each request stops at its own stop ids."""
    target, prompts, plain = cycle_case
    params = target.with_draft(jspec.NgramDraft(min_n=2))
    stops = [[plain[0][9]], [], [plain[2][3], plain[2][4]], [1]]
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=stops, spec=jspec.SpecConfig(num_steps=4))
    want = jspec.generate(params, prompts, **kw)
    assert want.tokens[0] == plain[0][:10] and want.tokens[1] == plain[1] and want.tokens[2] == plain[2][:4]
    assert want.finish_reasons[:3] == ["stop", "length", "stop"]
    chunks = list(jspec.stream(params, prompts, rounds_per_chunk=2, **kw))
    assert [[t for c in chunks for t in c.tokens[i]] for i in range(len(prompts))] == want.tokens
    prog = jspec.compile(params, prompts, **kw)
    programs_before = api.compiled_programs()
    again = prog.run(prompts[::-1], stop_token_ids=stops[::-1], max_new_tokens=MAX_NEW)
    assert again.tokens == want.tokens[::-1] and api.compiled_programs() == programs_before


@pytest.mark.slow
def test_ngram_on_a_deepseek_target_equals_plain(tmp_path_factory):
    """N-gram trees over the MLA latent cache (paged, pages of 16): plain greedy output."""
    from test_deepseek import make_deepseek
    path = str(tmp_path_factory.mktemp("ngram_deepseek"))
    make_deepseek(path, "v2-greedy-yarn")
    target = jspec.load(path, dtype="float32")
    prompts = [[5, 7, 9, 11, 5, 7, 9, 11, 5, 7], [20, 21, 22, 20, 21], list(range(30, 47)) * 2]
    plain = jspec.generate(target, prompts, max_new_tokens=MAX_NEW, stop_token_ids=[]).tokens
    out = jspec.generate(target.with_draft(jspec.NgramDraft()), prompts, max_new_tokens=MAX_NEW, stop_token_ids=[],
                         spec=jspec.SpecConfig(4, 3, 10), cache=CACHES["paged16"])
    assert out.tokens == plain


def test_sampled_equals_plain_sampling(cycle_case):
    """Sampled rows (temperature 0.3: the permutation target's next token is its cycle's
    about half the time) verified target-only: the n-gram drafts are accepted, partly
    accepted and rejected, and the tokens are plain sampling's for the same seeds."""
    target, prompts, _ = cycle_case
    kw = dict(max_new_tokens=MAX_NEW, stop_token_ids=[], temperature=0.3, seed=[5, 6, 7, 8])
    plain = jspec.generate(target, prompts, **kw)
    out = jspec.generate(target.with_draft(jspec.NgramDraft(min_n=1, max_n=3)), prompts,
                         spec=jspec.SpecConfig(num_steps=3), **kw)
    assert out.tokens == plain.tokens
    seen = {a for row in out.stats.accept_lengths for a in row}
    assert {1, 2, 4} <= seen, seen  # rejected, partly accepted, accepted whole

