"""EAGLE chain speculative decoding (topk = 1): exactness, acceptance, checks."""
from __future__ import annotations

import collections

import chex
import jax
import numpy as np
import pytest

import jspec
from jspec.loading import load_draft
from jspec.loop import programs
from conftest import CACHES, PROMPTS, loop_inputs


def _with_draft(target, path):
    return target.with_draft(load_draft(path, target))


# Every draft kind with every cache kind, and with chains of S = 1 (one draft token from
# draft-extend alone, no draft step), 3 and 5: each (kind, cache) pair once, and each
# (kind, S) and (cache, S) pair at least once.
CHAINS = [("eagle", "dense", 1), ("eagle", "paged1", 3), ("eagle", "paged16", 5),
          ("eagle3", "dense", 3), ("eagle3", "paged1", 5), ("eagle3", "paged16", 1),
          ("eagle3_reduced", "dense", 5), ("eagle3_reduced", "paged1", 1), ("eagle3_reduced", "paged16", 3),
          ("standalone", "dense", 3), ("standalone", "paged1", 1), ("standalone", "paged16", 5)]
FAST_CHAINS = {("eagle", "dense", 1), ("eagle3", "paged1", 5), ("standalone", "paged16", 5)}


@pytest.mark.parametrize("kind,cache,steps", [c if c in FAST_CHAINS else pytest.param(*c, marks=pytest.mark.slow)
                                              for c in CHAINS])
def test_chain_greedy_equals_target(with_draft, hf_greedy, kind, cache, steps):
    p = with_draft(kind)
    out = jspec.generate(p, PROMPTS, max_new_tokens=12, stop_token_ids=[], cache=CACHES[cache],
                         spec=jspec.SpecConfig(num_steps=steps))
    assert out.tokens == [hf_greedy(q, 12) for q in PROMPTS]
    assert all(1 <= a <= steps + 1 for row in out.stats.accept_lengths for a in row)


# ------------------------------------------------------------------ program structure

def _primitives(jaxpr, counts=None):
    """Primitive name -> occurrences in a jaxpr and every sub-jaxpr (while/cond bodies,
    nested jits, ...)."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    _primitives(sub, counts)
    return counts


def _program(p, spec, cache="dense"):
    """(whole program, the loop of rounds, the top-level conds) of one generation, traced
    the way jspec.compile builds it."""
    plan, inputs = loop_inputs(p, PROMPTS, 12, CACHES[cache], spec)
    closed = jax.make_jaxpr(programs.generate_fn, static_argnums=0)(plan, p.weights, p.draft.weights, *inputs)
    top = closed.jaxpr.eqns
    whiles = [e for e in top if e.primitive.name == "while"]
    assert whiles, "no while loop of rounds in the program"
    rounds = _primitives(whiles[-1].params["body_jaxpr"].jaxpr)  # the loop of rounds comes last
    conds = collections.Counter()
    for e in top:
        if e.primitive.name == "cond":
            for branch in e.params["branches"]:
                _primitives(branch.jaxpr, conds)
    return _primitives(closed.jaxpr), rounds, conds


@pytest.mark.parametrize("kind,cache", [("eagle3_reduced", "dense"),
                                        pytest.param("standalone", "paged16", marks=pytest.mark.slow)])
def test_chain_round_has_no_topk_or_sort(with_draft, kind, cache):
    """A chain (K = 1) round does no top-k or sort over candidates (argmax only); the same
    check on a tree (K > 1) finds them, so the check can see them."""
    p = with_draft(kind)
    whole, rounds, conds = _program(p, jspec.SpecConfig(num_steps=3, topk=1), cache)
    assert rounds["argmax"] > 0 and rounds["dot_general"] > 0  # the walk sees the round's work
    assert whole["top_k"] == 0
    assert rounds["sort"] == 0
    # The only sort: the prefill's sampling branch (lax.cond; never taken at temperature 0).
    assert whole["sort"] == conds["sort"]
    whole, rounds, _ = _program(p, jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4), cache)
    assert whole["top_k"] > 0 and rounds["top_k"] > 0 and rounds["sort"] > 0


def _pi_continuation(pi, prompt, n):
    out, t = [], prompt[-1]
    for _ in range(n):
        t = int(pi[t])
        out.append(t)
    return out


@pytest.mark.parametrize("kind,steps,cache", [("eagle", 1, "dense"), pytest.param("eagle", 5, "paged16", marks=pytest.mark.slow),
                                              ("eagle3", 3, "dense"),
                                              pytest.param("standalone", 5, "paged1", marks=pytest.mark.slow)])
def test_agreeing_drafts_accept_long_runs(perm, kind, steps, cache):
    """Drafts that agree with the target: every round accepts all S drafts plus the bonus
    (EAGLE, standalone), or exactly the first draft (the EAGLE-3 head built to be right only
    when it reads the target's feature: this checks the features are aligned)."""
    p = jspec.load(perm["target"], draft=perm[kind])
    prompts = [[5, 7, 9], [20, 21, 22, 23, 24, 25, 26]]
    out = jspec.generate(p, prompts, max_new_tokens=20, stop_token_ids=[], cache=CACHES[cache],
                         spec=jspec.SpecConfig(num_steps=steps))
    assert out.tokens == [_pi_continuation(perm["pi"], q, 20) for q in prompts]
    want = 2 if kind == "eagle3" else steps + 1
    assert all(a == want for row in out.stats.accept_lengths for a in row)
    assert out.stats.mean_accept_length == want
    assert sum(out.stats.histogram.values()) == sum(out.stats.rounds)


def test_default_chain_stop_token_and_limits(perm):
    p = jspec.load(perm["target"], draft=perm["standalone"])
    cont = _pi_continuation(perm["pi"], [5, 7, 9], 30)
    stop = cont[6]
    out = jspec.generate(p, [[5, 7, 9], [5, 7, 9]], max_new_tokens=[30, 4], stop_token_ids=[stop])
    assert out.tokens == [cont[:7], cont[:4]]  # a stop inside an accepted run ends it there
    assert out.finish_reasons == ["stop", "length"]
    assert max(out.stats.accept_lengths[0]) == jspec.SpecConfig().num_steps + 1


def _half_agreeing_standalone(perm, path, bad):
    """The permutation target as a standalone draft, wrong exactly at the tokens in `bad`:
    its LM-head column pi(b) is zeroed, so after b it proposes some token other than pi(b)."""
    from jspec.export import save_target
    t = jspec.load(perm["target"])
    w = jax.tree.map(np.array, t.weights)
    w["params"]["lm_head"]["kernel"][:, [int(perm["pi"][b]) for b in bad]] = 0
    save_target(path, t.config, w)
    return jspec.load(perm["target"], draft=path)


def test_spec_stats(perm, tmp_path):
    """SpecStats on a run whose acceptance is known exactly: a draft that agrees with the
    target except after the tokens in `bad`, so a round from root r accepts the drafts up to
    the first pi^j(r) in `bad` (at most S) plus the bonus."""
    pi = perm["pi"]
    bad = set(np.random.RandomState(0).choice(len(pi), len(pi) // 4, replace=False).tolist())
    p = _half_agreeing_standalone(perm, str(tmp_path / "draft"), bad)
    S = jspec.SpecConfig().num_steps
    prompts, max_new = [[5, 7, 9], [20, 21, 22, 23, 24, 25, 26]], [20, 9]
    out = jspec.generate(p, prompts, max_new_tokens=max_new, stop_token_ids=[])
    want = []
    for q, n in zip(prompts, max_new):
        root, generated, rows = int(pi[q[-1]]), 1, []  # the prefill emits the first token
        while generated < n:
            m, x = 0, root
            while m < S and x not in bad:
                m, x = m + 1, int(pi[x])
            rows.append(m + 1)
            generated += m + 1
            root = int(pi[x])  # the bonus
        want.append(rows)
    flat = [a for row in want for a in row]
    assert len(set(flat)) >= 3  # the case is not degenerate
    st = out.stats
    assert out.tokens == [_pi_continuation(pi, q, n) for q, n in zip(prompts, max_new)]
    assert st.accept_lengths == want
    assert st.rounds == [len(row) for row in want]
    assert all(1 <= a <= S + 1 for row in st.accept_lengths for a in row)
    assert st.histogram == dict(sorted(collections.Counter(flat).items()))
    assert sum(st.histogram.values()) == sum(st.rounds)
    assert st.tau == st.mean_accept_length == pytest.approx(np.mean(flat))
    assert st.tokens_per_s > 0 and st.tokens_per_s == out.timing["tokens_per_s"]
    assert out.timing["new_tokens"] == sum(max_new)


@pytest.mark.slow
def test_eagle3_default_aux_layers(target, drafts, hf_greedy, tmp_path):
    """An EAGLE-3 config.json with no eagle_config reads the inputs of target layers
    (2, n//2, n-3) (SGLang's default), each moved into 1..n: here n = 2, so (2, 1, 1),
    repeated and unsorted."""
    import json
    import shutil

    path = tmp_path / "eagle3_default_aux"
    shutil.copytree(drafts["eagle3"], path)
    cfg = json.load(open(path / "config.json"))
    assert cfg.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    json.dump(cfg, open(path / "config.json", "w"))
    p = _with_draft(target, str(path))
    n = target.config.num_layers
    assert n == 2 and p.draft.config.aux_layers == (2, 1, 1)
    assert p.draft.config.target_layers == (1, 2)
    out = jspec.generate(p, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert out.tokens == [hf_greedy(q, 12) for q in PROMPTS]


def test_spec_loop_no_transfer_no_retrace(with_draft, monkeypatch, fresh_compiles):
    p = with_draft("eagle3")
    monkeypatch.setattr(programs, "generate_jit", jax.jit(chex.assert_max_traces(programs.generate_fn, n=1),
                                                      static_argnums=0))
    chex.clear_trace_counter()
    spec = jspec.SpecConfig(num_steps=2)
    first = jspec.generate(p, PROMPTS, max_new_tokens=10, stop_token_ids=[], spec=spec)
    with jax.transfer_guard("disallow"):
        again = jspec.generate(p, PROMPTS[::-1], max_new_tokens=[3, 9, 10], stop_token_ids=[2], spec=spec)
    assert again.timing["compile_s"] == 0
    assert again.tokens[2] == first.tokens[0][: len(again.tokens[2])]


@pytest.mark.slow
def test_bad_spec_configurations(target, with_draft, perm, tmp_path):
    with pytest.raises(ValueError, match="num_draft_tokens must be num_steps\\+1 = 4"):
        jspec.SpecConfig(num_steps=3, topk=1, num_draft_tokens=6)
    with pytest.raises(ValueError, match="num_steps"):
        jspec.SpecConfig(num_steps=0)
    with pytest.raises(ValueError, match="sample_drafts is for chains"):
        jspec.SpecConfig(num_steps=3, topk=2, sample_drafts=True)
    # A draft built for another target: hidden size and vocabulary checks.
    with pytest.raises(ValueError, match="hidden size"):
        jspec.load(perm["target"].replace("target", "target"), draft=_other_width_eagle(tmp_path))
    with pytest.raises(ValueError, match="vocab"):
        _with_draft(target, _other_vocab_model(tmp_path))


def _other_width_eagle(tmp_path):
    import tiny_models
    t = str(tmp_path / "wide_target")
    tiny_models.make_model(t, "llama", hidden=96, heads=4, kv_heads=2, layers=4)
    d = str(tmp_path / "wide_eagle")
    tiny_models.make_random_draft(d, "eagle", jspec.load(t), seed=3)
    return d


def _other_vocab_model(tmp_path):
    import tiny_models
    d = str(tmp_path / "vocab_draft")
    tiny_models.make_model(d, "llama", vocab=320, layers=1)
    return d


def test_draft_format_errors(target, drafts, tmp_path):
    import json
    import os

    from jspec import safetensors_io
    src = drafts["eagle3_reduced"]

    def copy(name, edit_tensors=None, edit_cfg=None):
        dst = tmp_path / name
        dst.mkdir()
        cfg = json.load(open(os.path.join(src, "config.json")))
        if edit_cfg:
            edit_cfg(cfg)
        json.dump(cfg, open(dst / "config.json", "w"))
        t = {k: v for k, v in safetensors_io.load(os.path.join(src, "model.safetensors")).items()}
        if edit_tensors:
            edit_tensors(t)
        safetensors_io.save(str(dst / "model.safetensors"), t)
        return str(dst)

    with pytest.raises(ValueError, match="reduced vocabulary .* no 'd2t'"):
        _with_draft(target, copy("no_d2t", lambda t: t.pop("d2t")))
    with pytest.raises(ValueError, match="unknown draft architecture"):
        _with_draft(target, copy("arch", lambda t: [t.pop(k) for k in list(t) if k.startswith("midlayer")],
                                 lambda c: c.update(architectures=["BertModel"])))
    with pytest.raises(ValueError, match="target hidden size"):
        _with_draft(target, copy("dt", None, lambda c: c.update(target_hidden_size=128)))
    with pytest.raises(ValueError, match="auxiliary layers"):
        _with_draft(target, copy("aux", None, lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 9]})))
