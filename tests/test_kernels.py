"""The Pallas decode/verify attention kernel (interpret mode) against attention_reference."""
from __future__ import annotations

import functools
import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec.cache import kv as kvc
from jspec.kernels import decode_attention as da

attn = importlib.import_module("jspec.kernels.attention")  # the package re-exports a function of that name


def _tree_mask(rng, Tl):
    """A random tree over the Tl local slots (node j's parent < j): [Tl, Tl] ancestor-or-self
    mask and each node's depth."""
    parent = [-1] + [int(rng.integers(-1, j)) for j in range(1, Tl)]
    mask = np.eye(Tl, dtype=bool)
    depth = np.zeros(Tl, np.int32)
    for j in range(1, Tl):
        if parent[j] >= 0:
            mask[j] |= mask[parent[j]]
            depth[j] = depth[parent[j]] + 1
    return mask, depth


def make_case(seed, *, B=3, T=4, Tl=None, Hkv=2, G=2, Dh=16, S=64, page_size=0, prefix=None,
              dtype=jnp.float32):
    """q, k_buf, v_buf, meta for T new tokens (the last T of Tl local slots, a random tree)
    after ragged prefixes; a paged cache gets shuffled pages and unallocated table tails."""
    rng = np.random.default_rng(seed)
    Tl = T if Tl is None else Tl
    if prefix is None:
        prefix = rng.integers(0, S - Tl + 1, size=B)
    prefix = np.asarray(prefix, np.int32)
    masks, depths = zip(*(_tree_mask(rng, Tl) for _ in range(B)))
    local_mask = np.stack(masks)[:, Tl - T:]  # [B, T, Tl]
    local_pos = prefix[:, None] + np.stack(depths)  # [B, Tl]
    positions = local_pos[:, Tl - T:]
    H = Hkv * G
    q = rng.standard_normal((B, T, H, Dh))
    if page_size:
        Gp = -(-S // page_size)
        num_pages = B * Gp + 3
        perm = rng.permutation(num_pages)
        table = np.full((B, Gp), num_pages, np.int32)
        for b in range(B):
            used = -(-(prefix[b] + Tl) // page_size)
            table[b, :used] = perm[b * Gp:b * Gp + used]
        shape = (num_pages, page_size, Hkv, Dh)
    else:
        table = None
        shape = (B, S, Hkv, Dh)
    k = rng.standard_normal(shape)
    v = rng.standard_normal(shape)
    meta = kvc.AttnMeta(
        positions=jnp.asarray(positions, jnp.int32), prefix_len=jnp.asarray(prefix),
        local_mask=jnp.asarray(local_mask), local_positions=jnp.asarray(local_pos, jnp.int32),
        write_index=jnp.zeros((B, T), jnp.int32),
        page_table=None if table is None else jnp.asarray(table), page_size=page_size)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), meta


@functools.partial(jax.jit, static_argnames=("window", "block_k", "num_splits"))
def _kernel(q, k, v, meta, *, window=0, block_k=16, num_splits=None):
    return da.paged_decode_attention(q, k, v, meta, window=window, scale=q.shape[-1] ** -0.5,
                                     interpret=True, block_k=block_k, num_splits=num_splits)


@functools.partial(jax.jit, static_argnames=("window",))
def _reference(q, k, v, meta, *, window=0):
    return da.decode_attention_reference(q, k, v, meta, window=window, scale=q.shape[-1] ** -0.5)


def check(q, k, v, meta, *, window=0, block_k=16, num_splits=None, atol=1e-5, rtol=1e-5):
    out = _kernel(q, k, v, meta, window=window, block_k=block_k, num_splits=num_splits)
    ref = _reference(q, k, v, meta, window=window)
    chex.assert_equal_shape([out, q])
    assert out.dtype == q.dtype
    chex.assert_trees_all_close(out.astype(jnp.float32), ref.astype(jnp.float32), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- fixed cases

CASES = [  # (page_size, T, G, num_splits)
    (0, 1, 1, None), (0, 4, 4, 1), (0, 16, 1, 3), (0, 16, 4, None),
    (1, 1, 4, 2), (1, 4, 1, None),
    (3, 4, 4, None), (3, 16, 1, 2),
    (16, 1, 1, 1), (16, 4, 4, 3), (16, 16, 4, None),
]


@pytest.mark.parametrize("page_size,T,G,num_splits", CASES)
def test_matches_reference(page_size, T, G, num_splits):
    # Row 0: empty prefix; row 1: ragged; row 2: the local block ends the cache.
    S = 72
    q, k, v, meta = make_case(page_size * 100 + T * 10 + G, T=T, G=G, S=S, page_size=page_size,
                              prefix=[0, 23, S - T])
    check(q, k, v, meta, num_splits=num_splits)


def test_dense_capacity_not_multiple_of_block():
    q, k, v, meta = make_case(1, B=2, T=3, S=37, prefix=[34, 5])  # S % 16 != 0, full row 0
    check(q, k, v, meta, block_k=16)
    check(q, k, v, meta, block_k=64)  # one block larger than the cache


def test_local_block_longer_than_new_tokens():  # tree drafting: Tl > T
    q, k, v, meta = make_case(2, B=2, T=3, Tl=9, S=48, page_size=3, prefix=[0, 39])
    check(q, k, v, meta, num_splits=2)


@pytest.mark.parametrize("page_size", [0, 3])
@pytest.mark.parametrize("window", [5, 40])
def test_sliding_window(page_size, window):
    q, k, v, meta = make_case(3, B=3, T=4, S=96, page_size=page_size, prefix=[0, 50, 92])
    check(q, k, v, meta, window=window, num_splits=2)


@pytest.mark.parametrize("page_size", [0, 16])
def test_bfloat16(page_size):
    q, k, v, meta = make_case(4, T=4, G=4, S=80, page_size=page_size, prefix=[0, 31, 76],
                              dtype=jnp.bfloat16)
    check(q, k, v, meta, atol=3e-2, rtol=3e-2)


def test_with_make_meta_and_allocated_pages():
    """The cache filled the way the engine does it: alloc_pages, make_meta, write_kv."""
    rng = np.random.default_rng(5)
    B, T, Hkv, G, Dh, P, Gp, num_pages = 2, 4, 2, 2, 16, 4, 8, 20
    prefix = jnp.array([9, 0], jnp.int32)
    cache = kvc.init_kv_cache(1, Hkv, Dh, jnp.float32, num_pages=num_pages, page_size=P)
    pages = kvc.init_page_state(B, Gp, num_pages)
    pages, ok = kvc.alloc_pages(pages, prefix + T, jnp.ones((B,), bool), P, Gp)
    assert bool(ok.all())
    pool = jnp.asarray(rng.standard_normal((num_pages, P, Hkv, Dh)), jnp.float32)
    cache = kvc.KVCache(k=(pool,), v=(pool * 0.5,))
    positions = prefix[:, None] + jnp.arange(T, dtype=jnp.int32)
    meta = kvc.make_meta(cache, positions=positions, prefix_len=prefix,
                         local_mask=jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T)),
                         write_valid=jnp.ones((B, T), bool), page_state=pages, page_size=P)
    k_new = jnp.asarray(rng.standard_normal((B, T, Hkv, Dh)), jnp.float32)
    k_buf = kvc.write_kv(cache.k[0], k_new, meta.write_index)
    v_buf = kvc.write_kv(cache.v[0], 2 * k_new, meta.write_index)
    q = jnp.asarray(rng.standard_normal((B, T, Hkv * G, Dh)), jnp.float32)
    check(q, k_buf, v_buf, meta)


# --------------------------------------------------------------------------- property test

@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_shapes(data):
    draw = data.draw
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    Tl = T + draw(st.integers(0, 3))
    Hkv = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 2, 4]))
    page_size = draw(st.sampled_from([0, 1, 2, 5, 8, 16]))
    S = Tl + draw(st.integers(0, 70))
    prefix = draw(st.lists(st.integers(0, S - Tl), min_size=B, max_size=B))
    window = draw(st.sampled_from([0, 0, 3, 17]))
    block_k = draw(st.sampled_from([16, 32]))
    num_splits = draw(st.sampled_from([None, 1, 2, 5]))
    q, k, v, meta = make_case(draw(st.integers(0, 2**16)), B=B, T=T, Tl=Tl, Hkv=Hkv, G=G, S=S,
                              page_size=page_size, prefix=prefix)
    check(q, k, v, meta, window=window, block_k=block_k, num_splits=num_splits)


# --------------------------------------------------------------------------- dispatch, errors

def test_dispatch_env(monkeypatch):
    q, k, v, meta = make_case(6, T=4, G=2, S=40, page_size=3)
    scale = q.shape[-1] ** -0.5
    ref = attn.attention_reference(q, None, None, k, v, meta, scale=scale)
    calls = []
    real = da.paged_decode_attention
    monkeypatch.setattr(da, "paged_decode_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for mode, used in [("reference", False), ("auto", jax.default_backend() == "gpu"),
                       ("pallas", True)]:
        monkeypatch.setenv("JSPEC_ATTENTION", mode)
        calls.clear()
        out = attn.attention(q, None, None, k, v, meta, scale=scale)
        assert bool(calls) == used, mode
        chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
    # Prefill never takes the kernel.
    pre = meta.replace(prefill=True, local_mask=meta.local_mask[:, :, -4:],
                       local_positions=meta.local_positions[:, -4:])
    k_new = jnp.ones((3, 4, 2, 16))
    calls.clear()
    attn.attention(q, k_new, k_new, None, None, pre, scale=scale)
    assert not calls
    monkeypatch.setenv("JSPEC_ATTENTION", "fast")
    with pytest.raises(ValueError, match="JSPEC_ATTENTION"):
        attn.attention(q, None, None, k, v, meta, scale=scale)


def test_validation():
    q, k, v, meta = make_case(7, B=2, T=2, G=2, S=32, page_size=4)
    call = functools.partial(da.paged_decode_attention, interpret=True, scale=1.0)
    call(q, k, v, meta)  # fine
    with pytest.raises(ValueError, match="prefill"):
        call(q, k, v, meta.replace(prefill=True))
    with pytest.raises(TypeError, match="dtype"):
        call(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), meta)
    with pytest.raises(TypeError, match="dtype"):
        call(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32), meta)
    with pytest.raises(ValueError, match="head_dim"):
        call(q[..., :12], k[..., :12], v[..., :12], meta)
    with pytest.raises(ValueError, match="multiple"):
        call(q[:, :, :3], k, v, meta)
    with pytest.raises(ValueError, match="differ"):
        call(q, k, v[:-1], meta)
    with pytest.raises(ValueError, match="block_k"):
        call(q, k, v, meta, block_k=24)
    with pytest.raises(ValueError, match="num_splits"):
        call(q, k, v, meta, num_splits=0)
    with pytest.raises(ValueError, match="window"):
        call(q, k, v, meta, window=-1)
    with pytest.raises(ValueError, match="page_table"):
        call(q, k, v, meta.replace(page_table=meta.page_table[:1]))
    with pytest.raises(ValueError, match="page_size"):
        call(q, k, v, meta.replace(page_size=8))
    with pytest.raises(ValueError, match="local_mask"):
        call(q, k, v, meta.replace(local_mask=meta.local_mask[:, :1]))
    with pytest.raises(TypeError, match="local_mask"):
        call(q, k, v, meta.replace(local_mask=meta.local_mask.astype(jnp.int32)))
    with pytest.raises(ValueError, match="batch"):
        call(q, k[:1, :32], v[:1, :32], meta.replace(page_table=None))
    assert da.is_supported(q, k, v, meta)
    assert not da.is_supported(q, k, v, meta.replace(prefill=True))
