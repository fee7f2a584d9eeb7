"""The Pallas decode/verify attention kernel (interpret mode) against attention_reference."""
from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec.cache import kv as kvc
from jspec.cache import layout as lay
from jspec.kernels.attention import decode as da
from jspec.kernels import dispatch
from jspec.kernels.attention import gqa as attn
from jspec.kernels.meta import AttnMeta


def tree_mask(rng, Tl):
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


def make_case(seed, *, B=3, T=4, Tl=None, Hkv=2, Gq=2, Dh=16, S=64, page_size=0, prefix=None,
              dtype=jnp.float32):
    """q, keys, values, meta for T new tokens (the last T of Tl local slots, a random tree)
    after ragged prefixes; a paged cache gets shuffled pages and unallocated table tails."""
    rng = np.random.default_rng(seed)
    Tl = T if Tl is None else Tl
    if prefix is None:
        prefix = rng.integers(0, S - Tl + 1, size=B)
    prefix = np.asarray(prefix, np.int32)
    masks, depths = zip(*(tree_mask(rng, Tl) for _ in range(B)))
    local_mask = np.stack(masks)[:, Tl - T:]  # [B, T, Tl]
    local_pos = prefix[:, None] + np.stack(depths)  # [B, Tl]
    positions = local_pos[:, Tl - T:]
    H = Hkv * Gq
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
    meta = AttnMeta(
        positions=jnp.asarray(positions, jnp.int32), prefix_len=jnp.asarray(prefix),
        local_mask=jnp.asarray(local_mask), local_positions=jnp.asarray(local_pos, jnp.int32),
        write_index=jnp.zeros((B, T), jnp.int32),
        page_table=None if table is None else jnp.asarray(table), page_size=page_size)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), meta


def fast_jit(fn, *args, **static):
    """jit + run with XLA's backend optimisations off: interpret-mode kernels compile in
    half the time, which is what these tests spend most of theirs on."""
    f = jax.jit(functools.partial(fn, **static))
    return f.trace(*args).lower().compile({"xla_backend_optimization_level": 0})(*args)


def stack(k, v):
    """Keys and values [..., Hkv, Dh] -> the cache's layout [..., 2, Hkv, Dh]."""
    return jnp.stack([k, v], axis=-3)


def _kernel(q, k, v, meta, *, window=0, block_k=16, num_splits=None):
    return da.paged_decode_attention(q, stack(k, v), meta, window=window, scale=q.shape[-1] ** -0.5,
                                     interpret=True, block_k=block_k, num_splits=num_splits)


def paged_reference(q, k, v, meta, *, window=0):
    return da.decode_attention_reference(q, stack(k, v), meta, window=window, scale=q.shape[-1] ** -0.5)


def check(q, k, v, meta, *, window=0, block_k=16, num_splits=None, atol=1e-5, rtol=1e-5):
    out = fast_jit(_kernel, q, k, v, meta, window=window, block_k=block_k, num_splits=num_splits)
    ref = fast_jit(paged_reference, q, k, v, meta, window=window)
    chex.assert_equal_shape([out, q])
    assert out.dtype == q.dtype
    chex.assert_trees_all_close(out.astype(jnp.float32), ref.astype(jnp.float32), atol=atol,
                                rtol=rtol)


# --------------------------------------------------------------------------- fixed cases

CASES = [  # (page_size, T, Gq, num_splits); page_size 0: dense
    (0, 1, 4, None), (0, 4, 1, 1), (0, 16, 4, 3),
    (1, 1, 1, 2), (1, 4, 4, None),
    (3, 4, 1, None), (3, 20, 4, 2),  # 80 query rows per kv head: two row blocks
    (16, 1, 4, 1), (16, 16, 1, None),
]


@pytest.mark.parametrize("page_size,T,Gq,num_splits", CASES)
def test_matches_reference(page_size, T, Gq, num_splits):
    # Row 0: empty prefix; row 1: ragged; row 2: the local block ends the cache.
    S = 72
    q, k, v, meta = make_case(page_size * 100 + T * 10 + Gq, T=T, Gq=Gq, S=S,
                              page_size=page_size, prefix=[0, 23, S - T])
    check(q, k, v, meta, num_splits=num_splits)


def pallas_grids(fn, *args):
    """The grids of the Pallas calls `fn(*args)` makes (from its jaxpr)."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [e.params["grid_mapping"].grid for e in eqns if e.primitive.name == "pallas_call"]


def test_tiles_of_a_tuning():
    """The kernel takes its tiles from an `AttentionTiles` (`Tuning.attention`): 16 query
    rows a program (64 rows a kv head: four row blocks), 32 key slots a block, splits for 8
    programs; keyword tiles win over it. The result is the reference's either way."""
    from jspec.kernels.attention.decode import AttentionTiles
    q, k, v, meta = make_case(7, T=16, Gq=4, S=72, page_size=3, prefix=[0, 23, 56])
    tiles = AttentionTiles(block_k=32, max_rows=16, target_programs=8)

    def kernel(q, kv, meta, **kw):
        return da.paged_decode_attention(q, kv, meta, scale=0.25, interpret=True, tiles=tiles, **kw)

    kv = stack(k, v)
    assert pallas_grids(kernel, q, kv, meta) == [(3, 2, 4, 1)]  # (B, Hkv, row blocks, splits)
    assert pallas_grids(functools.partial(kernel, num_splits=2), q, kv, meta) == [(3, 2, 4, 2)]
    assert pallas_grids(lambda q, kv, meta: da.paged_decode_attention(q, kv, meta, scale=0.25, interpret=True),
                        q, kv, meta) == [(3, 2, 1, 1)]  # the defaults: 64 rows a program, 128-slot blocks
    out = fast_jit(kernel, q, kv, meta)
    ref = da.decode_attention_reference(q, kv, meta, scale=0.25)
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)


def test_key_blocks_fit_shared_memory():
    """The kernel's key block shrinks until its buffers fit a program's shared memory: a
    512-token block of Qwen3.5's head size 256 (its MTP layer reading a prompt block) asked
    the compiler for 303,104 bytes at blocks of 128; 8B's 128 keeps its blocks of 128."""
    t = da.AttentionTiles()
    assert da.shared_bytes(128, 2, 256, 2, 64, 512) == 303104 > da.SMEM_BYTES
    assert da.fitting_block(t, 2, 6 * 512, 256, 2, 512) == 64
    assert da.shared_bytes(64, 2, 256, 2, 64, 512) <= da.SMEM_BYTES
    assert da.fitting_block(t, 2, 4 * 512, 128, 2, 512) == 128


def test_dense_capacity_not_multiple_of_block():
    q, k, v, meta = make_case(1, B=2, T=3, S=37, prefix=[34, 5])  # S % 16 != 0, full row 0
    check(q, k, v, meta, block_k=16)
    check(q, k, v, meta, block_k=64)  # one block larger than the cache


def test_local_block_longer_than_new_tokens():  # tree drafting: Tl > T
    q, k, v, meta = make_case(2, B=2, T=3, Tl=9, S=48, page_size=3, prefix=[0, 39])
    check(q, k, v, meta, num_splits=2)


@pytest.mark.parametrize("page_size,window", [(0, 5), (3, 40)])
def test_sliding_window(page_size, window):
    q, k, v, meta = make_case(3, B=3, T=4, S=96, page_size=page_size, prefix=[0, 50, 92])
    check(q, k, v, meta, window=window, num_splits=2)


@pytest.mark.parametrize("page_size", [0, 16])
def test_bfloat16(page_size):
    q, k, v, meta = make_case(4, T=4, Gq=4, S=80, page_size=page_size, prefix=[0, 31, 76],
                              dtype=jnp.bfloat16)
    check(q, k, v, meta, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("page_size,window", [(0, 0), (16, 0), (3, 9)])
def test_fp8_cache(page_size, window):
    """An FP8 cache (`CacheConfig(dtype="float8_e4m3fn")`) is read as FP8, each block
    widened in the kernel: with float32 queries bit for bit the kernel over the cache
    widened first; with bfloat16 ones, taken in float16 (`fp8_queries`), the reference
    within bfloat16 rounding, also for queries far past float16's range (each row's
    power-of-two factor); dense, paged and windowed. The attention dispatch sends an FP8
    cache's decode to the kernel; queries are not parked in it, and other dtype mismatches
    are refused."""
    q, k, v, meta = make_case(6, T=4, Gq=2, S=72, page_size=page_size, prefix=[0, 30, 68])
    cache = stack(k, v).astype(jnp.float8_e4m3fn)
    wide = cache.astype(jnp.float32)
    run = lambda q, c: da.paged_decode_attention(q, c, meta, window=window, scale=0.25, interpret=True, block_k=16)
    got = fast_jit(run, q, cache)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fast_jit(run, q, wide)))
    ref = da.decode_attention_reference(q, cache, meta, window=window, scale=0.25)
    chex.assert_trees_all_close(got, ref, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(got - fast_jit(run, q, stack(k, v))).max()) > 1e-4  # the rounding shows
    # bfloat16 queries: 1e6 times larger, past float16's range unless each row is scaled down;
    # 1e5 times larger with a scale 1e5 times smaller, scores as at first only if they are scaled back
    for size, scale in ((1.0, 0.25), (1e6, 0.25), (1e5, 0.25e-5)):
        qb = (q * size).astype(jnp.bfloat16)
        run_b = lambda q, c: da.paged_decode_attention(q, c, meta, window=window, scale=scale, interpret=True,
                                                       block_k=16)
        got_b = fast_jit(run_b, qb, cache)
        assert got_b.dtype == jnp.bfloat16
        want = da.decode_attention_reference(qb.astype(jnp.float32), wide, meta, window=window, scale=scale)
        chex.assert_trees_all_close(got_b.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
    # over an FP8 cache the widened blocks take shared memory too (H200: Dh 256, 96 rows, 3 stages of 128 failed)
    assert da.fitting_block(da.AttentionTiles(), 3, 96, 256, 1, 16, widened=2) == 64
    assert da.fitting_block(da.AttentionTiles(), 3, 4, 128, 1, 1, widened=2) == 128  # the 8B step's blocks stay
    with dispatch.use_backend("pallas"):
        call = lambda q, c: attn.attention(q, None, None, c, meta, window=window, scale=0.25)
        jaxpr = str(jax.make_jaxpr(call)(q, cache))
    assert "jspec_decode_attention" in jaxpr
    if not page_size:
        with pytest.raises(ValueError, match="queries are not parked in an FP8 cache"):
            da.paged_decode_attention(q, cache, meta, scale=0.25, q_in_cache=True, interpret=True)
    with pytest.raises(TypeError, match="the cache must be q's dtype or FP8"):
        da.paged_decode_attention(q.astype(jnp.bfloat16), stack(k, v), meta, scale=0.25, interpret=True)


def test_with_make_meta_and_allocated_pages():
    """The cache filled the way the engine does it: alloc_pages, make_meta, write_kv."""
    B, T, Hkv, Gq, Dh, P, Gp, num_pages = 2, 4, 2, 2, 16, 4, 8, 20

    def setup(key):
        kp, kn, kq = jax.random.split(key, 3)
        prefix = jnp.array([9, 0], jnp.int32)
        pool = jax.random.normal(kp, (num_pages + 1, P, Hkv, Dh))  # + the trash page
        cache = kvc.KVCache(kv=(stack(pool, pool * 0.5),))
        pages = lay.init_page_state(B, Gp, num_pages)
        pages, ok = lay.alloc_pages(pages, prefix + T, jnp.ones((B,), bool), P, Gp)
        positions = prefix[:, None] + jnp.arange(T, dtype=jnp.int32)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        layout = lay.CacheLayout(paged=True, capacity=Gp * P, page_size=P, num_pages=num_pages)
        meta = lay.make_meta(layout, pages, positions=positions, prefix_len=prefix, local_mask=causal,
                             write_valid=jnp.ones((B, T), bool))
        k_new = jax.random.normal(kn, (B, T, Hkv, Dh))
        kv_buf = kvc.write_kv(cache.kv[0], stack(k_new, 2 * k_new), meta.write_index)
        return jax.random.normal(kq, (B, T, Hkv * Gq, Dh)), kv_buf, meta, ok

    q, kv_buf, meta, ok = fast_jit(setup, jax.random.key(5))
    assert bool(ok.all())
    check(q, kv_buf[:, :, 0], kv_buf[:, :, 1], meta)


@pytest.mark.parametrize("paged", [False, True])
def test_trash_writes_are_dropped_and_indices_distinct(paged):
    """Writes and moves into the trash are dropped, each with an index of its own past the
    end: the scatter is told its indices are distinct (a scatter that may repeat an index
    updates elements atomically on a GPU, and hundreds of writes to one trash slot
    serialise). Valid slots get their values; nothing else changes, the trash included."""
    rng = np.random.default_rng(0)
    rows, slots = (5, 4) if paged else (3, 9)  # paged: 4 pages + trash of 4 slots; dense: 8 slots + trash a row
    buf = jnp.asarray(rng.normal(size=(rows, slots, 2, 1, 4)), jnp.float32)
    trash = [16, 16, 16] if paged else [8, 17, 17]  # paged: page 4's first slot; dense: a row's last
    valid = [0, 7, 13] if paged else [0, 10, 25]
    index = jnp.asarray([valid + trash], jnp.int32)  # [1, 6]
    new = jnp.asarray(rng.normal(size=(1, 6, 2, 1, 4)), jnp.float32)
    out = np.asarray(kvc.write_kv(buf, new, index, dense=not paged)).reshape(rows * slots, -1)
    want = np.asarray(buf).reshape(rows * slots, -1).copy()
    want[valid] = np.asarray(new).reshape(6, -1)[:3]
    np.testing.assert_array_equal(out, want)
    moved = kvc.move_buffers((buf,), jnp.asarray([valid[:2] + trash[:2]]), jnp.asarray([valid[1:] + trash[1:]]),
                             dense=not paged)[0]
    want = np.asarray(buf).reshape(rows * slots, -1).copy()
    want[valid[1:]] = want[valid[:2]]
    np.testing.assert_array_equal(np.asarray(moved).reshape(rows * slots, -1), want)
    jaxpr = jax.make_jaxpr(lambda b, n: kvc.write_kv(b, n, index, dense=not paged))(buf, new)
    scatters = [e for e in jaxpr.eqns if e.primitive.name == "scatter"]
    assert scatters and all(e.params["unique_indices"] for e in scatters)


# --------------------------------------------------------------------------- property test

@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_shapes(data):
    draw = data.draw
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    Tl = T + draw(st.integers(0, 3))
    Hkv = draw(st.sampled_from([1, 2]))
    Gq = draw(st.sampled_from([1, 2, 4]))
    page_size = draw(st.sampled_from([0, 1, 2, 5, 8, 16]))
    S = Tl + draw(st.integers(0, 70))
    prefix = draw(st.lists(st.integers(0, S - Tl), min_size=B, max_size=B))
    window = draw(st.sampled_from([0, 0, 3, 17]))
    block_k = draw(st.sampled_from([16, 32]))
    num_splits = draw(st.sampled_from([None, 1, 2, 5]))
    q, k, v, meta = make_case(draw(st.integers(0, 2**16)), B=B, T=T, Tl=Tl, Hkv=Hkv, Gq=Gq,
                              S=S, page_size=page_size, prefix=prefix)
    check(q, k, v, meta, window=window, block_k=block_k, num_splits=num_splits)


# --------------------------------------------------------------------------- dispatch, errors

def test_gpu_xla_options_apply_on_gpu_only(monkeypatch):
    """The family's options and the tuning's xla_gpu_* ones apply on a GPU only; the
    tuning's others everywhere (the CPU's code generation)."""
    from jspec.tuning import DEFAULT_TUNING, Tuning
    tuning = Tuning(xla_options=(("xla_gpu_disable_async_collectives", "ALLREDUCE"),))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert DEFAULT_TUNING.compiler_options() == {} and tuning.compiler_options() == {}
    cpu = Tuning(xla_options={"xla_backend_optimization_level": 2, "xla_gpu_enable_command_buffer": ""})
    assert cpu.compiler_options({"xla_gpu_graph_min_graph_size": 1}) == {"xla_backend_optimization_level": 2}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert DEFAULT_TUNING.compiler_options() == {}
    opts = tuning.compiler_options()
    assert opts == {"xla_gpu_disable_async_collectives": "ALLREDUCE"}
    opts["x"] = 1  # a copy: the tuning stays as it is
    assert dict(tuning.xla_options) == {"xla_gpu_disable_async_collectives": "ALLREDUCE"}
    # a family's options, under the tuning's where both set one
    family = {"xla_gpu_graph_min_graph_size": 1, "xla_gpu_disable_async_collectives": "ALLGATHER"}
    assert DEFAULT_TUNING.compiler_options(family) == family and DEFAULT_TUNING.compiler_options(family) is not family
    assert tuning.compiler_options(family) == {"xla_gpu_graph_min_graph_size": 1,
                                               "xla_gpu_disable_async_collectives": "ALLREDUCE"}
    assert family["xla_gpu_disable_async_collectives"] == "ALLGATHER"
    # family_xla_options False: the tuning's alone
    assert tuning.replace(family_xla_options=False).compiler_options(family) == dict(tuning.xla_options)
    assert Tuning(family_xla_options=False).compiler_options(family) == {}
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert tuning.compiler_options(family) == {}


def test_tuning_is_a_hashable_value():
    """A tuning is frozen and hashable (a compile key), equal tunings are one key, a dict of
    XLA options is taken as its pairs, and wrong types fail naming the field."""
    from jspec.tuning import DEFAULT_TUNING, Tuning
    from jspec.kernels.attention.decode import AttentionTiles
    from jspec.kernels.moe.experts import ExpertTiles
    assert Tuning() == DEFAULT_TUNING and hash(Tuning()) == hash(DEFAULT_TUNING)
    a = Tuning(experts=ExpertTiles(num_stages=4), xla_options={"xla_gpu_graph_min_graph_size": 1})
    assert a == Tuning(experts=ExpertTiles(num_stages=4), xla_options=(("xla_gpu_graph_min_graph_size", 1),))
    assert len({a, Tuning(), Tuning(attention=AttentionTiles(block_k=64))}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.mlp_norm_in_kernel = False
    with pytest.raises(TypeError, match="experts"):
        Tuning(experts={"block_n": 64})
    with pytest.raises(TypeError, match="xla_options"):
        Tuning(xla_options=[("xla_gpu_graph_min_graph_size", [1])])
    with pytest.raises(TypeError, match="cache_write_in_kernel"):
        Tuning(cache_write_in_kernel=0)


def test_family_gpu_xla_options():
    """DeepSeek's loop asks for command buffers of single kernels, not over the while loop
    (wrong tokens with paged caches on an H100), split over several devices with the
    collectives in them; Llama's for none."""
    from jspec.models import deepseek, llama
    from jspec.models.deepseek_hf import DeepseekConfig
    cfg = DeepseekConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                         kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                         first_k_dense_replace=1)
    opts = deepseek.DEEPSEEK.gpu_xla_options(cfg)
    kinds = opts["xla_gpu_enable_command_buffer"].split(",")
    assert "FUSION" in kinds and opts == deepseek.GPU_XLA_OPTIONS
    assert not {"WHILE", "CONDITIONAL"} & set(kinds)  # wrong tokens with paged caches on an H100
    assert opts is not deepseek.GPU_XLA_OPTIONS
    kinds = deepseek.DEEPSEEK.gpu_xla_options(cfg.replace(devices=2))["xla_gpu_enable_command_buffer"].split(",")
    assert "COLLECTIVES" in kinds and not {"WHILE", "CONDITIONAL"} & set(kinds)
    assert llama.LLAMA.gpu_xla_options(None) == {}


def test_dispatch_env(monkeypatch):
    q, k, v, meta = make_case(6, T=4, Gq=2, S=40, page_size=3)
    scale = q.shape[-1] ** -0.5
    calls = []
    real = da.paged_decode_attention
    monkeypatch.setattr(da, "paged_decode_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def run(meta, k_new=None):  # a fresh jit per call: JSPEC_KERNELS is read at trace time
        kvb = None if meta.prefill else stack(k, v)
        fn = lambda q, kn, kvb, meta: attn.attention(q, kn, kn, kvb, meta, scale=scale)
        return fast_jit(fn, q, k_new, kvb, meta)

    outs = {}
    for mode, used in [("reference", False), ("auto", jax.default_backend() == "gpu"),
                       ("pallas", True)]:
        monkeypatch.setenv("JSPEC_KERNELS", mode)
        calls.clear()
        outs[mode] = run(meta)
        assert bool(calls) == used, mode
    chex.assert_trees_all_close(outs["pallas"], outs["reference"], atol=1e-5, rtol=1e-5)
    # Prefill never takes the kernel.
    pre = meta.replace(prefill=True)
    calls.clear()
    run(pre, k_new=jnp.ones((3, 4, 2, 16)))
    assert not calls
    monkeypatch.setenv("JSPEC_KERNELS", "fast")
    with pytest.raises(ValueError, match="JSPEC_KERNELS"):
        attn.attention(q, None, None, stack(k, v), meta, scale=scale)


def test_validation():
    q, k, v, meta = make_case(7, B=2, T=2, Gq=2, S=32, page_size=4)
    call = lambda q, k, v, meta, **kw: da.paged_decode_attention(q, stack(k, v), meta, interpret=True,
                                                                   scale=1.0, **kw)
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
    with pytest.raises(ValueError, match="cache"):  # keys alone: not the [.., .., 2, Hkv, Dh] layout
        da.paged_decode_attention(q, k, meta, interpret=True, scale=1.0)
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
    assert da.is_supported(q, stack(k, v), meta)
    assert not da.is_supported(q, stack(k, v), meta.replace(prefill=True))


# --------------------------------------------------------------------------- the blocked reference

@pytest.mark.parametrize("page_size,T,window,low", [(0, 4, 0, 0), (3, 20, 0, 35), (16, 1, 9, 0), (0, 16, 30, 0),
                                                    (16, 4, 0, 40)])
def test_blocked_reference_equals_plain(page_size, T, window, low):
    """Over more keys than its block, the reference runs an online softmax over key blocks
    (so its scores stay [B, H, T, block_k]; the blocks below every row's prefix unmasked);
    it equals the one-block softmax, for caches (dense, paged, trees, sliding windows) and
    for a prefill block attending to itself. low: the shortest row's prefix."""
    q, k, v, meta = make_case(page_size * 10 + T, T=T, Gq=2, S=72, page_size=page_size,
                              prefix=[low, max(low, 23), 72 - T])
    kv, s = stack(k, v), q.shape[-1] ** -0.5
    whole = da.attention_reference(q, None, None, kv, meta, window=window, scale=s)
    blocked = jax.jit(functools.partial(da.attention_reference, window=window, scale=s, block_k=16))(
        q, None, None, kv, meta)
    chex.assert_trees_all_close(blocked, whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError):  # the comparison sees a wrong mask (another window)
        wrong = da.attention_reference(q, None, None, kv, meta, window=window + 5, scale=s, block_k=16)
        chex.assert_trees_all_close(wrong, whole, atol=1e-5, rtol=1e-5)

    lens = jnp.asarray([40, 17, 1])
    pm = lay.prefill_meta(lens, 40)
    rng = np.random.default_rng(1)
    qp, kp, vp = (jnp.asarray(rng.standard_normal((3, 40, h, 16)), jnp.float32) for h in (4, 2, 2))
    whole = da.attention_reference(qp, kp, vp, None, pm, window=window, scale=0.25)
    blocked = da.attention_reference(qp, kp, vp, None, pm, window=window, scale=0.25, block_k=16)
    valid = np.arange(40)[None, :] < np.asarray(lens)[:, None]
    np.testing.assert_allclose(np.asarray(blocked)[valid], np.asarray(whole)[valid], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- fused prompt blocks

@pytest.mark.parametrize("page_size", [0, 16])
def test_fused_prompt_block_equals_reference(page_size):
    """A prompt block in two fused calls (itself causally, the cache's prefix unmasked,
    merged by log-sum-exp; `kernels.attention.fused`, cuDNN on the GPU, XLA's
    implementation here) equals the reference, first blocks and later ones, rows with and
    without a prefix, a paged prefix read whole or 32 slots a step, padded block tails aside."""
    from jspec.kernels.attention import fused
    B, T, Hkv, Gq, Dh, S = 3, 64, 2, 2, 16, 200
    rng = np.random.default_rng(page_size)
    prefix = np.asarray([0, 70, 128], np.int32)
    count = np.asarray([64, 30, 64], np.int32)  # the block's prompt tokens (the rest: padding)
    q = jnp.asarray(rng.standard_normal((B, T, Hkv * Gq, Dh)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((B, T, Hkv, Dh)), jnp.float32) for _ in range(2))
    _, kc, vc, meta = make_case(3, B=B, T=T, Hkv=Hkv, Gq=Gq, Dh=Dh, S=S, page_size=page_size, prefix=prefix)
    pos = jnp.asarray(prefix[:, None] + np.arange(T)[None], jnp.int32)
    meta = meta.replace(positions=pos, local_positions=pos, causal_block=True,
                        local_mask=lay.causal_mask(jnp.asarray(count), T))
    kv = stack(kc, vc)
    slots = prefix[:, None] + np.arange(T)[None]  # the block's keys written at slots prefix .. prefix + T
    if page_size:
        pages = np.asarray(meta.page_table)[np.arange(B)[:, None], slots // page_size]
        kv = kv.at[pages, slots % page_size].set(jnp.stack([k_new, v_new], axis=2))
    else:
        kv = kv.at[np.arange(B)[:, None], slots].set(jnp.stack([k_new, v_new], axis=2))
    valid = np.arange(T)[None, :] < count[:, None]
    for first, prefix_block in ((True, 4096), (False, 4096), (False, 32)):  # 32: the paged prefix in steps
        m = meta.replace(prefill=True, prefix_len=jnp.zeros((B,), jnp.int32)) if first else meta
        buf = None if first else kv
        want = np.asarray(da.attention_reference(q, k_new, v_new, buf, m, scale=0.3))
        got = np.asarray(fused.block_attention(q, k_new, v_new, buf, m, scale=0.3, implementation="xla",
                                               prefix_block=prefix_block))
        np.testing.assert_allclose(got[valid], want[valid], atol=2e-5, rtol=2e-5)
    wrong = np.asarray(fused.block_attention(q, k_new, v_new, kv, meta.replace(prefix_len=meta.prefix_len + 1),
                                             scale=0.3, implementation="xla"))
    assert np.abs(wrong[valid] - want[valid]).max() > 1e-3  # one prefix slot too many shows
