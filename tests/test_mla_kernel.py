"""The Pallas MLA decode/verify kernel (interpret mode) against mla_attention_reference."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.cache import layout as lay
from jspec.cache.latent import cached_mla_attention
from jspec.tuning import DEFAULT_TUNING
from jspec.kernels.mla.decode import MlaDecodeTiles
from jspec.kernels.mla.output import MlaOutputTiles
from jspec.kernels import dispatch
from jspec.kernels.mla import attention as mla
from jspec.kernels.mla import decode as md
from jspec.kernels.mla import inputs as mi
from jspec.kernels.mla import output as mo
from jspec.kernels.meta import AttnMeta
from test_kernels import fast_jit, tree_mask, pallas_grids  # noqa: E402  (the GQA kernel tests' random tree, their jit)



def make_case(seed, *, B=3, T=1, Tl=None, H=4, Dc=32, Dr=16, S=64, page_size=0, prefix=None,
              dtype=jnp.float32):
    """q_lat [B,T,H,Dc], q_pe [B,T,H,Dr], a latent buffer and meta for T new tokens (the
    last T of Tl local slots, a random tree) after ragged prefixes; a paged pool gets
    shuffled pages, unallocated table tails and a trash page."""
    rng = np.random.default_rng(seed)
    Tl = T if Tl is None else Tl
    if prefix is None:
        prefix = rng.integers(0, S - Tl + 1, size=B)
    prefix = np.asarray(prefix, np.int32)
    masks, depths = zip(*(tree_mask(rng, Tl) for _ in range(B)))
    local_mask = np.stack(masks)[:, Tl - T:]  # [B, T, Tl]
    local_pos = prefix[:, None] + np.stack(depths)  # [B, Tl]
    if page_size:
        Gp = -(-S // page_size)
        num_pages = B * Gp + 3
        perm = rng.permutation(num_pages)
        table = np.full((B, Gp), num_pages, np.int32)  # num_pages: unallocated (the trash)
        for b in range(B):
            used = -(-(prefix[b] + Tl) // page_size)
            table[b, :used] = perm[b * Gp:b * Gp + used]
        shape = (num_pages + 1, page_size, Dc + Dr)
    else:
        table = None
        shape = (B, S, Dc + Dr)
    meta = AttnMeta(
        positions=jnp.asarray(local_pos[:, Tl - T:], jnp.int32), prefix_len=jnp.asarray(prefix),
        local_mask=jnp.asarray(local_mask), local_positions=jnp.asarray(local_pos, jnp.int32),
        write_index=jnp.zeros((B, T), jnp.int32),
        page_table=None if table is None else jnp.asarray(table), page_size=page_size)
    cast = lambda x: jnp.asarray(x, dtype)
    q_lat = cast(rng.standard_normal((B, T, H, Dc)))
    q_pe = cast(rng.standard_normal((B, T, H, Dr)))
    buf = cast(rng.standard_normal(shape))
    return q_lat, q_pe, buf, meta


def latent_scale(q_lat, q_pe):
    return (q_lat.shape[-1] + q_pe.shape[-1]) ** -0.5


def _kernel(q_lat, q_pe, buf, meta, **kw):
    return md.paged_mla_attention(q_lat, q_pe, buf, meta, scale=latent_scale(q_lat, q_pe),
                                  interpret=True, **kw)


def _reference(q_lat, q_pe, buf, meta):
    return md.mla_decode_reference(q_lat, q_pe, buf, meta, scale=latent_scale(q_lat, q_pe))


def check(q_lat, q_pe, buf, meta, *, atol=1e-5, rtol=1e-5, **kw):
    """The kernel against the reference; 16-bit inputs against the reference on their float32
    values (the yardstick; also, XLA:CPU of jax 0.10.2 runs no bf16 x bf16 -> f32 batched
    dot of the reference's value product's layout)."""
    out = fast_jit(_kernel, q_lat, q_pe, buf, meta, **kw)
    up = lambda x: x.astype(jnp.float32)
    ref = fast_jit(_reference, up(q_lat), up(q_pe), up(buf), meta)
    assert out.dtype == jnp.float32
    chex.assert_shape(out, q_lat.shape)
    chex.assert_trees_all_close(out, ref, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- fixed cases

CASES = [  # (page_size, T, H, Dc, num_splits); page_size 0: dense; T > 1: a tree block
    (0, 1, 4, 32, None), (0, 4, 2, 64, 3),
    (1, 1, 2, 32, 2), (1, 3, 4, 32, None),
    (16, 1, 8, 64, 1), (16, 5, 4, 32, 2),  # 20 query rows: two row blocks of 16, padded
    (64, 4, 4, 32, None),
]


@pytest.mark.parametrize("page_size,T,H,Dc,num_splits", CASES)
def test_matches_reference(page_size, T, H, Dc, num_splits):
    # Row 0: empty prefix; row 1: ragged; row 2: the local block ends the cache.
    S = 128 if page_size == 64 else 72
    q_lat, q_pe, buf, meta = make_case(page_size * 100 + T * 10 + H, T=T, H=H, Dc=Dc, S=S,
                                       page_size=page_size, prefix=[0, 23, S - T])
    check(q_lat, q_pe, buf, meta, num_splits=num_splits, block_k=16, block_rows=16)


@pytest.mark.parametrize("page_size", [0, 16])
def test_bfloat16(page_size):
    q_lat, q_pe, buf, meta = make_case(4, T=4, H=4, S=80, page_size=page_size, prefix=[0, 31, 76],
                                       dtype=jnp.bfloat16)
    check(q_lat, q_pe, buf, meta, num_splits=2, block_k=16, atol=2e-2, rtol=2e-2)


def test_deepseek_dims():
    """The real latent rank and rope dim (512, 64), a tree of 3 over a paged pool, bf16:
    default tiles (96 query rows in all: three row blocks of 16 a batch row), and 48 query
    rows padded to one block of 64."""
    q_lat, q_pe, buf, meta = make_case(5, B=2, T=3, H=16, Dc=512, Dr=64, S=96, page_size=16,
                                       prefix=[70, 5], dtype=jnp.bfloat16)
    check(q_lat, q_pe, buf, meta, num_splits=2, atol=2e-2, rtol=2e-2)
    check(q_lat, q_pe, buf, meta, num_splits=2, block_rows=64, atol=2e-2, rtol=2e-2)


def test_default_block_rows():
    """16 query rows a program up to `small_rows_max` rows in all (512), then `block_rows`
    (64; float32: 32); a tuning's tiles move both."""
    t = DEFAULT_TUNING.mla_decode
    assert (t.small_rows_max, t.block_rows) == (512, 64)
    assert md.default_block_rows(512, 2) == md.MIN_ROWS == 16
    assert md.default_block_rows(513, 2) == 64
    assert md.default_block_rows(4096, 4) == 32
    tiles = MlaDecodeTiles(small_rows_max=0, block_rows=128)
    assert md.default_block_rows(1, 2, tiles) == 128 and md.default_block_rows(1, 4, tiles) == 64


def test_dense_capacity_not_multiple_of_block():
    q_lat, q_pe, buf, meta = make_case(1, B=2, T=3, S=37, prefix=[34, 5])  # S % 16 != 0, full row 0
    check(q_lat, q_pe, buf, meta, block_k=16)
    check(q_lat, q_pe, buf, meta, block_k=64)  # one block larger than the cache


def test_local_block_longer_than_new_tokens():  # tree drafting: Tl > T
    q_lat, q_pe, buf, meta = make_case(2, B=2, T=3, Tl=9, S=48, page_size=3, prefix=[0, 39])
    check(q_lat, q_pe, buf, meta, num_splits=2, block_k=16)


def test_cached_mla_attention_engine_layout():
    """The pool filled the way the engine does it (alloc_pages, make_meta, the write inside
    cached_mla_attention): the forced kernel equals the reference."""
    B, T, H, Dc, Dr, P, Gp, num_pages = 2, 4, 4, 32, 16, 4, 8, 20

    def setup(key):
        kp, kn, kq, kr = jax.random.split(key, 4)
        prefix = jnp.array([9, 0], jnp.int32)
        buf = jax.random.normal(kp, (num_pages + 1, P, Dc + Dr))  # + the trash page
        pages = lay.init_page_state(B, Gp, num_pages)
        pages, ok = lay.alloc_pages(pages, prefix + T, jnp.ones((B,), bool), P, Gp)
        positions = prefix[:, None] + jnp.arange(T, dtype=jnp.int32)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        layout = lay.CacheLayout(paged=True, capacity=Gp * P, page_size=P, num_pages=num_pages)
        meta = lay.make_meta(layout, pages, positions=positions, prefix_len=prefix,
                             local_mask=causal, write_valid=jnp.ones((B, T), bool))
        return (jax.random.normal(kq, (B, T, H, Dc)), jax.random.normal(kr, (B, T, H, Dr)),
                jax.random.normal(kn, (B, T, Dc + Dr)), buf, meta, ok)

    q_lat, q_pe, new, buf, meta, ok = fast_jit(setup, jax.random.key(5))
    w_uv = jax.random.normal(jax.random.key(6), (H, 16, Dc))
    assert bool(ok.all())
    outs = {}
    for mode in ("reference", "pallas"):
        with dispatch.use_backend(mode):
            outs[mode] = fast_jit(lambda *a: cached_mla_attention(*a, scale=0.2),
                                   q_lat, q_pe, new, buf, meta, w_uv)
    chex.assert_shape(outs["pallas"][0], (B, T, H, 16))
    chex.assert_trees_all_close(outs["pallas"], outs["reference"], atol=1e-5, rtol=1e-5)
    # The new rows landed where make_meta put them.
    flat = outs["pallas"][1].reshape(-1, Dc + Dr)
    chex.assert_trees_all_close(flat[meta.write_index], new)


def test_fp8_latent_cache_is_read_widened():
    """An FP8 latent buffer (`CacheConfig(dtype="float8_e4m3fn")`) goes to the references
    even where the kernels are forced (they do not take it), dense and sparse
    (DeepSeek-V3.2's selected slots) and a prompt block's expanded form, and each equals
    the same reference over the buffer widened to float32 bit for bit (E4M3 values are
    exact in float32)."""
    from jspec.kernels.mla import prefill as mp
    q_lat, q_pe, buf, meta = make_case(7, T=2, page_size=4)
    fp8 = buf.astype(jnp.float8_e4m3fn)
    wide = fp8.astype(jnp.float32)
    H, Dc = q_lat.shape[2], q_lat.shape[3]
    w_uv = jax.random.normal(jax.random.key(1), (H, 8, Dc))
    w_uk = jax.random.normal(jax.random.key(2), (Dc, H, q_pe.shape[-1]))
    index = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), q_lat.shape[:2] + (5,))
    calls = {"dense": lambda b: mla.mla_attention(q_lat, q_pe, b, meta, w_uv, scale=0.3),
             "sparse": lambda b: mla.mla_attention(q_lat, q_pe, b, meta, w_uv, scale=0.3, index=index),
             "expanded": lambda b: mp.expanded_attention(q_pe, q_pe, b, meta, w_uk, w_uv, scale=0.3, block_k=8)}
    for name, call in calls.items():
        with dispatch.use_backend("pallas"):
            got = jax.jit(call)(fp8)
        with dispatch.use_backend("reference"):
            want = jax.jit(call)(wide)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
        assert float(jnp.abs(want - jax.jit(call)(buf)).max()) > 0, name  # the rounding shows


# --------------------------------------------------------------------------- merge + W_UV

def make_splits(seed, *, B=2, NS=3, T=2, H=3, R=None, Dc=32, Dv=16, dtype=jnp.float32):
    """Random MLA kernel splits (o, lse) with padding rows, rows that saw no key at all and
    splits that saw none, and a w_uv whose heads differ."""
    rng = np.random.default_rng(seed)
    R = 16 * -(-(T * H) // 16) if R is None else R
    o = rng.standard_normal((B, NS, R, Dc)).astype(np.float32)
    lse = rng.uniform(-3, 3, (B, NS, R)).astype(np.float32)
    lse[0, :, 1] = mo.NEG_INF  # row 1 of batch row 0 saw no key in any split
    o[0, :, 1] = 0.0
    if NS > 1:
        lse[1, 0, :] = mo.NEG_INF  # split 0 of batch row 1 saw no key
        o[1, 0, :] = 0.0
    w_uv = jnp.asarray(rng.standard_normal((H, Dv, Dc)), dtype)
    return jnp.asarray(o), jnp.asarray(lse), w_uv


@pytest.mark.parametrize("NS,T,H,Dv,block_n", [(1, 1, 4, 16, None), (3, 2, 3, 16, 8), (20, 1, 16, 32, 16),
                                               (5, 3, 2, 24, 16)])  # Dv 24: overlapping last tile
def test_mla_output_matches_reference(NS, T, H, Dv, block_n):
    o, lse, w_uv = make_splits(NS * 10 + T, NS=NS, T=T, H=H, Dv=Dv)
    out = fast_jit(functools.partial(mo.mla_output, num_tokens=T, block_n=block_n, interpret=True), o, lse, w_uv)
    ref = mo.mla_output_reference(o, lse, w_uv, num_tokens=T, dtype=w_uv.dtype)
    chex.assert_shape(out, (2, T, H, Dv))
    assert out.dtype == w_uv.dtype
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(out[0, 0, 1]).max()) == 0.0  # the row that saw nothing
    # The weights are per head: the same product with the heads' weights rolled differs.
    wrong = mo.mla_output_reference(o, lse, jnp.roll(w_uv, 1, axis=0), num_tokens=T, dtype=w_uv.dtype)
    assert float(jnp.abs(out - wrong).max()) > 1e-2


def test_mla_output_latent_chunks():
    """The latent walked in several chunks (a small `split_tile`) gives the reference's
    result; the chunk rule: 32 splits take V2-Lite's whole 512-wide latent in one step, 200
    splits 128-wide chunks."""
    assert mo.latent_chunk(19, 512) == 512 and mo.latent_chunk(200, 512) == 128 and mo.latent_chunk(3, 64) == 64
    tiles = MlaOutputTiles(split_tile=64, min_chunk=16)
    assert mo.latent_chunk(4, 64) == 64 and mo.latent_chunk(4, 64, tiles) == 16  # four chunks of 16
    o, lse, w_uv = make_splits(11, NS=4, T=2, H=3, Dc=64, Dv=16)
    out = fast_jit(functools.partial(mo.mla_output, num_tokens=2, interpret=True, tiles=tiles), o, lse, w_uv)
    ref = mo.mla_output_reference(o, lse, w_uv, num_tokens=2, dtype=w_uv.dtype)
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mla_output_bfloat16():
    """bf16 weights: the merged latent is rounded to bf16 before the product, as the
    reference does, and the result is bf16."""
    o, lse, w_uv = make_splits(3, NS=4, T=3, H=4, Dc=64, Dv=32, dtype=jnp.bfloat16)
    out = fast_jit(functools.partial(mo.mla_output, num_tokens=3, interpret=True), o, lse, w_uv)
    ref = mo.mla_output_reference(o, lse, w_uv, num_tokens=3, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    chex.assert_trees_all_close(out.astype(jnp.float32), ref.astype(jnp.float32), atol=3e-2, rtol=2e-2)


def test_mla_output_validation():
    o, lse, w_uv = make_splits(4)
    call = lambda o=o, lse=lse, w_uv=w_uv, num_tokens=2, **kw: mo.mla_output(o, lse, w_uv, num_tokens=num_tokens,
                                                                            interpret=True, **kw)
    with pytest.raises(ValueError, match="lse"):
        call(lse=lse[:, :1])
    with pytest.raises(ValueError, match="latent values"):
        call(w_uv=w_uv[..., :16])
    with pytest.raises(ValueError, match="rows"):
        call(num_tokens=6)
    with pytest.raises(ValueError, match="Dv"):
        call(w_uv=w_uv[:, :8])
    with pytest.raises(ValueError, match="power of two"):
        call(o=o[..., :24], w_uv=w_uv[..., :24])
    with pytest.raises(TypeError, match="float32"):
        call(o=o.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        call(w_uv=w_uv.astype(jnp.int32))
    with pytest.raises(ValueError, match="block_n"):
        call(block_n=12)
    with pytest.raises(ValueError, match="needs"):
        call(o=o[0])
    assert mo.is_supported(o, lse, w_uv, 2)
    many = jnp.zeros((17, 1, 16, 32), jnp.float32)  # batch rows of one token each
    assert DEFAULT_TUNING.mla_output.kernel_max_tokens == 16
    assert not mo.is_supported(many, many[..., 0], w_uv, 1)  # past the tokens it pays for: XLA's product
    assert mo.is_supported(many, many[..., 0], w_uv, 1, MlaOutputTiles(kernel_max_tokens=17))
    assert mo.is_supported(many[:16], many[:16, ..., 0], w_uv, 1)
    assert not mo.is_supported(many[:16], many[:16, ..., 0], w_uv, 1, MlaOutputTiles(kernel_max_tokens=15))


# --------------------------------------------------------------------------- mla_inputs


def make_inputs(seed, *, S=3, N=2, H=4, Dn=16, Dr=8, Dc=32, dtype=jnp.float32):
    """K splits of a projection [q | c | k_r], RoPE tables, the latent norm and W_UK."""
    rng = np.random.default_rng(seed)
    parts = jnp.asarray(rng.standard_normal((S, N, H * (Dn + Dr) + Dc + Dr)), jnp.float32)
    angle = rng.uniform(0, 6, (N, Dr // 2))
    cos, sin = (jnp.asarray(f(angle) * 1.2, jnp.float32) for f in (np.cos, np.sin))
    norm = jnp.asarray(1 + 0.2 * rng.standard_normal(Dc), dtype)
    w_uk = jnp.asarray(0.3 * rng.standard_normal((Dc, H, Dn)), dtype)
    return parts, cos, sin, norm, w_uk


def inputs_reference(parts, cos, sin, norm, w_uk, interleaved):
    Dc, H, Dn = w_uk.shape
    qkv = jnp.sum(parts, axis=0).astype(w_uk.dtype)
    Q = H * (Dn + 2 * cos.shape[1])
    return mi.mla_inputs_reference(qkv[:, :Q].reshape(qkv.shape[0], H, -1), qkv[:, Q:], cos, sin, norm, w_uk,
                                   interleaved=interleaved, eps=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype,block_c", [(jnp.float32, 8), (jnp.bfloat16, None)])
def test_mla_inputs_matches_reference(interleaved, dtype, block_c):
    """The absorbed query, the roped query part and the cache row from the projection's K
    splits equal the reference's (bf16: bit for bit but the absorption product's
    summation order); swapping RoPE's layout or the heads' W_UK is caught."""
    args = make_inputs(7, dtype=dtype)
    got = fast_jit(functools.partial(mi.mla_inputs, interleaved=interleaved, eps=1e-6, block_c=block_c,
                                      interpret=True), *args)
    want = inputs_reference(*args, interleaved)
    for g, w, shape in zip(got, want, [(2, 4, 32), (2, 4, 8), (2, 40)]):
        chex.assert_shape(g, shape)
        assert g.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    chex.assert_trees_all_close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
                                jax.tree.map(lambda a: a.astype(jnp.float32), want), atol=tol, rtol=tol)
    if dtype == jnp.bfloat16:  # the q_pe and cache rows: the same roundings
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))
        np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32))
    other = inputs_reference(*args, not interleaved)
    assert float(jnp.abs(got[1].astype(jnp.float32) - other[1].astype(jnp.float32)).max()) > 0.1
    rolled = inputs_reference(*args[:4], jnp.roll(args[4], 1, axis=1), interleaved)
    assert float(jnp.abs(got[0].astype(jnp.float32) - rolled[0].astype(jnp.float32)).max()) > 0.1


@pytest.mark.parametrize("cache_shape", [(2, 6, 40), (5, 4, 40)])  # dense [B, S+1, C], paged [pages, P, C]
def test_mla_inputs_writes_the_cache(cache_shape):
    """With a cache and flat write slots the kernel writes each token's cache row there
    (the rows the kernel otherwise returns, in the cache's dtype) and leaves every other
    slot as it was; q_lat and q_pe are unchanged."""
    args = make_inputs(3, dtype=jnp.bfloat16)
    cache = jnp.asarray(np.random.default_rng(0).standard_normal(cache_shape), jnp.float32)
    slots = jnp.asarray([[7], [2]], jnp.int32)  # [B, T] flat slots of the two tokens
    run = functools.partial(mi.mla_inputs, interleaved=True, eps=1e-6, interpret=True)
    q_lat, q_pe, rows = fast_jit(run, *args)
    got_lat, got_pe, got = fast_jit(lambda *a: run(*a[:5], cache=a[5], write_index=a[6]), *args, cache, slots)
    chex.assert_shape(got, cache_shape)
    want = cache.reshape(-1, 40).at[slots.reshape(-1)].set(rows.astype(jnp.float32)).reshape(cache_shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_lat, np.float32), np.asarray(q_lat, np.float32))
    np.testing.assert_array_equal(np.asarray(got_pe, np.float32), np.asarray(q_pe, np.float32))
    swapped = cache.reshape(-1, 40).at[slots[::-1].reshape(-1)].set(rows.astype(jnp.float32)).reshape(cache_shape)
    assert not np.array_equal(np.asarray(got), np.asarray(swapped))


def test_mla_inputs_validation():
    parts, cos, sin, norm, w_uk = make_inputs(1)
    call = lambda parts=parts, cos=cos, sin=sin, norm=norm, w_uk=w_uk, **kw: mi.mla_inputs(
        parts, cos, sin, norm, w_uk, interleaved=True, eps=1e-6, interpret=True, **kw)
    with pytest.raises(ValueError, match="need"):
        call(parts=parts[..., :-2])
    with pytest.raises(ValueError, match="cos"):
        call(sin=sin[:1])
    with pytest.raises(ValueError, match="latent_norm"):
        call(norm=norm[:8])
    with pytest.raises(ValueError, match="power of two"):
        call(parts=parts[..., :-4 * 4], w_uk=w_uk[..., :12])  # Dn 12
    with pytest.raises(TypeError, match="float32"):
        call(parts=parts.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="share"):
        call(norm=norm.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="block_c"):
        call(block_c=12)
    cache = jnp.zeros((1, 8, 40), jnp.float32)
    with pytest.raises(ValueError, match="go together"):
        call(cache=cache)
    with pytest.raises(ValueError, match="latent buffer"):
        call(cache=cache[..., :32], write_index=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="write_index"):
        call(cache=cache, write_index=jnp.zeros((3,), jnp.int32))
    assert mi.is_supported(parts, cos, sin, norm, w_uk)
    assert not mi.is_supported(parts[0], cos, sin, norm, w_uk)


# --------------------------------------------------------------------------- dispatch, errors

def test_dispatch_env(monkeypatch):
    q_lat, q_pe, buf, meta = make_case(6, T=2, H=2, S=40, page_size=3)
    w_uv = jnp.asarray(np.random.default_rng(6).standard_normal((2, 16, q_lat.shape[-1])), jnp.float32)
    calls = []
    real = md.paged_mla_attention_splits
    monkeypatch.setattr(md, "paged_mla_attention_splits", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def run(meta):  # a fresh jit per call: JSPEC_KERNELS is read at trace time
        fn = lambda *a: mla.mla_attention(*a, scale=0.3)
        return fast_jit(fn, q_lat, q_pe, buf, meta, w_uv)

    outs = {}
    for mode, used in [("reference", False), ("auto", jax.default_backend() == "gpu"),
                       ("pallas", True)]:
        monkeypatch.setenv("JSPEC_KERNELS", mode)
        calls.clear()
        outs[mode] = run(meta)
        assert bool(calls) == used, mode
    chex.assert_trees_all_close(outs["pallas"], outs["reference"], atol=1e-5, rtol=1e-5)
    assert not mla.uses_kernel(q_lat, q_pe, buf, meta.replace(prefill=True))


def test_tiles_reach_both_kernels(monkeypatch):
    """`mla_attention` hands `decode_tiles` (`Tuning.mla_decode`) to the attention kernel
    (here splits for 3 programs: one a batch row) and `output_tiles` (`Tuning.mla_output`)
    to the output kernel (8 columns a program: two tiles of Dv 16); the result stays the
    reference's."""
    q_lat, q_pe, buf, meta = make_case(6, T=2, H=2, S=40, page_size=3)
    w_uv = jnp.asarray(np.random.default_rng(6).standard_normal((2, 16, q_lat.shape[-1])), jnp.float32)
    tuned = {"decode_tiles": MlaDecodeTiles(target_programs=3), "output_tiles": MlaOutputTiles(block_n=8)}
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    grids = {}
    for name, tiles in (("default", {}), ("tuned", tuned)):
        fn = functools.partial(mla.mla_attention, scale=0.3, **tiles)
        grids[name] = pallas_grids(fn, q_lat, q_pe, buf, meta, w_uv)
        out = fast_jit(fn, q_lat, q_pe, buf, meta, w_uv)
    # (row blocks, splits, B) of the attention, (B, rows, column tiles) of the output
    assert grids == {"default": [(1, 2, 3), (3, 4, 1)], "tuned": [(1, 1, 3), (3, 4, 2)]}
    monkeypatch.setenv("JSPEC_KERNELS", "reference")
    ref = fast_jit(functools.partial(mla.mla_attention, scale=0.3), q_lat, q_pe, buf, meta, w_uv)
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)


def test_validation():
    q_lat, q_pe, buf, meta = make_case(7, B=2, T=2, H=2, S=32, page_size=4)
    call = lambda q_lat=q_lat, q_pe=q_pe, buf=buf, meta=meta, **kw: md.paged_mla_attention(
        q_lat, q_pe, buf, meta, scale=1.0, interpret=True, **kw)
    with pytest.raises(ValueError, match="prefill"):
        call(meta=meta.replace(prefill=True))
    with pytest.raises(ValueError, match="cache buffer"):
        call(buf=None)
    with pytest.raises(TypeError, match="dtypes differ"):
        call(buf=buf.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        call(q_lat.astype(jnp.int32), q_pe.astype(jnp.int32), buf.astype(jnp.int32))
    with pytest.raises(ValueError, match="latent rank"):
        call(q_lat[..., :24], buf=buf[..., 8:])
    with pytest.raises(ValueError, match="rope dim"):
        call(q_pe=q_pe[..., :8], buf=buf[..., :40])
    with pytest.raises(ValueError, match="Dc \\+ Dr"):
        call(buf=buf[..., :40])
    with pytest.raises(ValueError, match="differ in"):
        call(q_pe=q_pe[:, :, :1])
    with pytest.raises(ValueError, match="latent cache"):  # a GQA-shaped buffer
        call(buf=buf[:, :, None])
    with pytest.raises(ValueError, match="block_k"):
        call(block_k=24)
    with pytest.raises(ValueError, match="block_rows"):
        call(block_rows=8)
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=0)
    with pytest.raises(TypeError, match="scale"):
        md.paged_mla_attention(q_lat, q_pe, buf, meta, scale=jnp.float32(1.0), interpret=True)
    with pytest.raises(ValueError, match="page_table"):
        call(meta=meta.replace(page_table=meta.page_table[:1]))
    with pytest.raises(TypeError, match="page_table"):
        call(meta=meta.replace(page_table=meta.page_table.astype(jnp.float32)))
    with pytest.raises(ValueError, match="page_size"):
        call(meta=meta.replace(page_size=8))
    with pytest.raises(ValueError, match="local_mask"):
        call(meta=meta.replace(local_mask=meta.local_mask[:, :1]))
    with pytest.raises(TypeError, match="local_mask"):
        call(meta=meta.replace(local_mask=meta.local_mask.astype(jnp.int32)))
    with pytest.raises(ValueError, match="batch"):
        call(buf=buf[:1, :32], meta=meta.replace(page_table=None))
    assert md.is_supported(q_lat, q_pe, buf, meta)
    assert not md.is_supported(q_lat, q_pe, buf, meta.replace(prefill=True))
    assert not md.is_supported(q_lat, q_pe, buf.astype(jnp.bfloat16), meta)


@pytest.mark.parametrize("page_size,T,low", [(0, 4, 0), (16, 20, 33)])
def test_blocked_reference_equals_plain(page_size, T, low):
    """Over more slots than its block the MLA reference runs an online softmax over slot
    blocks (scores [B, H, T, block_k]; below every row's prefix unmasked); it equals the
    one-block softmax. low: the shortest row's prefix."""
    q_lat, q_pe, buf, meta = make_case(40 + T, T=T, S=72, page_size=page_size, prefix=[low, max(low, 23), 72 - T])
    whole = md.mla_attention_reference(q_lat, q_pe, buf, meta, scale=0.2)
    blocked = md.mla_attention_reference(q_lat, q_pe, buf, meta, scale=0.2, block_k=16)
    chex.assert_trees_all_close(blocked, whole, atol=1e-5, rtol=1e-5)
    wrong = md.mla_attention_reference(q_lat, q_pe, buf, meta.replace(prefix_len=meta.prefix_len + 1), scale=0.2,
                                       block_k=16)
    assert float(jnp.max(jnp.abs(wrong - whole))) > 1e-3


@pytest.mark.parametrize("page_size,T,low", [(0, 4, 0), (16, 20, 33)])
def test_expanded_prompt_blocks_equal_the_absorbed_form(page_size, T, low):
    """A prompt block's attention in the non-absorbed form (`kernels.mla.prefill`: the
    cached latent up-projected a key block at a time) equals the absorbed reference then
    W_UV: q_lat = q_nope W_UK^T scores the same keys. A wrong prefix shows."""
    from jspec.kernels.mla import prefill as mp
    q_lat, q_pe, buf, meta = make_case(50 + T, T=T, S=72, page_size=page_size, prefix=[low, max(low, 23), 72 - T])
    rng = np.random.default_rng(T)
    B, _, H, Dc = q_lat.shape
    Dn, Dv = 8, 12
    q_nope = jnp.asarray(rng.standard_normal((B, T, H, Dn)), jnp.float32)
    w_uk = jnp.asarray(rng.standard_normal((Dc, H, Dn)) * 0.3, jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((H, Dv, Dc)) * 0.3, jnp.float32)
    with jax.default_matmul_precision("highest"):
        absorbed = jnp.einsum("bthn,chn->bthc", q_nope, w_uk)
        want = mo.up_project(md.mla_attention_reference(absorbed, q_pe, buf, meta, scale=0.2), w_uv, jnp.float32)
        got = mp.expanded_attention(q_nope, q_pe, buf, meta, w_uk, w_uv, scale=0.2, block_k=16)
        wrong = mp.expanded_attention(q_nope, q_pe, buf, meta.replace(prefix_len=meta.prefix_len + 1), w_uk, w_uv,
                                      scale=0.2, block_k=16)
    assert got.shape == (B, T, H, Dv)
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)
    assert float(jnp.max(jnp.abs(wrong - want))) > 1e-3


@pytest.mark.parametrize("page_size", [0, 16])
def test_fused_prompt_blocks_equal_the_blocked_form(page_size):
    """A causal prompt block through fused attention calls (`kernels.mla.prefill.
    fused_attention`: its own keys causally, the prefix in key blocks, merged by
    log-sum-exp; cuDNN on the GPU, XLA's here) equals the blocked non-absorbed form, on a
    first block and on later blocks whose prefixes end inside, at the edge of and past a
    key block. A wrong prefix shows."""
    from jspec.kernels.mla import prefill as mp
    from jspec.cache.layout import causal_mask
    from jspec.kernels.meta import read_kv
    T, S, H, Dn, Dv = 8, 72, 4, 8, 12
    prefix = np.array([0, 16, 37, 64], np.int32)
    _, q_pe, buf, meta = make_case(60, B=4, T=T, S=S, H=H, page_size=page_size, prefix=prefix)
    rng = np.random.default_rng(3)
    B, Dc = 4, 32
    pos = jnp.asarray(prefix[:, None] + np.arange(T), jnp.int32)
    meta = meta.replace(positions=pos, local_positions=pos, local_mask=causal_mask(jnp.full((B,), T, jnp.int32), T),
                        causal_block=True)
    rows = jnp.stack([read_kv(buf, meta.page_table)[b, p:p + T] for b, p in enumerate(prefix)])  # the block's rows
    q_nope = jnp.asarray(rng.standard_normal((B, T, H, Dn)), jnp.float32)
    w_uk = jnp.asarray(rng.standard_normal((Dc, H, Dn)) * 0.3, jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((H, Dv, Dc)) * 0.3, jnp.float32)
    call = functools.partial(mp.fused_attention, q_nope, q_pe, rows, buf, w_uk=w_uk, w_uv=w_uv, scale=0.2,
                             block_k=16, implementation="xla")
    with jax.default_matmul_precision("highest"):
        want = mp.expanded_attention(q_nope, q_pe, buf, meta, w_uk, w_uv, scale=0.2, block_k=16)
        got = call(meta=meta)
        # a first block (no cache read) against the blocked form over a cache that holds
        # only the block's rows, at slots 0 .. T-1
        zero = jnp.zeros_like(meta.prefix_len)
        alone = jnp.pad(rows, ((0, 0), (0, S - T), (0, 0)))
        at0 = meta.replace(prefix_len=zero, page_table=None, page_size=0, positions=pos - pos[:, :1],
                           local_positions=pos - pos[:, :1])
        first = call(meta=at0.replace(prefill=True))
        want_first = mp.expanded_attention(q_nope, q_pe, alone, at0, w_uk, w_uv, scale=0.2, block_k=16)
        wrong = call(meta=meta.replace(prefix_len=meta.prefix_len + 1))
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)
    chex.assert_trees_all_close(first, want_first, atol=1e-4, rtol=1e-4)
    assert float(jnp.max(jnp.abs(wrong[1:] - want[1:]))) > 1e-3
