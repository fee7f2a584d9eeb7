"""The engine through its Pallas kernels (interpret mode on CPU) equals the reference path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.cache import kv as kvc
from jspec.cache.layout import CacheLayout, make_meta
from conftest import PROMPTS


@pytest.mark.slow
def test_model_through_pallas_kernels_equals_reference(target, monkeypatch, fresh_compiles):
    """Greedy generation with every kernel forced to Pallas (interpret) equals the
    reference path token for token (float32)."""
    ref = jspec.generate(target, PROMPTS[:2], max_new_tokens=5, stop_token_ids=[])
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    from jspec.kernels.attention import decode as decode_attention
    calls = []
    real = decode_attention.paged_decode_attention
    monkeypatch.setattr(decode_attention, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    jspec.clear_caches()  # JSPEC_KERNELS is read when a function is traced
    got = jspec.generate(target, PROMPTS[:2], max_new_tokens=5, stop_token_ids=[])
    assert got.tokens == ref.tokens
    assert calls
    monkeypatch.setenv("JSPEC_KERNELS", "reference")
    lg_ref = np.asarray(jspec.logits(target, PROMPTS[0]))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    jax.clear_caches()
    np.testing.assert_allclose(np.asarray(jspec.logits(target, PROMPTS[0])), lg_ref, atol=1e-5)
    jax.clear_caches()


def test_tuning_reaches_the_attention_kernel(target, with_draft, monkeypatch):
    """A decoding step of the target and of an EAGLE-3 head hands `tuning.attention` to the
    attention kernel of every layer (traced with the kernels forced; the target's two layers
    are one traced body, `jspec.models.layers.call_layer`)."""
    from jspec.kernels.attention.decode import AttentionTiles
    from jspec.tuning import Tuning
    from jspec.kernels.attention import decode as decode_attention
    from jspec.models.llama import LLAMA
    seen = []
    real = decode_attention.paged_decode_attention
    monkeypatch.setattr(decode_attention, "paged_decode_attention",
                        lambda *a, **k: seen.append(k.get("tiles")) or real(*a, **k))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    tuning = Tuning(attention=AttentionTiles(block_k=32, max_rows=16))
    p = with_draft("eagle3")
    c, d = p.config, p.draft.config
    layout = CacheLayout(paged=False, capacity=16)
    meta = make_meta(layout, None, positions=jnp.full((1, 1), 3), prefix_len=jnp.full((1,), 3),
                     local_mask=jnp.ones((1, 1, 1), bool), write_valid=jnp.ones((1, 1), bool))
    tokens = jnp.ones((1, 1), jnp.int32)
    jax.make_jaxpr(lambda w, cache: LLAMA.forward(c, w, tokens, cache, meta, tuning=tuning))(
        p.weights, LLAMA.cache_kind(c).init(layout, 1))
    assert seen == [tuning.attention]  # the layers' one body, traced under the forced kernels
    feats = jnp.zeros((1, 1, d.hidden_size), c.jnp_dtype)  # its own previous hidden
    jax.make_jaxpr(lambda tw, dw, cache: d.forward(c, tw, dw, tokens, feats, cache, meta, False, tuning=tuning))(
        p.weights, p.draft.weights, d.cache_kind().init(layout, 1))
    assert seen == [tuning.attention] * 2


def _parked_case(B, T, prefix):
    """A dense cache with T new tokens written after `prefix` [B], their queries parked."""
    H, Hkv, Dh, S = 6, 2, 16, 40  # 3 query heads per kv head; T * 6 heads fill slots unevenly
    rng = np.random.default_rng(B * 10 + T)
    buf = jnp.asarray(rng.standard_normal((B, S + 1, 2, Hkv, Dh)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, T, H, Dh)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((B, T, 2, Hkv, Dh)), jnp.float32)
    prefix = jnp.asarray(prefix, jnp.int32)
    pos = prefix[:, None] + jnp.arange(T)[None]
    meta = make_meta(CacheLayout(paged=False, capacity=S), None, positions=pos, prefix_len=prefix,
                     local_mask=jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0),
                     write_valid=jnp.ones((B, T), bool), q_room=True)
    rows, index = kvc.with_queries(new, q, meta, buf)
    assert rows.shape[1] == T + kvc.query_slots(T, H, Hkv)
    return q, meta, kvc.write_kv(buf, rows, index, True), kvc.write_kv(buf, new, meta.write_index, True)


@pytest.mark.parametrize("B,T,prefix", [pytest.param(1, 1, [9], marks=pytest.mark.slow), (1, 3, [20]),
                                        pytest.param(3, 2, [0, 17, 30], marks=pytest.mark.slow)])
def test_parked_queries_equal_passed_queries(B, T, prefix):
    """The kernel reading queries parked in the cache (after the local block) gives what
    it gives with the queries passed in, and the parking leaves every key slot the
    attention reads untouched (batch 1: one block update; batch 3: a scatter)."""
    from jspec.kernels.attention import decode as da
    q, meta, parked, plain = _parked_case(B, T, prefix)
    got = da.paged_decode_attention(q, parked, meta, scale=0.25, interpret=True, q_in_cache=True)
    want = da.paged_decode_attention(q, plain, meta, scale=0.25, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for b, p in enumerate(prefix):
        np.testing.assert_array_equal(np.asarray(parked[b, :p + T]), np.asarray(plain[b, :p + T]))


@pytest.mark.parametrize("q_in_cache", [True, False])
def test_kernel_takes_the_cache_once_in_its_own_shape(q_in_cache):
    """The compiled kernel (traced for the GPU, interpret off) gets the cache as one
    operand shaped [N, 2, Hkv, Dh], parked queries or not: given a second time as a
    reshaped view, XLA copied each layer's cache twice per tree round on the H200."""
    from jspec.kernels.attention import decode as da
    q, meta, parked, _ = _parked_case(1, 3, [20])
    jaxpr = jax.make_jaxpr(lambda q, kv: da.paged_decode_attention(
        q, kv, meta, scale=0.25, interpret=False, q_in_cache=q_in_cache))(q, parked)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1
    shapes = [v.aval.shape for v in calls[0].invars]
    big = [s for s in shapes if np.prod(s) == parked.size]  # the cache, however viewed
    assert big == [(parked.shape[0] * parked.shape[1],) + parked.shape[2:]], shapes


@pytest.mark.slow
def test_spec_and_batch1_through_pallas_kernels_park_queries(target, with_draft, hf_greedy, monkeypatch,
                                                              fresh_compiles):
    """Batch-1 decoding, a chain and a tree with the kernels forced to Pallas (interpret)
    park their queries in the dense cache and still equal the target's greedy output."""
    from jspec.kernels.attention import decode as decode_attention
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    parked = []
    real = decode_attention.paged_decode_attention
    monkeypatch.setattr(decode_attention, "paged_decode_attention",
                        lambda *a, **k: parked.append(k.get("q_in_cache")) or real(*a, **k))
    jspec.clear_caches()
    out = jspec.generate(target, PROMPTS[0], max_new_tokens=6, stop_token_ids=[])
    assert out.tokens == hf_greedy(PROMPTS[0], 6)
    p = with_draft("eagle3")
    for spec, prompts in [(jspec.SpecConfig(num_steps=3, topk=1), PROMPTS[:1]),
                          (jspec.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), PROMPTS[:2])]:
        out = jspec.generate(p, prompts, max_new_tokens=8, stop_token_ids=[], spec=spec)
        assert out.tokens == [hf_greedy(x, 8) for x in prompts]
    assert parked and all(parked)
