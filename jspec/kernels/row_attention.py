"""Row-invariant attention over the KV cache (Pallas, Triton lowering): a token's output is
the same bits whatever else shares the pass, so a verification node's attention equals the
decode step's at that node's position bit for bit (`Tuning.row_invariant`).

`decode_attention` puts every query row of a kv head into one tile and splits the keys by
the grid's size, both of which follow B x T, and reads a tree node's ancestors from their
node slots; each changes the order in which a row's softmax sums run. Here:
- a program's tile is R query rows of one kv head (`RowAttentionTiles.rows`, a power of
  two of at least 16): a token's Gq heads padded to a power of two, and R / that many
  tokens side by side (more than R heads: several programs of one token;
  `RowAttentionTiles.pack_tokens` False: one token a program). The tile's shape is the
  same in a decode step and in a verification, and a row's products, maximum and sum use
  that row alone, so which tokens share it does not change its bits;
- keys are visited by POSITION in blocks of BK positions: position p < prefix_len sits in
  slot p, position prefix_len + j in the local slot of the token's depth-j ancestor (the
  local slot whose position is prefix_len + j among those the token sees), and positions
  after the token's own are masked. A node's block c then holds the keys a decode step at
  its position holds in its block c (chains are the case where ancestor j sits at
  prefix_len + j). Blocks wholly below prefix_len hold the same keys for every token, so
  the tokens of a tile read them once; a block beyond is read once a token (its rows
  updated, the others kept);
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
from jspec.kernels.tiling import in_order_fold, pow2_ceil

ROWS = 16  # the smallest tensor-core tile: the fewest query rows a program has (`RowAttentionTiles.rows`)


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


def key_rows(p, b, prefix, pos, lslot, table_ref, *, page_size: int, dense: bool, num_pages: int,
             num_keys: int):
    """Inside a kernel: the cache rows holding the keys at positions p [BK] that a token at
    position pos sees, by position (the slot p below the prefix, else the local slot
    `local_slots` names: lslot = (read, Tp), read(i) the token's entries i in [0, Tp)),
    and the mask of those it sees (p <= pos, a slot exists; pos None: a slot exists).
    table_ref [B, G] (dense: unused; the cache is one page of page_size slots a row)."""
    read, Tp = lslot
    rel = p - prefix
    slot = jnp.where(rel < 0, p, read(jnp.clip(rel, 0, Tp - 1)))
    mask = slot >= 0 if pos is None else (p <= pos) & (slot >= 0)
    slot = jnp.clip(slot, 0, num_keys - 1)
    if dense:
        return b * page_size + slot, mask
    page = table_ref[b, lax.div(slot, page_size)]
    return jnp.clip(page, 0, num_pages - 1) * page_size + lax.rem(slot, page_size), mask


def softmax_split(run, rows: int, dim: int):
    """Inside a kernel: run(carry) -> carry, the online softmax over a split's key blocks
    (`online_softmax_step`; carry (acc [rows, dim], running max [rows], sum [rows])) ->
    (the split's output normalised over its keys [rows, dim] float32, its log-sum-exp
    [rows], NEG_INF with zeros where it saw no key)."""
    carry = (jnp.zeros((rows, dim), jnp.float32), jnp.full((rows,), NEG_INF, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    acc, m, l = run(carry)
    seen = l > 0
    return (acc / jnp.where(seen, l, 1.0)[:, None],
            jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF))


def _attend_kernel(prefix_ref, pos_ref, table_ref, kv_ref, q_ref, lslot_ref, o_ref, lse_ref, *,
                   scale: float, block_k: int, split_blocks: int, page_size: int, dense: bool,
                   num_pages: int, num_keys: int, window: int, row_blocks: int, head_rows: int, tokens: int):
    """One (batch row b, run of TG token groups tp, kv head x row block g, split s): each
    group's R query rows (`RowAttentionTiles.rows`) hold `tokens` tokens' heads, head_rows
    rows a token (`row_attention`); the program takes its TG groups one after another.

    prefix_ref [B], pos_ref [B, T] int32; table_ref [B, G] (dense: [B, 1], unused);
    kv_ref [num_pages * P, 2, Hkv, Dh]; q_ref [TG, R, Dh]; lslot_ref [B, T, Tp]
    (`local_slots`); o_ref [TG, R, Dh] float32 normalised over this split's keys; lse_ref
    [TG, R] (NEG_INF: no key).

    Each row walks the blocks its token sees in this split, in order, with its own mask; a
    split wholly below the prefix holds the same keys (slot p) for every row, so one pass
    serves a group, else one pass a token reads that token's keys and updates its rows
    only. A split of one block below the prefix is loaded once for all TG groups. A row's
    arithmetic is the same in every case (a [R, BK] tile, its own row)."""
    b, tp, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    h = g // row_blocks
    T = pos_ref.shape[1]
    L = prefix_ref[b]
    TG, R, Dh = q_ref.shape
    shared = (s + 1) * split_blocks * block_k <= L
    offs = jnp.arange(block_k, dtype=jnp.int32)

    def block_keys(blk, t):  # block blk as token t sees it: positions, cache rows, has-a-slot [BK]
        p = blk * block_k + offs
        row, has_slot = key_rows(p, b, L, None, (lambda i: lslot_ref[b, t, i], lslot_ref.shape[-1]), table_ref,
                                 page_size=page_size, dense=dense, num_pages=num_pages, num_keys=num_keys)
        return p, row, has_slot

    def load(row):  # [BK] cache rows -> keys, values [BK, Dh]
        return kv_ref[row, 0, h, :], kv_ref[row, 1, h, :]

    once = split_blocks == 1 and TG > 1  # the split's one block, loaded once for every group
    if once:
        p_once, row_once, has_once = block_keys(s, 0)
        kv_once = lax.cond(shared, lambda: load(row_once),
                           lambda: (jnp.zeros((block_k, Dh), kv_ref.dtype), jnp.zeros((block_k, Dh), kv_ref.dtype)))

    def group(i, _):
        first_token = (tp * TG + i) * tokens
        tok = jnp.minimum(first_token + jnp.arange(R, dtype=jnp.int32) // head_rows, T - 1)  # [R]
        pos = pos_ref[b, tok]  # [R] each row's position
        first = jnp.maximum(pos - window + 1, 0) if window else jnp.zeros_like(pos)  # oldest visible position
        lo_row = jnp.maximum(s * split_blocks, first // block_k)
        hi_row = jnp.minimum((s + 1) * split_blocks, pos // block_k + 1)
        q = q_ref[i]  # [R, Dh]

        def update(blk, p, has_slot, kv, mine, carry):  # the rows `mine` of carry after block blk
            mask = (p[None, :] <= pos[:, None]) & has_slot[None, :]
            if window:
                mask = mask & (p[None, :] >= first[:, None])
            k, v = kv
            sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
            new = online_softmax_step(sc, mask, v, carry)
            keep = mine & (blk >= lo_row) & (blk < hi_row)  # [R]
            return (jnp.where(keep[:, None], new[0], carry[0]), jnp.where(keep, new[1], carry[1]),
                    jnp.where(keep, new[2], carry[2]))

        def token_pass(j, carry):
            t = jnp.minimum(first_token + j, T - 1)  # the pass's token (any one when shared)
            mine = shared | (tok == t)  # [R] the rows this pass updates

            def step(blk, carry):
                p, row, has_slot = block_keys(blk, t)
                return update(blk, p, has_slot, load(row), mine, carry)

            return lax.fori_loop(jnp.min(lo_row), jnp.max(hi_row), step, carry)

        def passes(carry):
            n = jnp.where(shared, 1, jnp.minimum(tokens, T - first_token))
            return lax.fori_loop(0, n, token_pass, carry)

        if once:  # rows outside [lo_row, hi_row) keep their carry, as when the loop skips the block
            run = lambda carry: lax.cond(shared, lambda c: update(s, p_once, has_once, kv_once, tok >= 0, c),
                                         passes, carry)
        else:
            run = passes
        o_ref[i], lse_ref[i] = softmax_split(run, R, Dh)
        return 0

    lax.fori_loop(0, TG, group, 0)


def _merge_kernel(o_ref, lse_ref, out_ref, *, num_splits: int, unroll_splits: int):
    """One (b, t, g): o_ref [NS, MR, Dh], lse_ref [NS, MR] (the first MR of the R rows:
    those that hold heads) -> out_ref [MR, Dh] (in its dtype), the splits weighted by their softmax mass
    and added in split order (written out up to unroll_splits splits). A split that saw
    nothing has weight 0 and adds exact zeros; one split alone comes out as it went in
    (weight 1), as when there is no merge."""
    MR = out_ref.shape[0]
    m = in_order_fold(num_splits, lambda i: lse_ref[i, :], jnp.full((MR,), NEG_INF, jnp.float32),
                      unroll_splits, jnp.maximum)

    def weight(i):
        return jnp.exp(lse_ref[i, :] - m)

    den = in_order_fold(num_splits, weight, jnp.zeros((MR,), jnp.float32), unroll_splits)
    acc = in_order_fold(num_splits, lambda i: weight(i)[:, None] * o_ref[i, :, :],
                        jnp.zeros(out_ref.shape, jnp.float32), unroll_splits)
    out_ref[...] = (acc / jnp.where(den > 0, den, 1.0)[:, None]).astype(out_ref.dtype)


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
    R = t.rows
    if R < ROWS or R & (R - 1):
        raise ValueError(f"RowAttentionTiles.rows must be a power of two of at least {ROWS}, got {R}")
    RB = -(-Gq // R)  # row blocks a kv head
    GP = R if RB > 1 else pow2_ceil(Gq)  # rows a token's heads take in a block
    TPT = R // GP if t.pack_tokens else 1  # tokens a block
    Tg = -(-T // TPT)  # token groups
    TG = Tg if t.token_loop else 1  # token groups a program
    NS = num_splits(num_keys, t)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    qr = q.reshape(B, T, Hkv, Gq, Dh)
    qr = jnp.pad(qr, ((0, 0), (0, Tg * TPT - T), (0, 0), (0, RB * GP - Gq), (0, 0)))
    qr = qr.reshape(B, Tg, TPT, Hkv, RB, GP, Dh).transpose(0, 1, 3, 4, 2, 5, 6).reshape(B, Tg, Hkv * RB, TPT * GP, Dh)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, R - TPT * GP), (0, 0)))
    lslot = local_slots(meta)
    kv_flat = kv_buf.reshape((-1, 2, Hkv, Dh))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    kernel = functools.partial(
        _attend_kernel, scale=float(scale), block_k=t.block_k, split_blocks=t.split_blocks,
        page_size=page_size, dense=dense, num_pages=kv_flat.shape[0] // page_size, num_keys=num_keys,
        window=int(window), row_blocks=RB, head_rows=R // TPT, tokens=TPT)
    whole = pl.BlockSpec()
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, Tg // TG, Hkv * RB, NS),
        in_specs=[whole, whole, whole, whole,
                  pl.BlockSpec((None, TG, None, R, Dh), lambda b, i, g, s: (b, i, g, 0, 0)), whole],
        out_specs=[pl.BlockSpec((None, TG, None, None, R, Dh), lambda b, i, g, s: (b, i, g, s, 0, 0)),
                   pl.BlockSpec((None, TG, None, None, R), lambda b, i, g, s: (b, i, g, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Tg, Hkv * RB, NS, R, Dh), jnp.float32),
                   jax.ShapeDtypeStruct((B, Tg, Hkv * RB, NS, R), jnp.float32)],
        interpret=interpret, compiler_params=params, name="jspec_row_attention",
    )(meta.prefix_len.astype(jnp.int32), meta.positions.astype(jnp.int32), table, kv_flat, qr, lslot)
    out = merge_splits_in_order(o, lse, TPT * GP, q.dtype, interpret=interpret, params=params,
                                unroll_splits=t.unroll_splits)  # [B, Tg, Hkv * RB, TPT * GP, Dh]
    out = out.reshape(B, Tg, Hkv, RB, TPT, GP, Dh).transpose(0, 1, 4, 2, 3, 5, 6)
    return out.reshape(B, Tg * TPT, Hkv, RB * GP, Dh)[:, :T, :, :Gq].reshape(B, T, H, Dh)


def num_splits(num_keys: int, tiles: RowAttentionTiles) -> int:
    """Splits of `tiles`' fixed position ranges over a cache of num_keys slots, a power of
    two (those past a row's position see nothing)."""
    return pow2_ceil(-(-num_keys // (tiles.block_k * tiles.split_blocks)))


def merge_splits_in_order(o, lse, rows: int, dtype, *, interpret: bool, params, unroll_splits: int):
    """o [B, T, G, NS, R, D] float32, lse [B, T, G, NS, R] (each split normalised over
    its keys) -> [B, T, G, rows, D] in dtype: the first `rows` rows merged by
    `_merge_kernel` (NS == 1: the split as it is, which the merge would give too)."""
    B, T, G, NS, _, D = o.shape
    if NS == 1:
        return o[:, :, :, 0, :rows].astype(dtype)
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=NS, unroll_splits=unroll_splits),
        grid=(B, T, G),
        in_specs=[pl.BlockSpec((None, None, None, NS, rows, D), lambda b, i, g: (b, i, g, 0, 0, 0)),
                  pl.BlockSpec((None, None, None, NS, rows), lambda b, i, g: (b, i, g, 0, 0))],
        out_specs=pl.BlockSpec((None, None, None, rows, D), lambda b, i, g: (b, i, g, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, G, rows, D), dtype),
        interpret=interpret, compiler_params=params, name="jspec_row_attention_merge",
    )(o, lse)
