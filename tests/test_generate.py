"""Plain (non-speculative) generation: equality with transformers, caches, sampling, the
on-device loop's guarantees, and input checking."""
from __future__ import annotations

import json
import os
import shutil

import chex
import jax
import numpy as np
import pytest

import jspec
from jspec import sampling
from jspec.loop import programs
import tiny_models
from conftest import CACHES, PROMPTS


@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_equals_transformers(target, hf_greedy, cache):
    out = jspec.generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=[], cache=CACHES[cache])
    assert out.tokens == [hf_greedy(p, 12) for p in PROMPTS]
    assert out.finish_reasons == ["length"] * 3
    assert out.stats.accept_lengths == [[1] * 11] * 3  # prefill emits the first token


def test_a_pass_takes_at_most_max_batched_tokens(target, hf_greedy):
    """`Tuning.max_batched_tokens` bounds a prompt pass over its rows: 3 prompts of up to
    100 tokens (4 rows) with 128 a pass prefill 32 tokens a row a pass, 4 passes, and give
    transformers' tokens; the longest alone fits one pass. Bad values are refused."""
    from jspec import requests as rq
    from jspec.loop.plan import make_plan
    prompts = [np.random.default_rng(n).integers(3, tiny_models.VOCAB, n).tolist() for n in (100, 37, 64)]
    tuning = jspec.Tuning(max_batched_tokens=128)
    prog = jspec.compile(target, prompts, max_new_tokens=5, stop_token_ids=[], cache="paged", tuning=tuning)
    assert (prog.plan.batch, prog.plan.prefill_chunk, prog.plan.prompt_len) == (4, 32, 128)
    assert prog.run().tokens == [hf_greedy(p, 5) for p in prompts]
    for batch, block in ((prompts[:1], 0), (prompts, 0)):  # alone: one pass; no bound: whole prompts
        reqs = rq.check_requests(target, batch, 5, [], {})
        plan = make_plan(target, reqs.lens, reqs.max_new, 0, False, rq.cache_config("paged"), None,
                         tuning if len(batch) == 1 else jspec.Tuning(max_batched_tokens=0))
        assert plan.prefill_chunk == block
    with pytest.raises(ValueError, match="max_batched_tokens"):
        jspec.Tuning(max_batched_tokens=-1)


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


def test_batch_of_string_prompts_equals_transformers_per_prompt(target, hf_greedy):
    prompts = ["hello", "def f(x):\n    return", "a"]  # unequal lengths, padded in one batch
    out = jspec.generate(target, prompts, max_new_tokens=12, stop_token_ids=[])
    refs = [hf_greedy(list(target.tokenizer(p)["input_ids"]), 12) for p in prompts]
    assert out.tokens == refs
    assert out.text == [target.tokenizer.decode(r, skip_special_tokens=True) for r in refs]
    assert out.finish_reasons == ["length"] * 3


def test_greedy_with_every_bias_equals_transformers(tmp_path):
    """Llama with attention (q/k/v/o) and MLP biases, all random (as are the norm weights)."""
    model = tiny_models.make_model(str(tmp_path), "llama", attention_bias=True, mlp_bias=True, seed=3)
    p = jspec.load(str(tmp_path))
    assert p.config.qkv_bias and p.config.o_bias and p.config.mlp_bias
    out = jspec.generate(p, PROMPTS[:2], max_new_tokens=6, stop_token_ids=[])
    assert out.tokens == [tiny_models.hf_greedy(model, q, 6) for q in PROMPTS[:2]]


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
    # A prompt longer than the cache is refused before compiling: test_bad_input_fails_before_compiling.


def test_sampling_no_recompile_no_transfer_and_seeds(target, monkeypatch, fresh_compiles):
    # Count traces of the loop: new sampling values reuse the sampling program; greedy
    # requests have their own (without the sampling steps), compiled once.
    monkeypatch.setattr(programs, "generate_jit", jax.jit(chex.assert_max_traces(programs.generate_fn, n=2),
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
    assert b.timing["compile_s"] == 0 and c.timing["compile_s"] == 0 and g.timing["compile_s"] > 0
    # A greedy Compiled takes sampled requests: its sampling twin is the program above.
    prog = jspec.compile(target, PROMPTS, **kw)
    assert not prog.plan.sampling and prog.compile_s == 0
    again = prog.run(temperature=[0.7, 1.0, 1.3], top_k=[0, 5, 50], top_p=[1.0, 0.9, 0.5], seed=[1, 2, 3])
    assert prog.plan.sampling and again.tokens == a.tokens and again.timing["compile_s"] == 0
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


def test_filter_logits_top_k_top_p():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3, np.float32))
    x = sampling.filter_logits(logits, np.array([2, 0, 0]), np.array([1.0, 0.6, 0.71], np.float32),
                               np.zeros(3, np.float32))
    kept = np.isfinite(np.asarray(x))
    assert kept.tolist() == [[True, True, False, False, False], [True, True, False, False, False],
                             [True, True, True, False, False]]


# ------------------------------------------------------------------------------ bad input

@pytest.fixture
def no_compiling(monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled despite bad input")
    monkeypatch.setattr(programs.generate_jit, "lower", no_compile)


BAD_INPUTS = [
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
    (dict(prompt=[1, 2], min_p=1.5), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(prompt=[1, 2], repetition_penalty=0.0), ValueError, "repetition_penalty must be finite and > 0"),
    (dict(prompt=[1, 2], presence_penalty=float("inf")), ValueError, "presence_penalty must be finite"),
    (dict(prompt=[1, 2], frequency_penalty=[0.1, 0.2]), ValueError, "frequency_penalty has 2 entries for 1 prompts"),
    (dict(prompt=[1, 2], top_q=0.5), TypeError, "unexpected argument 'top_q'"),
    (dict(prompt=[1, 2], stop_token_ids=[999]), ValueError, "stop token id 999"),
    (dict(prompt=[1, 2], cache="weird"), ValueError, "CacheConfig.kind"),
    (dict(prompt=[1, 2], cache=5), TypeError, "cache must be"),
    (dict(prompt=[1, 2], spec="fast"), TypeError, "spec must be"),
    (dict(prompt=[1, 2], spec=jspec.SpecConfig(num_steps=3)), ValueError, "no draft"),
    # A prompt longer than the cache (or exactly as long: no room for a token).
    (dict(prompt=PROMPTS[0], cache=jspec.CacheConfig("dense", max_len=5)), ValueError,
     "prompt 0 has 5 tokens, which does not fit a cache of max_len=5"),
    (dict(prompt=[PROMPTS[1], PROMPTS[2]], cache=jspec.CacheConfig("dense", max_len=16)), ValueError,
     "prompt 1 has 17 tokens, which does not fit a cache of max_len=16"),
    (dict(prompt=PROMPTS[2], cache=jspec.CacheConfig("paged", page_size=2, num_pages=4)), ValueError,
     r"prompt 0 needs \d+ pages of 2 tokens but the pool has num_pages=4"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_fails_before_compiling(target, no_compiling, kw, exc, msg):
    kw = dict(kw)
    prompt = kw.pop("prompt")
    with pytest.raises(exc, match=msg):
        jspec.generate(target, prompt, **kw)


def test_bad_params_fail_before_compiling(target, no_compiling):
    with pytest.raises(TypeError, match="jspec.load"):
        jspec.generate({"weights": 1}, [1, 2])
    no_tok = jspec.Params(config=target.config, weights=target.weights)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        jspec.generate(no_tok, "text")
    with pytest.raises(ValueError):
        jspec.CacheConfig("paged", page_size=0)


def test_compile_once_run_many(target, hf_greedy, monkeypatch, fresh_compiles):
    """jspec.compile compiles once; run() takes new prompts, limits and seeds that fit
    the compiled shape without tracing again, and refuses ones that do not fit."""
    monkeypatch.setattr(programs, "generate_jit", jax.jit(chex.assert_max_traces(programs.generate_fn, n=1),
                                                      static_argnums=0))
    chex.clear_trace_counter()
    prog = jspec.compile(target, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    assert prog.compile_s > 0 and prog.plan.batch == 4 and prog.plan.max_rounds == 16
    first = prog.run()
    assert first.tokens == [hf_greedy(p, 12) for p in PROMPTS] and first.timing["compile_s"] > 0
    again = prog.run(PROMPTS[::-1][:2], max_new_tokens=[5, 12], stop_token_ids=[])
    assert again.tokens == [hf_greedy(PROMPTS[2], 5), hf_greedy(PROMPTS[1], 12)]
    assert again.timing["compile_s"] == 0
    one = prog.run(PROMPTS[0], max_new_tokens=3, stop_token_ids=[])  # a single prompt: unbatched
    assert one.tokens == hf_greedy(PROMPTS[0], 3)
    for kw, msg in [(dict(prompt=PROMPTS * 2), "6 prompts"),
                    (dict(prompt=[list(range(1, 40))]), "a prompt of 39 tokens"),
                    (dict(max_new_tokens=40), "max_new_tokens=40")]:
        with pytest.raises(ValueError, match=msg):
            prog.run(**kw)


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_dynamic_rope_scaling_is_refused(llama_dir, tmp_path, style):
    """Dynamic (NTK) RoPE scaling is not implemented: loading says so instead of silently
    running default RoPE. Both the transformers >= 5 key and the older rope_scaling one."""
    d = str(tmp_path / "dynamic")
    shutil.copytree(llama_dir[0], d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.pop("rope_parameters", None)
    if style == "rope_parameters":
        cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    else:
        cfg["rope_scaling"], cfg["rope_theta"] = {"type": "dynamic", "factor": 2.0}, 10000.0
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"unsupported rope scaling type 'dynamic' \(supported: default, linear, "
                                         r"llama3, yarn\)"):
        jspec.load(d)
