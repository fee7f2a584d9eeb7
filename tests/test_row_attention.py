"""The row-invariant attention kernel (`jspec.kernels.row.attention`, interpret mode on the
CPU): it equals the reference, and a tree node's output is the same bits as a one-token
decode step at the node's position over a cache that holds the node's ancestors in
position order (what plain decoding's cache holds), whatever the cache's capacity."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import fast_jit, paged_reference, make_case, stack

from jspec.kernels.row.attention import RowAttentionTiles
from jspec.kernels.meta import AttnMeta
from jspec.kernels.row.attention import in_slot_order, local_slots, packs, row_attention

TILES = RowAttentionTiles(block_k=16, split_blocks=2, pack_min_splits=0)  # splits of 32 positions; packed tokens
UNPACKED = RowAttentionTiles(block_k=16, split_blocks=2, pack_tokens=False)  # one token a tile


def _row(q, k, v, meta, *, window=0, tiles=TILES):
    return row_attention(q, stack(k, v), meta, window=window, scale=q.shape[-1] ** -0.5, tiles=tiles,
                         interpret=True)


_row_jit = jax.jit(_row, static_argnames=("window", "tiles"))  # one compile a shape (the node loop below)


@pytest.mark.parametrize("page_size,T,Gq,window", [(0, 1, 4, 0), (0, 5, 2, 0), (16, 4, 20, 0), (3, 6, 1, 0),
                                                    (0, 4, 4, 24), (16, 3, 2, 20)])
def test_matches_reference(page_size, T, Gq, window):
    q, k, v, meta = make_case(3, B=2, T=T, Tl=T + 2, Gq=Gq, S=96, page_size=page_size)
    out = fast_jit(_row, q, k, v, meta, window=window)
    ref = fast_jit(paged_reference, q, k, v, meta, window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_an_fp8_cache_is_read_widened():
    """An FP8 cache (`CacheConfig(dtype="float8_e4m3fn")`): the kernel widens each key block
    as it loads it, the same bits as over the cache widened first (E4M3 values are exact in
    float32), paged and dense; bfloat16 queries within bfloat16 rounding of the reference."""
    from jspec.kernels.attention.decode import decode_attention_reference
    for page_size in (0, 16):
        q, k, v, meta = make_case(4, B=2, T=3, Tl=5, Gq=2, S=96, page_size=page_size)
        fp8 = stack(k, v).astype(jnp.float8_e4m3fn)
        run = lambda q, c: row_attention(q, c, meta, scale=0.25, tiles=TILES, interpret=True)
        got = fast_jit(run, q, fp8)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(fast_jit(run, q, fp8.astype(jnp.float32))))
        assert float(jnp.abs(got - fast_jit(run, q, stack(k, v))).max()) > 1e-4  # the rounding shows
        qb = (q * 1e5).astype(jnp.bfloat16)  # bf16 rows taken in float16, scaled into its range and back
        run_b = lambda q, c: row_attention(q, c, meta, scale=0.25e-5, tiles=TILES, interpret=True)
        want = decode_attention_reference(qb.astype(jnp.float32), fp8.astype(jnp.float32), meta, scale=0.25e-5)
        np.testing.assert_allclose(np.asarray(fast_jit(run_b, qb, fp8), np.float32), np.asarray(want),
                                   rtol=2e-2, atol=2e-2)


def test_local_slots_follow_each_tokens_ancestors():
    _, _, _, meta = make_case(5, B=2, T=4, Tl=6, S=64)
    got = np.asarray(local_slots(meta))
    mask, lpos, prefix = (np.asarray(a) for a in (meta.local_mask, meta.local_positions, meta.prefix_len))
    for b in range(2):
        for t in range(4):
            want = np.full(got.shape[-1], -1)
            for i in np.flatnonzero(mask[b, t]):
                want[lpos[b, i] - prefix[b]] = prefix[b] + i
            np.testing.assert_array_equal(got[b, t], want)


def _decode_case(k, v, meta, b, t, S):
    """A one-token decode step of node t of row b: a dense cache of S slots holding row b's
    prefix, then the node's ancestors and the node itself at their positions."""
    L = int(meta.prefix_len[b])
    kk = np.zeros((1, S) + k.shape[2:], np.float32)
    vv = np.zeros_like(kk)
    kk[0, :L], vv[0, :L] = np.asarray(k[b, :L], np.float32), np.asarray(v[b, :L], np.float32)
    for j, slot in enumerate(np.asarray(local_slots(meta))[b, t]):
        if slot >= 0:
            kk[0, L + j], vv[0, L + j] = np.asarray(k[b, slot], np.float32), np.asarray(v[b, slot], np.float32)
    pos = int(meta.positions[b, t])
    one = AttnMeta(positions=jnp.full((1, 1), pos, jnp.int32), prefix_len=jnp.full((1,), pos, jnp.int32),
                       local_mask=jnp.ones((1, 1, 1), bool), local_positions=jnp.full((1, 1), pos, jnp.int32),
                       write_index=jnp.zeros((1, 1), jnp.int32), page_table=None)
    return jnp.asarray(kk, k.dtype), jnp.asarray(vv, v.dtype), one


def _as_chain(meta):
    """The same prefixes with a chain of local tokens: token t at prefix + t sees 0..t."""
    B, T, Tl = meta.local_mask.shape
    return meta.replace(local_mask=jnp.broadcast_to(jnp.tril(jnp.ones((T, Tl), bool)), (B, T, Tl)),
                         local_positions=meta.prefix_len[:, None] + jnp.arange(Tl, dtype=jnp.int32),
                         positions=meta.prefix_len[:, None] + jnp.arange(T, dtype=jnp.int32))


@pytest.mark.parametrize("window,tiles,caps,chain", [
    (0, TILES, (96, 160), False),  # another capacity: more splits, all past the row's keys
    (40, TILES, (96, 160), False),
    (0, UNPACKED, (96,), False),
    (24, RowAttentionTiles(block_k=16, split_blocks=2, merge_block_d=8), (96,), False),
    (0, RowAttentionTiles(block_k=16, split_blocks=1), (96,), True),  # one pass a group
    (0, UNPACKED, (96,), True),
    (0, RowAttentionTiles(block_k=16, split_blocks=16), (96, 300), False),  # one split (no merge) against two
])
def test_a_tree_node_equals_the_decode_step_at_its_position_bit_for_bit(window, tiles, caps, chain):
    # row 0's local positions 60..65 straddle two splits of 32 (a packed group's passes in both)
    q, k, v, meta = make_case(7, B=2, T=6, Tl=6, Gq=4, S=96, prefix=[60, 71], dtype=jnp.bfloat16)
    if chain:
        meta = _as_chain(meta)
    tree = np.asarray(_row_jit(q, k, v, meta, window=window, tiles=tiles))
    for b in range(2):
        for t in range(6):
            for S in caps:
                kk, vv, one = _decode_case(k, v, meta, b, t, S)
                step = np.asarray(_row_jit(q[b:b + 1, t:t + 1], kk, vv, one, window=window, tiles=tiles))
                np.testing.assert_array_equal(step[0, 0], tree[b, t], err_msg=f"row {b} node {t} S {S}")


@pytest.mark.parametrize("T", [2, 6])  # 2: a group of two tokens in 8 of the 16 rows
def test_packed_tokens_and_the_merge_written_out_or_looped_give_the_same_bits(T):
    q, k, v, meta = make_case(9, B=1, T=T, Tl=T, Gq=4, S=96, prefix=[78], dtype=jnp.bfloat16)
    out = [np.asarray(_row_jit(q, k, v, meta, tiles=RowAttentionTiles(block_k=16, split_blocks=1, unroll_splits=u,
                                                                        pack_tokens=pack)))
           for u, pack in ((32, True), (0, True), (32, False))]  # 8 splits of 16 positions; 4 tokens a tile or 1
    for other in out[1:]:
        np.testing.assert_array_equal(out[0], other)


def test_in_slot_order_marks_groups_whose_tokens_find_each_key_at_its_position():
    _, _, _, meta = make_case(5, B=2, T=6, Tl=6, S=64, prefix=[10, 30])
    chain = _as_chain(meta)
    np.testing.assert_array_equal(np.asarray(in_slot_order(local_slots(chain), chain.prefix_len, 4)), [[1, 1]] * 2)
    # a second root: token 1 at prefix + 0 sits in local slot 1; tokens 2.. hang below it
    mask = np.tril(np.ones((6, 6), bool))
    mask[1:, 0] = False
    depth = np.array([0, 0, 1, 2, 3, 4])
    fork = meta.replace(local_mask=jnp.broadcast_to(jnp.asarray(mask), (2, 6, 6)),
                         local_positions=meta.prefix_len[:, None] + jnp.asarray(depth),
                         positions=meta.prefix_len[:, None] + jnp.asarray(depth))
    got = np.asarray(in_slot_order(local_slots(fork), fork.prefix_len, 2))  # groups (0, 1), (2, 3), (4, 5)
    np.testing.assert_array_equal(got, [[0, 0, 0]] * 2)
    np.testing.assert_array_equal(np.asarray(in_slot_order(local_slots(fork), fork.prefix_len, 1)),
                                  [[1, 0, 0, 0, 0, 0]] * 2)


def test_tokens_share_a_tile_only_over_caches_of_enough_splits():
    tiles = RowAttentionTiles()
    assert not packs(tiles.pack_min_splits - 1, tiles) and packs(tiles.pack_min_splits, tiles)
    assert not packs(64, RowAttentionTiles(pack_tokens=False)) and packs(1, RowAttentionTiles(pack_min_splits=0))
