"""Row-invariant attention over the KV cache (Pallas, Triton lowering): a token's output is
the same bits whatever else shares the pass, so a verification node's attention equals the
decode step's at that node's position bit for bit (`Tuning.row_invariant`).

`decode_attention` puts every query row of a kv head into one tile and splits the keys by
the grid's size, both of which follow B x T, and reads a tree node's ancestors from their
node slots; each changes the order in which a row's softmax sums run. Here:
- a program takes ONE token's Gq query heads of one kv head, padded to 16 rows (more than
  16 heads: several programs), so the tile a row sits in is the same in a decode step and
  in a verification;
- keys are visited by POSITION in blocks of BK positions: position p < prefix_len sits in
  slot p, position prefix_len + j in the local slot of the token's depth-j ancestor (the
  local slot whose position is prefix_len + j among those the token sees), and positions
  after the token's own are masked. A node's block c then holds the keys a decode step at
  its position holds in its block c (chains are the case where ancestor j sits at
  prefix_len + j);
- splits cover fixed ranges of `split_blocks` blocks (a function of the tiles only), and
  `_merge_kernel` adds them in split order (the maximum first, then the weighted sums,
  over the rows that hold heads). Blocks past a row's position are never visited, a
  split that saw nothing adds exact zeros (weight 0), and one split alone comes out as it
  went in, so the cache's capacity (how many splits there are) does not change the
  result either.
Assumes what jspec's caches hold: a committed token at position p sits in slot p, and the
local block's positions are prefix_len + depth.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.cache.layout import AttnMeta
from jspec.config import RowAttentionTiles
from jspec.kernels.decode_attention import NEG_INF, _check_args, online_softmax_step
from jspec.kernels.tiling import pow2_ceil

ROWS = 16  # query rows a program: the smallest tensor-core tile, fixed so no row's tile changes


def local_slots(meta: AttnMeta):
    """[B, T, Tp] int32 (Tp: Tl padded to a power of two >= 16): for token t, the slot
    holding the key at position prefix_len + j that t sees (its depth-j ancestor or
    itself), -1 where it sees none."""
    Tl = meta.local_len
    depth = meta.local_positions - meta.prefix_len[:, None]  # [B, Tl]
    j = jnp.arange(Tl, dtype=jnp.int32)
    hit = meta.local_mask[:, :, None, :] & (depth[:, None, None, :] == j[None, None, :, None])  # [B,T,j,i]
    slot = meta.prefix_len[:, None, None, None] + jnp.arange(Tl, dtype=jnp.int32)
    out = jnp.max(jnp.where(hit, slot, -1), axis=-1).astype(jnp.int32)  # [B, T, Tl]
    Tp = max(16, pow2_ceil(Tl))
    return jnp.pad(out, ((0, 0), (0, 0), (0, Tp - Tl)), constant_values=-1)


def key_rows(p, b, prefix, pos, lslot_ref, table_ref, *, page_size: int, dense: bool, num_pages: int,
             num_keys: int):
    """Inside a kernel: the cache rows holding the keys at positions p [BK] that token
    (b, position pos) sees, by position (the slot p below the prefix, else the local slot
    `local_slots` names), and the mask of those it sees (p <= pos, a slot exists).
    table_ref [B, G] (dense: unused; the cache is one page of page_size slots a row)."""
    Tp = lslot_ref.shape[0]
    rel = p - prefix
    slot = jnp.where(rel < 0, p, lslot_ref[jnp.clip(rel, 0, Tp - 1)])
    mask = (p <= pos) & (slot >= 0)
    slot = jnp.clip(slot, 0, num_keys - 1)
    if dense:
        return b * page_size + slot, mask
    page = table_ref[b, lax.div(slot, page_size)]
    return jnp.clip(page, 0, num_pages - 1) * page_size + lax.rem(slot, page_size), mask


def softmax_split(lo, hi, step, o_ref, lse_ref):
    """Inside a kernel: the online softmax `step` (`online_softmax_step` of a key block)
    over blocks [lo, hi), then the split's output normalised over its keys into o_ref
    [ROWS, D] and its log-sum-exp into lse_ref [ROWS] (NEG_INF, with zeros, where it saw no
    key)."""
    carry = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full((ROWS,), NEG_INF, jnp.float32),
             jnp.zeros((ROWS,), jnp.float32))
    acc, m, l = lax.fori_loop(lo, hi, step, carry)
    seen = l > 0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)


def _attend_kernel(prefix_ref, pos_ref, table_ref, kv_ref, q_ref, lslot_ref, o_ref, lse_ref, *,
                   scale: float, block_k: int, split_blocks: int, page_size: int, dense: bool,
                   num_pages: int, num_keys: int, window: int, row_blocks: int):
    """One (batch row b, token t, kv head x row block g, split s).

    prefix_ref [B], pos_ref [B, T] int32; table_ref [B, G] (dense: [B, 1], unused);
    kv_ref [num_pages * P, 2, Hkv, Dh]; q_ref [ROWS, Dh]; lslot_ref [Tp] (`local_slots`);
    o_ref [ROWS, Dh] float32 normalised over this split's keys; lse_ref [ROWS] (NEG_INF:
    no key)."""
    b, t, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    h = g // row_blocks
    L, pos = prefix_ref[b], pos_ref[b, t]
    first = jnp.maximum(pos - window + 1, 0) if window else 0  # oldest visible position
    lo = jnp.maximum(s * split_blocks, first // block_k)
    hi = jnp.minimum((s + 1) * split_blocks, pos // block_k + 1)
    offs = jnp.arange(block_k, dtype=jnp.int32)
    q = q_ref[...]

    def step(blk, carry):
        p = blk * block_k + offs  # [BK] positions
        row, mask = key_rows(p, b, L, pos, lslot_ref, table_ref, page_size=page_size, dense=dense,
                             num_pages=num_pages, num_keys=num_keys)
        if window:
            mask = mask & (p >= first)
        k, v = kv_ref[row, 0, h, :], kv_ref[row, 1, h, :]  # [BK, Dh]
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        return online_softmax_step(sc, mask[None, :], v, carry)

    softmax_split(lo, hi, step, o_ref, lse_ref)


def _merge_kernel(o_ref, lse_ref, out_ref, *, num_splits: int):
    """One (b, t, g): o_ref [NS, MR, Dh], lse_ref [NS, MR] (the first MR of the 16 rows:
    those that hold heads) -> out_ref [MR, Dh], the splits weighted by their softmax mass
    and added in split order. A split that saw nothing has weight 0 and adds exact zeros;
    one split alone comes out as it went in (weight 1), as when there is no merge."""
    MR = out_ref.shape[0]
    m = lax.fori_loop(0, num_splits, lambda i, m: jnp.maximum(m, lse_ref[i, :]),
                      jnp.full((MR,), NEG_INF, jnp.float32))

    def add(i, carry):
        acc, den = carry
        w = jnp.exp(lse_ref[i, :] - m)
        return acc + w[:, None] * o_ref[i, :, :], den + w

    acc, den = lax.fori_loop(0, num_splits, add, (jnp.zeros(out_ref.shape, jnp.float32),
                                                  jnp.zeros((MR,), jnp.float32)))
    out_ref[...] = acc / jnp.where(den > 0, den, 1.0)[:, None]


def row_attention(q, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
                  tiles: RowAttentionTiles | None = None, interpret: bool | None = None):
    """Attention of q [B,T,H,Dh] over a cache that already holds the new keys (dense
    [B,S,2,Hkv,Dh] or a pool [num_pages,P,2,Hkv,Dh] with meta.page_table), each token
    computed alone (see the module). -> [B,T,H,Dh] in q's dtype."""
    _check_args(q, kv_buf, meta, window)
    t = RowAttentionTiles() if tiles is None else tiles
    B, T, H, Dh = q.shape
    Hkv, page_size = kv_buf.shape[3], kv_buf.shape[1]
    dense = meta.page_table is None
    table = jnp.zeros((B, 1), jnp.int32) if dense else meta.page_table.astype(jnp.int32)
    num_keys = page_size if dense else table.shape[1] * page_size
    Gq = H // Hkv
    RB = -(-Gq // ROWS)  # row blocks a kv head
    NS = num_splits(num_keys, t)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    qr = q.reshape(B, T, Hkv, Gq, Dh)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, RB * ROWS - Gq), (0, 0))).reshape(B, T, Hkv * RB, ROWS, Dh)
    lslot = local_slots(meta)
    kv_flat = kv_buf.reshape((-1, 2, Hkv, Dh))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    kernel = functools.partial(
        _attend_kernel, scale=float(scale), block_k=t.block_k, split_blocks=t.split_blocks,
        page_size=page_size, dense=dense, num_pages=kv_flat.shape[0] // page_size, num_keys=num_keys,
        window=int(window), row_blocks=RB)
    whole = pl.BlockSpec()
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, T, Hkv * RB, NS),
        in_specs=[whole, whole, whole, whole,
                  pl.BlockSpec((None, None, None, ROWS, Dh), lambda b, i, g, s: (b, i, g, 0, 0)),
                  pl.BlockSpec((None, None, lslot.shape[-1]), lambda b, i, g, s: (b, i, 0))],
        out_specs=[pl.BlockSpec((None, None, None, None, ROWS, Dh), lambda b, i, g, s: (b, i, g, s, 0, 0)),
                   pl.BlockSpec((None, None, None, None, ROWS), lambda b, i, g, s: (b, i, g, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, T, Hkv * RB, NS, ROWS, Dh), jnp.float32),
                   jax.ShapeDtypeStruct((B, T, Hkv * RB, NS, ROWS), jnp.float32)],
        interpret=interpret, compiler_params=params, name="jspec_row_attention",
    )(meta.prefix_len.astype(jnp.int32), meta.positions.astype(jnp.int32), table, kv_flat, qr, lslot)
    MR = ROWS if RB > 1 else min(ROWS, pow2_ceil(Gq))  # rows that hold heads
    out = merge_splits_in_order(o, lse, MR, interpret=interpret, params=params)
    out = out.reshape(B, T, Hkv, RB * MR, Dh)[:, :, :, :Gq]
    return out.reshape(B, T, H, Dh).astype(q.dtype)


def num_splits(num_keys: int, tiles: RowAttentionTiles) -> int:
    """Splits of `tiles`' fixed position ranges over a cache of num_keys slots, a power of
    two (those past a row's position see nothing)."""
    return pow2_ceil(-(-num_keys // (tiles.block_k * tiles.split_blocks)))


def merge_splits_in_order(o, lse, rows: int, *, interpret: bool, params):
    """o [B, T, G, NS, ROWS, D] float32, lse [B, T, G, NS, ROWS] (each split normalised over
    its keys) -> [B, T, G, rows, D] float32: the first `rows` rows merged by
    `_merge_kernel` (NS == 1: the split as it is, which the merge would give too)."""
    B, T, G, NS, _, D = o.shape
    if NS == 1:
        return o[:, :, :, 0, :rows]
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=NS),
        grid=(B, T, G),
        in_specs=[pl.BlockSpec((None, None, None, NS, rows, D), lambda b, i, g: (b, i, g, 0, 0, 0)),
                  pl.BlockSpec((None, None, None, NS, rows), lambda b, i, g: (b, i, g, 0, 0))],
        out_specs=pl.BlockSpec((None, None, None, rows, D), lambda b, i, g: (b, i, g, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, G, rows, D), jnp.float32),
        interpret=interpret, compiler_params=params, name="jspec_row_attention_merge",
    )(o, lse)
