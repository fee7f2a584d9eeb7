"""The row-invariant MLA attention (`jspec.kernels.row.mla`: the attention kernel, then
`mla_output` merging its splits in order; interpret mode on the CPU): it equals the
reference, and a tree node's output is the same bits as a one-token decode step at the
node's position over a cache holding its ancestors in position order (what plain
decoding's cache holds), whatever the cache's capacity."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import fast_jit
from test_mla_kernel import latent_scale, make_case

from jspec.kernels.mla.output import MlaOutputTiles
from jspec.kernels.row.attention import RowAttentionTiles
from jspec.kernels.meta import AttnMeta
from jspec.kernels.mla.decode import mla_attention_reference
from jspec.kernels.mla.output import up_project
from jspec.kernels.row.attention import local_slots
from jspec.kernels.row.mla import row_mla_output

TILES = RowAttentionTiles(block_k=16, split_blocks=2)  # splits of 32 positions: several a row
DV = 16


def _w_uv(H, Dc, dtype):
    return jnp.asarray(np.random.default_rng(5).standard_normal((H, DV, Dc)) * 0.2, dtype)


def _row(q_lat, q_pe, buf, meta, *, tiles=TILES, output_tiles=MlaOutputTiles()):
    w_uv = _w_uv(q_lat.shape[2], q_lat.shape[3], q_lat.dtype)
    return row_mla_output(q_lat, q_pe, buf, meta, w_uv, scale=latent_scale(q_lat, q_pe),
                          tiles=tiles, output_tiles=output_tiles, interpret=True)


def _ref(q_lat, q_pe, buf, meta):
    w_uv = _w_uv(q_lat.shape[2], q_lat.shape[3], q_lat.dtype)
    attended = mla_attention_reference(q_lat, q_pe, buf, meta, scale=latent_scale(q_lat, q_pe))
    return up_project(attended, w_uv, q_lat.dtype)


_row_jit = jax.jit(_row, static_argnames=("tiles",))


@pytest.mark.parametrize("page_size,T,H", [(0, 1, 4), (0, 5, 20), (16, 4, 2), (3, 3, 4)])
def test_matches_reference(page_size, T, H):
    q_lat, q_pe, buf, meta = make_case(11 + T, B=2, T=T, Tl=T + 2, H=H, S=96, page_size=page_size)
    out = fast_jit(_row, q_lat, q_pe, buf, meta)
    ref = fast_jit(_ref, q_lat, q_pe, buf, meta)
    assert out.shape == (2, T, H, DV) and out.dtype == q_lat.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def _decode_case(buf, meta, b, t, S):
    """Node t of row b as a one-token decode step: a dense cache of S slots holding row
    b's prefix, then the node's ancestors and the node itself at their positions."""
    L = int(meta.prefix_len[b])
    rows = np.zeros((1, S, buf.shape[-1]), np.float32)
    rows[0, :L] = np.asarray(buf[b, :L], np.float32)
    for j, slot in enumerate(np.asarray(local_slots(meta))[b, t]):
        if slot >= 0:
            rows[0, L + j] = np.asarray(buf[b, slot], np.float32)
    pos = int(meta.positions[b, t])
    one = AttnMeta(positions=jnp.full((1, 1), pos, jnp.int32), prefix_len=jnp.full((1,), pos, jnp.int32),
                       local_mask=jnp.ones((1, 1, 1), bool), local_positions=jnp.full((1, 1), pos, jnp.int32),
                       write_index=jnp.zeros((1, 1), jnp.int32), page_table=None)
    return jnp.asarray(rows, buf.dtype), one


@pytest.mark.parametrize("tiles,caps", [
    (TILES, (96, 160)),  # another capacity: more splits, all past the row's keys
    (RowAttentionTiles(block_k=16, split_blocks=16), (96, 300)),  # one split against two
])
def test_a_tree_node_equals_the_decode_step_at_its_position_bit_for_bit(tiles, caps):
    q_lat, q_pe, buf, meta = make_case(7, B=2, T=6, Tl=6, H=4, S=96, prefix=[50, 71], dtype=jnp.bfloat16)
    tree = np.asarray(_row_jit(q_lat, q_pe, buf, meta, tiles=tiles), np.float32)
    for b in range(2):
        for t in range(6):
            for S in caps:
                rows, one = _decode_case(buf, meta, b, t, S)
                step = _row_jit(q_lat[b:b + 1, t:t + 1], q_pe[b:b + 1, t:t + 1], rows, one, tiles=tiles)
                np.testing.assert_array_equal(np.asarray(step, np.float32)[0, 0], tree[b, t],
                                              err_msg=f"row {b} node {t} S {S}")


def test_the_split_walk_unrolled_or_looped_adds_the_same():
    """`mla_output(ordered=True)` unrolls up to `MlaOutputTiles.unroll_splits` splits and
    loops over more: both add them in split order, so the bits agree."""
    q_lat, q_pe, buf, meta = make_case(3, B=1, T=2, H=4, S=96, prefix=[80], dtype=jnp.bfloat16)
    unrolled = np.asarray(fast_jit(_row, q_lat, q_pe, buf, meta), np.float32)
    looped = np.asarray(fast_jit(_row, q_lat, q_pe, buf, meta, output_tiles=MlaOutputTiles(unroll_splits=1)),
                        np.float32)
    np.testing.assert_array_equal(looped, unrolled)
