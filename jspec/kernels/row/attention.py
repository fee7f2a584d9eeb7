"""Row-invariant attention over the KV cache (Pallas, Triton lowering): a token's output is
the same bits whatever else shares the pass, so a verification node's attention equals the
decode step's at that node's position bit for bit (`Tuning.row_invariant`).

`decode_attention` puts every query row of a kv head into one tile and splits the keys by
the grid's size, both of which follow B x T, and reads a tree node's ancestors from their
node slots; each changes the order in which a row's softmax sums run. Here:
- a program's tile is 16 query rows of one kv head: a token's Gq heads padded to a power
  of two, and up to 16 / that many tokens side by side (more than 16 heads: several
  programs of one token; one token a program where `packs` says no: a cache of fewer than
  `RowAttentionTiles.pack_min_splits` splits, or `pack_tokens` False). The
  tile's shape is the same in a decode step and in a verification, and a row's products,
  maximum and sum use that row alone, so which tokens share it does not change its bits;
- keys are visited by POSITION in blocks of BK positions: position p < prefix_len sits in
  slot p, position prefix_len + j in the local slot of the token's depth-j ancestor (the
  local slot whose position is prefix_len + j among those the token sees), and positions
  after the token's own are masked. A node's block c then holds the keys a decode step at
  its position holds in its block c (chains are the case where ancestor j sits at
  prefix_len + j). Blocks wholly below prefix_len hold the same keys for every token, and
  so do all blocks for tokens in slot order (a chain's), so the tokens of a tile read them
  in one pass; a split holding local positions of a tree is read once a token, the first
  token's pass in the split's program and the others' in work items of their own
  (`boundary_splits`), so those passes run side by side;
- splits cover fixed ranges of `split_blocks` blocks (a function of the tiles only), and
  `_merge_kernel` adds them in split order for each token (the maximum first, then the
  weighted sums, over the rows that hold its heads), reading each split from the work item
  that computed it for that token, and writes [B, T, H, Dh] order. Blocks past a row's
  position are never visited, a split that saw nothing adds exact zeros (weight 0), and
  one split alone comes out as it went in, so the cache's capacity (how many splits there
  are) does not change the result either.
Assumes what jspec's caches hold: a committed token at position p sits in slot p, and the
local block's positions are prefix_len + depth.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.attention.decode import NEG_INF, check_attention_args, fp8_queries, online_softmax_step
from jspec.kernels.meta import AttnMeta, pool_rows
from jspec.kernels.tiling import in_order_fold, pow2_ceil


@dataclasses.dataclass(frozen=True)
class RowAttentionTiles:
    """Tiles of the row-invariant attention (`Tuning.row_attention`, `Tuning.row_mla`;
    `Tuning.row_invariant`): block_k positions a key block, split_blocks blocks a split
    (splits cover fixed position ranges, so these tiles, not the batch, decide a row's
    sums; plain and speculative programs must share them)."""

    block_k: int = 128  # the 8B shape's batch-1 step on an H100: (128, 1) 5.706 ms against 5.738
    split_blocks: int = 1  # with (128, 2), 5.733 with (64, 2), 5.739 with (64, 1) (docs/benchmarks.md)
    num_warps: int = 4
    num_stages: int = 2
    unroll_splits: int = 32  # the merge's walk over the splits written out up to this many
    pack_tokens: bool = True  # GQA: several tokens' heads in a program's 16 rows (`row_attention`); on an
    # H100 the 8B shape's 16-node tree round then costs 1.5% over the default's (10.7% unpacked: docs/benchmarks.md)
    pack_min_splits: int = 4  # ... where the cache holds at least this many splits (`row_attention.packs`): the
    # bundled pair's first run (2 splits) ran 5943 tokens/s unpacked, 5614 packed (H100, docs/benchmarks.md)
    merge_block_d: int = 32  # `row_attention`'s split merge: head dimensions a program

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


def key_rows(p, b, prefix, pos, lslot, table_ref, *, page_size: int, dense: bool, num_pages: int,
             num_keys: int):
    """Inside a kernel: the cache rows holding the keys at positions p [BK] that a token at
    position pos sees, by position (the slot p below the prefix, else the local slot
    `local_slots` names: lslot = (read, Tp), read(i) the token's entries i in [0, Tp);
    lslot None: the slot p everywhere, as in a chain), and the mask of those it sees
    (p <= pos, a slot exists; pos None: a slot exists). table_ref [B, G] (dense: unused;
    the cache is one page of page_size slots a row)."""
    if lslot is None:
        slot = p
    else:
        read, Tp = lslot
        rel = p - prefix
        slot = jnp.where(rel < 0, p, read(jnp.clip(rel, 0, Tp - 1)))
    mask = slot >= 0 if pos is None else (p <= pos) & (slot >= 0)
    slot = jnp.clip(slot, 0, num_keys - 1)
    return pool_rows(table_ref, b, slot, page_size=page_size, num_pages=num_pages, dense=dense), mask


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


def _attend_kernel(prefix_ref, pos_ref, table_ref, kv_ref, q_ref, lslot_ref, chain_ref, o_ref, lse_ref, *,
                   scale: float, block_k: int, split_blocks: int, page_size: int, dense: bool,
                   num_pages: int, num_keys: int, window: int, row_blocks: int, head_rows: int, tokens: int,
                   num_splits: int):
    """One (batch row b, token group tg, kv head x row block g, work item w): the 16 query
    rows hold `tokens` tokens' heads, head_rows rows a token (`row_attention`).

    prefix_ref [B], pos_ref [B, T] int32; table_ref [B, G] (dense: [B, 1], unused);
    kv_ref [num_pages * P, 2, Hkv, Dh]; q_ref [ROWS, Dh]; lslot_ref [B, T, Tp]
    (`local_slots`); chain_ref [B, Tg] int32 (`in_slot_order`); o_ref [ROWS, Dh] float32
    normalised over this item's keys; lse_ref [ROWS] (NEG_INF: no key).

    Work item w < num_splits is split w. Where every token of the group finds the key at
    position p in slot p (a split wholly below the prefix, or a group in slot order) one
    pass serves all the rows. Else each token needs a pass over its own keys: item w takes
    the first token's, and the items past num_splits (`boundary_splits`) take the other
    tokens' passes of the splits holding the local positions, one token an item, so these
    passes run side by side rather than one after another. A row's arithmetic is the same
    in every case (a [ROWS, BK] tile, its own row). The blocks are written out, so their
    loads need not wait for each other; an item no row sees is skipped."""
    b, tg, g, w = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    h = g // row_blocks
    T = pos_ref.shape[1]
    L = prefix_ref[b]
    split_keys = split_blocks * block_k
    extra = w >= num_splits  # another token's pass of a boundary split
    e = jnp.maximum(w - num_splits, 0)
    s = jnp.where(extra, L // split_keys + e // max(tokens - 1, 1), w)
    first_token = tg * tokens
    tok = jnp.minimum(first_token + jnp.arange(ROWS, dtype=jnp.int32) // head_rows, T - 1)  # [ROWS]
    pos = pos_ref[b, tok]  # [ROWS] each row's position
    first = jnp.maximum(pos - window + 1, 0) if window else jnp.zeros_like(pos)  # oldest visible position
    lo_row = jnp.maximum(s * split_blocks, first // block_k)
    hi_row = jnp.minimum((s + 1) * split_blocks, pos // block_k + 1)
    in_slots = ((s + 1) * split_keys <= L) | (chain_ref[b, tg] != 0)
    offs = jnp.arange(block_k, dtype=jnp.int32)
    q, factor = fp8_queries(kv_ref.dtype, q_ref[...])  # over an FP8 cache bf16 rows in float16, scaled (exact)

    def blocks(lslot, mine, carry):  # the split's blocks in order, the rows `mine` updated
        for c in range(split_blocks):
            blk = s * split_blocks + c
            p = blk * block_k + offs  # [BK] positions
            row, has_slot = key_rows(p, b, L, None, lslot, table_ref, page_size=page_size, dense=dense,
                                     num_pages=num_pages, num_keys=num_keys)
            mask = (p[None, :] <= pos[:, None]) & has_slot[None, :]
            if window:
                mask = mask & (p[None, :] >= first[:, None])
            k, v = kv_ref[row, 0, h, :].astype(q.dtype), kv_ref[row, 1, h, :].astype(q.dtype)  # [BK, Dh] (FP8: widened)
            sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * (scale if factor is None else scale * factor)
            new = online_softmax_step(sc, mask, v, carry)
            keep = mine & (blk >= lo_row) & (blk < hi_row)  # [ROWS]
            carry = (jnp.where(keep[:, None], new[0], carry[0]), jnp.where(keep, new[1], carry[1]),
                     jnp.where(keep, new[2], carry[2]))
        return carry

    def token_pass(j, carry):  # token first_token + j's keys, its rows updated
        t = jnp.minimum(first_token + j, T - 1)
        return blocks((lambda i: lslot_ref[b, t, i], lslot_ref.shape[-1]), (tok == t) & (first_token + j < T),
                      carry)

    def run(carry):  # one pass for the group, or the pass of this item's token
        j = jnp.where(extra, e % max(tokens - 1, 1) + 1, 0)
        return lax.cond(in_slots, lambda c: blocks(None, tok >= 0, c), lambda c: token_pass(j, c), carry)

    work = ~(extra & in_slots) & (s < num_splits)  # an item past num_splits: only where its split has token passes
    seen_any = work & (jnp.min(lo_row) < jnp.max(hi_row))
    o_ref[...], lse_ref[...] = softmax_split(lambda carry: lax.cond(seen_any, run, lambda c: c, carry), ROWS,
                                             q_ref.shape[-1])


def _merge_kernel(prefix_ref, chain_ref, o_ref, lse_ref, out_ref, *, num_splits: int, unroll_splits: int,
                  split_keys: int, boundary_splits: int, tokens: int):
    """One (b, token i, g, D block): o_ref [W, GP, DB], lse_ref [W, GP] (the attend
    kernel's work items, the token's rows) -> out_ref [GP, DB] (in its dtype): the splits
    weighted by their softmax mass and added in split order (written out up to
    unroll_splits splits), each read from the item that computed it for this token (for
    token j >= 1 of a group not in slot order, a boundary split's item past num_splits:
    `_attend_kernel`). A split that saw nothing has weight 0 and adds exact zeros; one
    split alone comes out as it went in (weight 1)."""
    b, i = pl.program_id(0), pl.program_id(1)
    GP = out_ref.shape[0]
    j = i % tokens  # the token's place in its group

    def item(s):  # the work item holding split s for this token
        if boundary_splits == 0:
            return s
        k = s - prefix_ref[b] // split_keys
        own = (chain_ref[b, i // tokens] == 0) & (j >= 1) & (k >= 0) & (k < boundary_splits)
        return jnp.where(own, num_splits + k * (tokens - 1) + j - 1, s)

    m = in_order_fold(num_splits, lambda s: lse_ref[item(s), :], jnp.full((GP,), NEG_INF, jnp.float32),
                      unroll_splits, jnp.maximum)

    def weight(s):
        return jnp.exp(lse_ref[item(s), :] - m)

    den = in_order_fold(num_splits, weight, jnp.zeros((GP,), jnp.float32), unroll_splits)
    acc = in_order_fold(num_splits, lambda s: weight(s)[:, None] * o_ref[item(s), :, :],
                        jnp.zeros(out_ref.shape, jnp.float32), unroll_splits)
    out_ref[...] = (acc / jnp.where(den > 0, den, 1.0)[:, None]).astype(out_ref.dtype)


def in_slot_order(lslot, prefix_len, tokens: int):
    """[B, Tg] int32: 1 where every token of the group of `tokens` finds the key at each
    position p it sees in slot p (the tokens of a chain; local slot prefix + j holds the
    depth-j ancestor), so one pass over slot-ordered keys serves the group. lslot
    [B, T, Tp] (`local_slots`)."""
    B, T, Tp = lslot.shape
    Tg = -(-T // tokens)
    j = jnp.arange(Tp, dtype=jnp.int32)
    ok = jnp.all((lslot < 0) | (lslot == prefix_len[:, None, None] + j), axis=-1)  # [B, T]
    ok = jnp.pad(ok, ((0, 0), (0, Tg * tokens - T)), constant_values=True)
    return jnp.all(ok.reshape(B, Tg, tokens), axis=-1).astype(jnp.int32)


def packs(num_splits: int, tiles: RowAttentionTiles) -> bool:
    """Whether a GQA tile holds several tokens' heads (`RowAttentionTiles.pack_tokens`):
    where the cache holds at least `pack_min_splits` splits. A pack shares its tokens'
    passes over the prefix; over a short cache there is little to share and its extra
    work items and merge reads cost more. Which tokens share a tile does not change a
    row's bits."""
    return tiles.pack_tokens and num_splits >= tiles.pack_min_splits


def boundary_splits(local_len: int, tokens: int, num_splits: int, tiles: RowAttentionTiles) -> int:
    """How many splits the local positions prefix_len .. prefix_len + local_len - 1 can
    touch (whatever prefix_len is), each a work item a token for tokens 1.. of a group
    (`_attend_kernel`); 0 for one token a group."""
    if tokens == 1:
        return 0
    split_keys = tiles.block_k * tiles.split_blocks
    return min(num_splits, (split_keys + local_len - 2) // split_keys + 1)


def row_attention(q, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
                  tiles: RowAttentionTiles | None = None, interpret: bool | None = None):
    """Attention of q [B,T,H,Dh] over a cache that already holds the new keys (dense
    [B,S,2,Hkv,Dh] or a pool [num_pages,P,2,Hkv,Dh] with meta.page_table), each token
    computed alone (see the module). -> [B,T,H,Dh] in q's dtype."""
    check_attention_args(q, kv_buf, meta, window)
    t = RowAttentionTiles() if tiles is None else tiles
    B, T, H, Dh = q.shape
    Hkv, page_size = kv_buf.shape[3], kv_buf.shape[1]
    dense = meta.page_table is None
    table = jnp.zeros((B, 1), jnp.int32) if dense else meta.page_table.astype(jnp.int32)
    num_keys = page_size if dense else table.shape[1] * page_size
    Gq = H // Hkv
    RB = -(-Gq // ROWS)  # row blocks a kv head
    GP = ROWS if RB > 1 else pow2_ceil(Gq)  # rows a token's heads take in a block
    NS = num_splits(num_keys, t)
    TPT = min(ROWS // GP, pow2_ceil(T)) if packs(NS, t) else 1  # tokens a block
    Tg = -(-T // TPT)
    NB = boundary_splits(meta.local_len, TPT, NS, t)
    W = NS + NB * (TPT - 1)  # work items a (token group, row block): the splits, then other tokens' passes
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    qr = q.reshape(B, T, Hkv, Gq, Dh)
    qr = jnp.pad(qr, ((0, 0), (0, Tg * TPT - T), (0, 0), (0, RB * GP - Gq), (0, 0)))
    qr = qr.reshape(B, Tg, TPT, Hkv, RB, GP, Dh).transpose(0, 1, 3, 4, 2, 5, 6).reshape(B, Tg, Hkv * RB, TPT * GP, Dh)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, ROWS - TPT * GP), (0, 0)))
    lslot = local_slots(meta)
    prefix = meta.prefix_len.astype(jnp.int32)
    chain = in_slot_order(lslot, prefix, TPT)
    kv_flat = kv_buf.reshape((-1, 2, Hkv, Dh))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    kernel = functools.partial(
        _attend_kernel, scale=float(scale), block_k=t.block_k, split_blocks=t.split_blocks,
        page_size=page_size, dense=dense, num_pages=kv_flat.shape[0] // page_size, num_keys=num_keys,
        window=int(window), row_blocks=RB, head_rows=GP, tokens=TPT, num_splits=NS)
    whole = pl.BlockSpec()
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, Tg, Hkv * RB, W),
        in_specs=[whole, whole, whole, whole,
                  pl.BlockSpec((None, None, None, ROWS, Dh), lambda b, i, g, w: (b, i, g, 0, 0)), whole, whole],
        out_specs=[pl.BlockSpec((None, None, None, None, ROWS, Dh), lambda b, i, g, w: (b, i, g, w, 0, 0)),
                   pl.BlockSpec((None, None, None, None, ROWS), lambda b, i, g, w: (b, i, g, w, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Tg, Hkv * RB, W, ROWS, Dh), jnp.float32),
                   jax.ShapeDtypeStruct((B, Tg, Hkv * RB, W, ROWS), jnp.float32)],
        interpret=interpret, compiler_params=params, name="jspec_row_attention",
    )(prefix, meta.positions.astype(jnp.int32), table, kv_flat, qr, lslot, chain)
    out = merge_splits_in_order(o, lse, prefix, chain, TPT, GP, q.dtype, num_splits=NS, boundary=NB,
                                split_keys=t.block_k * t.split_blocks, interpret=interpret, params=params,
                                unroll_splits=t.unroll_splits, block_d=t.merge_block_d)
    # [B, Tg*TPT, Hkv*RB, GP, Dh]: tokens, then heads in order (no transpose)
    return out.reshape(B, Tg * TPT, Hkv, RB * GP, Dh)[:, :T, :, :Gq].reshape(B, T, H, Dh)


def num_splits(num_keys: int, tiles: RowAttentionTiles) -> int:
    """Splits of `tiles`' fixed position ranges over a cache of num_keys slots (those past
    a row's position see nothing)."""
    return -(-num_keys // (tiles.block_k * tiles.split_blocks))


def merge_splits_in_order(o, lse, prefix, chain, tokens: int, head_rows: int, dtype, *, num_splits: int,
                          boundary: int, split_keys: int, interpret: bool, params, unroll_splits: int,
                          block_d: int):
    """o [B, Tg, G, W, ROWS, D] float32, lse [B, Tg, G, W, ROWS] (`_attend_kernel`'s work
    items, each normalised over its keys; a group's token j in rows j * head_rows ..) ->
    [B, Tg * tokens, G, head_rows, D] in dtype: each token's rows merged by `_merge_kernel`
    in a program of its own, block_d of D a program (a row's weights are the same in
    each). prefix [B], chain [B, Tg] int32 (`in_slot_order`) say which item holds a split
    for a token."""
    B, Tg, G, W, _, D = o.shape
    DB = block_d if D % block_d == 0 else D  # a block that does not divide D: the whole head
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=num_splits, unroll_splits=unroll_splits, split_keys=split_keys,
                          boundary_splits=boundary, tokens=tokens),
        grid=(B, Tg * tokens, G, D // DB),
        in_specs=[whole, whole,
                  pl.BlockSpec((None, None, None, W, head_rows, DB),
                               lambda b, i, g, d: (b, i // tokens, g, 0, i % tokens, d)),
                  pl.BlockSpec((None, None, None, W, head_rows),
                               lambda b, i, g, d: (b, i // tokens, g, 0, i % tokens))],
        out_specs=pl.BlockSpec((None, None, None, head_rows, DB), lambda b, i, g, d: (b, i, g, 0, d)),
        out_shape=jax.ShapeDtypeStruct((B, Tg * tokens, G, head_rows, D), dtype),
        interpret=interpret, compiler_params=params, name="jspec_row_attention_merge",
    )(prefix, chain, o, lse)
