"""Row-invariant MLA attention over the latent cache (Pallas, Triton lowering;
`Tuning.row_invariant` for DeepSeek targets): a token's softmax-weighted latent is the
same bits whatever else shares the pass, so a verification node's equals the decode
step's at that node's position.

The absorbed form of `mla_decode` (q_lat [B,T,H,Dc] scores the latent c, q_pe [B,T,H,Dr]
the roped key part, one cache row [Dc + Dr] a slot, the latent also the value), computed
the way `row_attention` computes GQA attention:
- a program takes ONE token's heads, 16 at a time (`row_attention.ROWS`; fewer heads are
  padded), so a row's tile never changes with the number of tokens;
- keys are visited by POSITION (`row_attention.key_rows`): slot p below the prefix, the
  local slot of the token's depth-j ancestor at prefix + j, so a tree node's key blocks
  hold what the decode step at its position holds;
- splits cover fixed ranges of `block_k * split_blocks` positions (`RowAttentionTiles`,
  `Tuning.row_mla`); `mla_output` (ordered) merges them in split order as it applies
  W_UV: a split that saw nothing adds exact zeros, so the cache's capacity does not
  matter.
Dc + Dr (576 for DeepSeek) is no power of two: a key block loads as two tiles, the
latent [BK, Dc] (also the values) and the rope part [BK, Dr], and a score is the sum of
the two dot products, as in `mla_decode`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.mla import output as mla_output
from jspec.kernels.mla.output import MlaOutputTiles
from jspec.kernels.attention.decode import online_softmax_step
from jspec.kernels.meta import AttnMeta
from jspec.kernels.mla.decode import check_mla_args
from jspec.kernels.row.attention import (
    ROWS,
    RowAttentionTiles,
    key_rows,
    local_slots,
    num_splits,
    softmax_split,
)

# `Tuning.row_mla`'s default: one 64-key block a split (V2-Lite, 4 layers, batch 1 on an H100:
# 0.532 ms a step against 0.535 with two blocks and 0.561 with four; docs/benchmarks.md)
MLA_TILES = RowAttentionTiles(block_k=64, split_blocks=1)


def _attend_kernel(prefix_ref, pos_ref, table_ref, lat_ref, qc_ref, qr_ref, lslot_ref, o_ref, lse_ref, *,
                   scale: float, block_k: int, split_blocks: int, page_size: int, dense: bool,
                   num_pages: int, num_keys: int, latent_dim: int):
    """One (batch row b, token t, head block g, split s).

    prefix_ref [B], pos_ref [B, T] int32; table_ref [B, G] (dense: [B, 1], unused);
    lat_ref [num_pages * P, Dc + Dr]; qc_ref [ROWS, Dc], qr_ref [ROWS, Dr]; lslot_ref [Tp]
    (`local_slots`); o_ref [ROWS, Dc] float32 normalised over this split's keys; lse_ref
    [ROWS] (NEG_INF: no key)."""
    b, t, s = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    Dc, Dr = latent_dim, qr_ref.shape[-1]
    L, pos = prefix_ref[b], pos_ref[b, t]
    lo = s * split_blocks
    hi = jnp.minimum((s + 1) * split_blocks, pos // block_k + 1)
    offs = jnp.arange(block_k, dtype=jnp.int32)
    qc, qr = qc_ref[...], qr_ref[...]
    nt = (((1,), (1,)), ((), ()))

    def step(blk, carry):
        row, mask = key_rows(blk * block_k + offs, b, L, pos, (lambda i: lslot_ref[i], lslot_ref.shape[0]),
                             table_ref, page_size=page_size, dense=dense, num_pages=num_pages, num_keys=num_keys)
        c, kr = lat_ref[row, pl.ds(0, Dc)], lat_ref[row, pl.ds(Dc, Dr)]  # [BK, Dc], [BK, Dr]
        sc = (lax.dot_general(qc, c, nt, preferred_element_type=jnp.float32)
              + lax.dot_general(qr, kr, nt, preferred_element_type=jnp.float32)) * scale  # [ROWS, BK]
        return online_softmax_step(sc, mask[None, :], c, carry)

    o_ref[...], lse_ref[...] = softmax_split(lambda carry: lax.fori_loop(lo, hi, step, carry), *o_ref.shape)


def row_mla_splits(q_lat, q_pe, latent_buf, meta: AttnMeta, *, scale: float,
                   tiles: RowAttentionTiles | None = None, interpret: bool | None = None):
    """Absorbed MLA attention of q_lat [B,T,H,Dc], q_pe [B,T,H,Dr] over a latent cache that
    already holds the new rows (dense [B,S,Dc+Dr] or a pool [pages,P,Dc+Dr] with
    meta.page_table), each token computed alone (see the module), its splits unmerged, in
    `mla_output`'s layout: (o [B, NS, T*H, Dc] float32, each split normalised over its
    keys (zeros where it saw none), lse [B, NS, T*H] float32 (NEG_INF: no key)); row r is
    token r // H, head r % H."""
    check_mla_args(q_lat, q_pe, latent_buf, meta)
    t = RowAttentionTiles() if tiles is None else tiles
    B, T, H, Dc = q_lat.shape
    Dr = q_pe.shape[-1]
    page_size = latent_buf.shape[1]
    dense = meta.page_table is None
    table = jnp.zeros((B, 1), jnp.int32) if dense else meta.page_table.astype(jnp.int32)
    num_keys = page_size if dense else table.shape[1] * page_size
    HB = -(-H // ROWS)  # head blocks a token
    NS = num_splits(num_keys, t)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    def blocks(q):  # [B,T,H,D] -> [B,T,HB,ROWS,D], heads padded with zero rows
        return jnp.pad(q, ((0, 0), (0, 0), (0, HB * ROWS - H), (0, 0))).reshape(B, T, HB, ROWS, q.shape[-1])
    lslot = local_slots(meta)
    lat_flat = latent_buf.reshape((-1, Dc + Dr))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    kernel = functools.partial(
        _attend_kernel, scale=float(scale), block_k=t.block_k, split_blocks=t.split_blocks, page_size=page_size,
        dense=dense, num_pages=lat_flat.shape[0] // page_size, num_keys=num_keys, latent_dim=Dc)
    whole = pl.BlockSpec()
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, T, HB, NS),
        in_specs=[whole, whole, whole, whole,
                  pl.BlockSpec((None, None, None, ROWS, Dc), lambda b, i, g, s: (b, i, g, 0, 0)),
                  pl.BlockSpec((None, None, None, ROWS, Dr), lambda b, i, g, s: (b, i, g, 0, 0)),
                  pl.BlockSpec((None, None, lslot.shape[-1]), lambda b, i, g, s: (b, i, 0))],
        out_specs=[pl.BlockSpec((None, None, ROWS, Dc), lambda b, i, g, s: (b, s, i * HB + g, 0)),
                   pl.BlockSpec((None, None, ROWS), lambda b, i, g, s: (b, s, i * HB + g))],
        out_shape=[jax.ShapeDtypeStruct((B, NS, T * HB * ROWS, Dc), jnp.float32),
                   jax.ShapeDtypeStruct((B, NS, T * HB * ROWS), jnp.float32)],
        interpret=interpret, compiler_params=params, name="jspec_row_mla",
    )(meta.prefix_len.astype(jnp.int32), meta.positions.astype(jnp.int32), table, lat_flat, blocks(q_lat),
      blocks(q_pe), lslot)
    if HB * ROWS != H:  # padded head rows out (models' head counts are multiples of 16: no copy)
        o = o.reshape(B, NS, T, HB * ROWS, Dc)[:, :, :, :H].reshape(B, NS, T * H, Dc)
        lse = lse.reshape(B, NS, T, HB * ROWS)[:, :, :, :H].reshape(B, NS, T * H)
    return o, lse


def row_mla_output(q_lat, q_pe, latent_buf, meta: AttnMeta, w_uv, *, scale: float,
                   tiles: RowAttentionTiles | None = None, output_tiles: MlaOutputTiles | None = None,
                   interpret: bool | None = None):
    """`row_mla_splits` (tiles `tiles`, `Tuning.row_mla`; None: `MLA_TILES`), then
    `mla_output` (tiles `output_tiles`, `Tuning.mla_output`; None: the defaults) with its
    splits merged in split order (`ordered`: a program a token, head and column tile; the
    merged latent rounded, then W_UV[h]) -> o [B,T,H,Dv] in w_uv's dtype, as
    `mla_attention.mla_attention` gives it."""
    o, lse = row_mla_splits(q_lat, q_pe, latent_buf, meta, scale=scale, tiles=MLA_TILES if tiles is None else tiles,
                            interpret=interpret)
    return mla_output.mla_output(o, lse, w_uv, num_tokens=q_lat.shape[1], tiles=output_tiles, ordered=True,
                                 interpret=interpret)
