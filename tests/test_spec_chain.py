"""EAGLE chain speculative decoding (topk = 1): exactness, acceptance, checks."""
from __future__ import annotations

import chex
import jax
import pytest

import jspec
from jspec import api
from jspec.spec import loop
from conftest import PROMPTS

CACHES = {"dense": "dense", "paged1": jspec.CacheConfig("paged", page_size=1),
          "paged16": jspec.CacheConfig("paged", page_size=16)}


def _with_draft(target, path):
    from jspec.drafts import load_draft
    return target.with_draft(load_draft(path, target))


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3_reduced", "standalone"])
def test_chain_greedy_equals_target(target, drafts, hf_greedy, kind, cache):
    p = _with_draft(target, drafts[kind])
    out = jspec.generate(p, PROMPTS, max_new_tokens=12, stop_token_ids=[], cache=CACHES[cache],
                         spec=jspec.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4))
    assert out.tokens == [hf_greedy(q, 12) for q in PROMPTS]
    assert all(1 <= a <= 4 for row in out.stats.accept_lengths for a in row)


@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("kind", ["eagle3_reduced", "standalone"])
def test_chain_steps(target, drafts, hf_greedy, kind, steps):
    p = _with_draft(target, drafts[kind])
    out = jspec.generate(p, PROMPTS, max_new_tokens=12, stop_token_ids=[], spec=jspec.SpecConfig(num_steps=steps))
    assert out.tokens == [hf_greedy(q, 12) for q in PROMPTS]


def _pi_continuation(pi, prompt, n):
    out, t = [], prompt[-1]
    for _ in range(n):
        t = int(pi[t])
        out.append(t)
    return out


@pytest.mark.parametrize("kind,steps,cache", [("eagle", 1, "dense"), ("eagle", 3, "paged1"), ("eagle", 5, "paged16"),
                                              ("eagle3", 3, "dense"), ("standalone", 5, "paged1")])
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
    assert max(out.stats.accept_lengths[0]) == api.DEFAULT_SPEC.num_steps + 1


def test_spec_loop_no_transfer_no_retrace(target, drafts, monkeypatch):
    p = _with_draft(target, drafts["eagle3"])
    api._COMPILED.clear()
    monkeypatch.setattr(loop, "generate_jit", jax.jit(chex.assert_max_traces(loop.generate_fn, n=1),
                                                      static_argnums=0))
    chex.clear_trace_counter()
    spec = jspec.SpecConfig(num_steps=2)
    first = jspec.generate(p, PROMPTS, max_new_tokens=10, stop_token_ids=[], spec=spec)
    with jax.transfer_guard("disallow"):
        again = jspec.generate(p, PROMPTS[::-1], max_new_tokens=[3, 9, 10], stop_token_ids=[2], spec=spec)
    assert again.timing["compile_s"] == 0
    assert again.tokens[2] == first.tokens[0][: len(again.tokens[2])]


def test_bad_spec_configurations(target, drafts, perm, tmp_path):
    with pytest.raises(ValueError, match="num_draft_tokens must be num_steps\\+1 = 4"):
        jspec.SpecConfig(num_steps=3, topk=1, num_draft_tokens=6)
    with pytest.raises(ValueError, match="num_steps"):
        jspec.SpecConfig(num_steps=0)
    p = _with_draft(target, drafts["eagle3"])
    with pytest.raises(ValueError, match="greedy-only"):
        jspec.generate(p, PROMPTS[0], temperature=0.5)
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
