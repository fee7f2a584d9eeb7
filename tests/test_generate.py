"""Plain (non-speculative) generation: equality with transformers, caches, sampling, the
on-device loop's guarantees, and input checking."""
from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

import jspec
from jspec import api
from jspec import sampling
from jspec.spec import loop
from conftest import PROMPTS

CACHES = {"dense": "dense", "paged1": jspec.CacheConfig("paged", page_size=1),
          "paged16": jspec.CacheConfig("paged", page_size=16)}


@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_equals_transformers(target, hf_greedy, cache):
    out = jspec.generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=[], cache=CACHES[cache])
    assert out.tokens == [hf_greedy(p, 12) for p in PROMPTS]
    assert out.finish_reasons == ["length"] * 3
    assert out.stats.accept_lengths == [[1] * 11] * 3  # prefill emits the first token


def test_string_prompt_single_and_stop_token(target, hf_greedy):
    prompt = "hello"
    ids = list(target.tokenizer(prompt)["input_ids"])
    ref = hf_greedy(ids, 10)
    stop = ref[4]
    first = ref.index(stop)
    out = jspec.generate(target, prompt, max_new_tokens=10, stop_token_ids=[stop])
    assert out.tokens == ref[: first + 1]  # the stop token is included
    assert out.finish_reasons == "stop"
    assert out.text == target.tokenizer.decode(out.tokens, skip_special_tokens=True)
    assert out.timing["new_tokens"] == len(out.tokens) and out.timing["tokens_per_s"] > 0


def test_cache_full_ends_only_that_request(target, hf_greedy):
    # 9 pages of 4 tokens: both requests cannot reach their full length.
    cache = jspec.CacheConfig("paged", page_size=4, num_pages=9)
    prompts = [PROMPTS[1], PROMPTS[2]]
    out = jspec.generate(target, prompts, max_new_tokens=12, stop_token_ids=[], cache=cache)
    assert "cache_full" in out.finish_reasons and "length" in out.finish_reasons
    for p, toks, why in zip(prompts, out.tokens, out.finish_reasons):
        ref = hf_greedy(p, 12)
        assert toks == ref[: len(toks)]  # never corrupt, only shorter
        assert (len(toks) == 12) == (why == "length")


def test_dense_max_len_limits_and_errors(target, hf_greedy):
    out = jspec.generate(target, PROMPTS[0], max_new_tokens=12, stop_token_ids=[],
                         cache=jspec.CacheConfig("dense", max_len=10))
    assert out.finish_reasons == "cache_full"
    assert len(PROMPTS[0]) + len(out.tokens) <= 10
    assert out.tokens == hf_greedy(PROMPTS[0], 12)[: len(out.tokens)]
    with pytest.raises(ValueError, match="does not fit a cache of max_len=5"):
        jspec.generate(target, PROMPTS[0], cache=jspec.CacheConfig("dense", max_len=5))
    with pytest.raises(ValueError, match="pages"):
        jspec.generate(target, PROMPTS[2], cache=jspec.CacheConfig("paged", page_size=2, num_pages=4))


def test_sampling_no_recompile_no_transfer_and_seeds(target, monkeypatch):
    # Count traces of the loop: new sampling values must reuse the one compiled program.
    api._COMPILED.clear()
    monkeypatch.setattr(loop, "generate_jit", jax.jit(chex.assert_max_traces(loop.generate_fn, n=1),
                                                      static_argnums=0))
    chex.clear_trace_counter()
    kw = dict(max_new_tokens=8, stop_token_ids=[])
    a = jspec.generate(target, PROMPTS, temperature=[0.7, 1.0, 1.3], top_k=[0, 5, 50], top_p=[1.0, 0.9, 0.5],
                       seed=[1, 2, 3], **kw)
    with jax.transfer_guard("disallow"):
        b = jspec.generate(target, PROMPTS, temperature=[0.7, 1.0, 1.3], top_k=[0, 5, 50],
                           top_p=[1.0, 0.9, 0.5], seed=[1, 2, 3], **kw)
        c = jspec.generate(target, PROMPTS, temperature=0.9, top_k=0, top_p=1.0, seed=[7, 8, 9], **kw)
        g = jspec.generate(target, PROMPTS, temperature=[0.0, 0.0, 0.0], seed=[1, 2, 3], **kw)
    assert b.timing["compile_s"] == 0 and c.timing["compile_s"] == 0
    assert a.tokens == b.tokens  # same seeds, same output
    assert a.tokens != c.tokens
    greedy = jspec.generate(target, PROMPTS, **kw)
    assert g.tokens == greedy.tokens
    # A request's sample does not depend on its batch mates (a new shape: a new program).
    monkeypatch.undo()
    solo = jspec.generate(target, PROMPTS[1], temperature=1.0, top_k=5, top_p=0.9, seed=2, **kw)
    assert solo.tokens == a.tokens[1]


def test_top_k_1_and_tiny_top_p_are_greedy(target):
    kw = dict(max_new_tokens=6, stop_token_ids=[])
    greedy = jspec.generate(target, PROMPTS, **kw).tokens
    assert jspec.generate(target, PROMPTS, temperature=1.5, top_k=1, seed=3, **kw).tokens == greedy
    assert jspec.generate(target, PROMPTS, temperature=1.5, top_p=1e-6, seed=4, **kw).tokens == greedy


def test_sampled_tokens_follow_the_target_distribution(target):
    """First sampled token over 512 seeds vs softmax(logits / T): every token's frequency
    within 4.5 standard errors of its probability (a fixed-seed, deterministic check)."""
    n, temp = 512, 0.8
    out = jspec.generate(target, [PROMPTS[0]] * n, max_new_tokens=1, temperature=temp, seed=list(range(n)),
                         stop_token_ids=[])
    firsts = np.array([t[0] for t in out.tokens])
    p = np.asarray(jax.nn.softmax(jspec.logits(target, PROMPTS[0])[0, -1] / temp))
    freq = np.bincount(firsts, minlength=p.shape[0]) / n
    se = np.sqrt(p * (1 - p) / n) + 1e-3
    assert np.all(np.abs(freq - p) <= 4.5 * se), np.max(np.abs(freq - p) / se)


def test_filter_logits_top_k_top_p():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3, np.float32))
    x = sampling.filter_logits(logits, np.ones(3, np.float32), np.array([2, 0, 0]), np.array([1.0, 0.6, 0.71],
                                                                                          np.float32))
    kept = np.isfinite(np.asarray(x))
    assert kept.tolist() == [[True, True, False, False, False], [True, True, False, False, False],
                             [True, True, True, False, False]]


# ------------------------------------------------------------------------------ bad input

def test_bad_input_fails_before_compiling(target, monkeypatch, tmp_path):
    def no_compile(*a, **k):
        raise AssertionError("compiled despite bad input")
    monkeypatch.setattr(loop.generate_jit, "lower", no_compile)
    cases = [
        (dict(prompt=""), ValueError, "empty string"),
        (dict(prompt=[]), ValueError, "empty"),
        (dict(prompt=[[1, 2], []]), ValueError, r"prompt\[1\] is empty"),
        (dict(prompt=[1, 2, 300]), ValueError, "token id 300, outside the vocabulary"),
        (dict(prompt=[1, -1]), ValueError, "outside the vocabulary"),
        (dict(prompt=[1, 2.0]), TypeError, "must be ints"),
        (dict(prompt=[1, True]), TypeError, "must be ints"),
        (dict(prompt=3.5), TypeError, "prompt must be"),
        (dict(prompt=[1, 2], max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
        (dict(prompt=[1, 2], max_new_tokens=-3), ValueError, "max_new_tokens"),
        (dict(prompt=[1, 2], max_new_tokens="5"), TypeError, "max_new_tokens must be an int"),
        (dict(prompt=[[1, 2], [3]], max_new_tokens=[4]), ValueError, "1 entries for 2 prompts"),
        (dict(prompt=[1, 2], temperature=-1.0), ValueError, "temperature"),
        (dict(prompt=[1, 2], temperature=float("nan")), ValueError, "temperature"),
        (dict(prompt=[1, 2], top_p=0.0), ValueError, "top_p"),
        (dict(prompt=[1, 2], top_k=-1), ValueError, "top_k"),
        (dict(prompt=[1, 2], seed=1.5), TypeError, "seed"),
        (dict(prompt=[1, 2], stop_token_ids=[999]), ValueError, "stop token id 999"),
        (dict(prompt=[1, 2], cache="weird"), ValueError, "CacheConfig.kind"),
        (dict(prompt=[1, 2], cache=5), TypeError, "cache must be"),
        (dict(prompt=[1, 2], spec="fast"), TypeError, "spec must be"),
        (dict(prompt=[1, 2], spec=jspec.SpecConfig(num_steps=3)), ValueError, "no draft"),
    ]
    for kw, exc, msg in cases:
        prompt = kw.pop("prompt")
        with pytest.raises(exc, match=msg):
            jspec.generate(target, prompt, **kw)
    with pytest.raises(TypeError, match="jspec.load"):
        jspec.generate({"weights": 1}, [1, 2])
    no_tok = jspec.Params(config=target.config, weights=target.weights)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        jspec.generate(no_tok, "text")
    with pytest.raises(ValueError):
        jspec.CacheConfig("paged", page_size=0)
