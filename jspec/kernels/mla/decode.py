"""Pallas (Triton) MLA attention for decode and tree verification over the latent cache.

Same semantics as `mla_attention_reference` for a non-prefill AttnMeta: the queries are in
the absorbed form (q_lat [B,T,H,Dc] scores the latent c, q_pe [B,T,H,Dr] the roped key
k_pe, both read from one slot row [Dc + Dr] of `jspec.cache.latent`), the mask is the
cache's (`jspec.kernels.attention.decode.cache_mask`: every prefix slot, the local block per
`local_mask`), and the output is the softmax-weighted latent o_lat [B,T,H,Dc] in float32.
It is MQA with one shared kv head whose keys are the whole row and whose values are its
first Dc columns, so one load of a key block serves both matrix products.

Design (flash decoding):
- The T*H query rows of a batch row (row r: token r // H, head r % H, the natural order
  of q_lat, so no transpose) are taken BR at a time (BR a power of two >= 16, default
  `default_block_rows`) as a [BR, Dc] latent tile and a [BR, Dr] rope tile; rows are padded
  to a multiple of BR only when T*H is not one already.
- Grid (R // BR, num_splits, B), the row blocks fastest: the programs that run side by
  side share their key blocks through L2, so the cache is read from memory about once
  however many row blocks there are. One program runs an online softmax over one
  contiguous share of its row's key blocks; `merge_splits` combines the splits.
- Keys come in blocks of BK slots, gathered row by row through the page table (slot ->
  page_table[b, slot // P] * P + slot % P), so any page size works; a dense cache [B, S,
  Dc+Dr] is one page of S slots per row. Dc + Dr (576 for DeepSeek) is no power of two, so
  a block is loaded as two tiles, the latent [BK, Dc] and the rope part [BK, Dr]; the
  scores are the sum of two dot products, and the latent tile is also the value tile.
- A row visits blocks [0, eblk), eblk = cdiv(min(prefix_len + Tl, S), BK). Blocks before
  pblk = prefix_len // BK hold prefix slots only and need no mask; the few from pblk on
  take an int8 mask [BR, BK] gathered from `tail_mask` [B, T, NL*BK] (one row per token,
  not per head), which the wrapper builds with the exact rule of the reference.

Registers: the float32 accumulator [BR, Dc] (Dc = 512) dominates: 128 values a thread with
BR = 64 and 8 warps. BR = 64 (fewer row blocks re-reading the keys, bigger tensor-core
tiles) for many query rows in all, BR = 16 for few (batch 1 decode and verify: the
programs are shorter and more of them run at once), `default_block_rows`. The tiles and
their measurements: `MlaDecodeTiles` (below; `Tuning.mla_decode`), taken as `tiles=`.

A query row that sees no key at all gets zeros (the reference gives a meaningless uniform
average there).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.attention.decode import (REFERENCE_BLOCK_K, attend_cache_in_blocks, cache_mask, check_meta,
                                            merge_splits, online_softmax_step, pad_slots, slot_table, walk_split)
from jspec.kernels.meta import AttnMeta, pool_rows, read_kv, widened
from jspec.kernels.tiling import KERNEL_DTYPES, is_pow2, pow2_ceil


@dataclasses.dataclass(frozen=True)
class MlaDecodeTiles:
    """Tiles of MLA attention over the latent cache (flash decoding; `Tuning.mla_decode`).

    On the H200 (benchmarks/kernels.py mla, bf16, 2026-11-23) 64 query rows a program
    beat 32 by 20-28% at H = 128 with batch 32 or T = 16 (fewer row blocks re-reading the
    keys, bigger tensor-core tiles); block_k 32 with 3 stages was slower."""

    block_rows: int = 64  # query rows a program above small_rows_max rows in all (float32: half)
    # Up to this many query rows in all (B*T*H) a program takes 16 rows (the smallest
    # tensor-core M): at batch 1 on the H200 (mla_b1_configs, a probe at 3bf4f68 rows, 1k context)
    # the MLA kernel took 6.2 against 12.7 us for 4 tokens of 16 heads, 6.2 against 9.0 for
    # 2, 8.1 against 13.2 for 1 token of 128 heads and 17.7 against 26.6 for 4 of them,
    # with 64 rows a program.
    small_rows_max: int = 512
    block_k: int = 64  # key slots a block, 16-bit caches (float32: half)
    target_programs: int = 264  # about two waves of programs on an H200 (132 SMs)
    num_warps: int | None = None  # None: 4, or 8 for row tiles above 16 x 512
    num_stages: int = 2
    # A prompt's blocks after the first attend in the non-absorbed form, the cached latent
    # up-projected a key block at a time (`jspec.kernels.mla.prefill`), not through this kernel.
    expanded_prompt_blocks: bool = True

NEG_INF = -1e30
MIN_ROWS = 16  # smallest M of a tensor-core dot in Triton


def mla_attention_reference(q_lat, q_pe, latent_buf, meta: AttnMeta, *, scale: float, select=None,
                            block_k: int = REFERENCE_BLOCK_K):
    """q_lat [B,T,H,Dc], q_pe [B,T,H,Dr]; latent_buf: the layer's buffer, already holding
    the new rows; select [B,T,Sk] bool or None: the slots each token may attend to beside
    the mask rule (sparse attention's selection). -> o_lat [B,T,H,Dc] float32 (softmax in
    float32). Over more than block_k slots without a selection, an online
    softmax over blocks of them (`attend_in_blocks`: the MLA as one key head of Dc + Dr
    values, the latent its values), so the scores stay [B, H, T, block]."""
    Dc = q_lat.shape[-1]
    rows = widened(read_kv(latent_buf, meta.page_table), q_lat.dtype)  # [B, Sk, Dc + Dr]
    Sk = rows.shape[1]
    if select is None and Sk > block_k:
        BK = block_k
        keys = pad_slots(rows, BK).astype(jnp.float32)[:, None]  # [B, 1, Sk', Dc + Dr]

        def keys_at(i):
            block = lax.dynamic_slice_in_dim(keys, i * BK, BK, axis=2)
            return block, block[..., :Dc]
        q = jnp.concatenate([q_lat, q_pe], axis=-1).astype(jnp.float32)
        return attend_cache_in_blocks(q, keys_at, meta, Sk, BK, scale)
    c, k_pe = rows[..., :Dc], rows[..., Dc:]
    s = (jnp.einsum("bthc,bsc->bhts", q_lat, c, preferred_element_type=jnp.float32)
         + jnp.einsum("bthr,bsr->bhts", q_pe, k_pe, preferred_element_type=jnp.float32)) * scale
    mask = cache_mask(meta, rows.shape[1], q_lat.shape[1])
    if select is not None:
        mask = mask & select
    s = jnp.where(mask[:, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(c.dtype)
    # p rounded to the cache dtype; products of two such values are exact in float32 (and
    # XLA's CPU dot has no bf16 x bf16 -> f32 form for this contraction)
    return jnp.einsum("bhts,bsc->bthc", p.astype(jnp.float32), c.astype(jnp.float32))


def mla_decode_reference(q_lat, q_pe, latent_buf, meta: AttnMeta, *, scale: float):
    """The reference for `paged_mla_attention` (same arguments)."""
    return mla_attention_reference(q_lat, q_pe, latent_buf, meta, scale=scale)


# --------------------------------------------------------------------------- kernel

def _mla_kernel(bounds_ref, table_ref, tail_mask_ref, lat_ref, qc_ref, qr_ref, o_ref, lse_ref, *,
                scale: float, block_k: int, page_size: int, dense: bool, num_pages: int,
                num_keys: int, num_splits: int, latent_dim: int, num_heads: int, num_tokens: int):
    """One (query-row block r, split s, batch row b).

    bounds_ref [B, 2] int32: pblk, eblk of each row (see the module docstring).
    table_ref [B, G] int32: page table (entries >= num_pages: unallocated, clamped).
    tail_mask_ref [B, T, C] int8 (C = NL*BK): whether token t sees slot pblk*BK + c.
    lat_ref [num_pages * P, Dc + Dr]: the latent pool flattened over pages (dense: one
    page of S slots per batch row, so no table lookup).
    qc_ref [BR, Dc], qr_ref [BR, Dr]: this block's query rows (row r: token r // H).
    o_ref [BR, Dc] float32: this split's softmax-weighted latent (normalised over its keys);
    lse_ref [BR] float32: log of its softmax denominator (NEG_INF where it saw no key).
    """
    r, s, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    Dc = latent_dim
    Dr = qr_ref.shape[-1]
    pblk, eblk = bounds_ref[b, 0], bounds_ref[b, 1]
    per_split = pl.cdiv(eblk, num_splits)
    lo = s * per_split
    hi = jnp.minimum(lo + per_split, eblk)

    qc = qc_ref[...]  # [BR, Dc]
    qr = qr_ref[...]  # [BR, Dr]
    BR = qc.shape[0]
    offs = jnp.arange(block_k, dtype=jnp.int32)  # [BK]
    tok = jnp.minimum((r * BR + jnp.arange(BR, dtype=jnp.int32)) // num_heads, num_tokens - 1)  # [BR]

    def load(blk):
        slot = jnp.minimum(blk * block_k + offs, num_keys - 1)  # [BK], clamped in range
        row = pool_rows(table_ref, b, slot, page_size=page_size, num_pages=num_pages, dense=dense)
        return lat_ref[row, pl.ds(0, Dc)], lat_ref[row, pl.ds(Dc, Dr)]  # [BK, Dc], [BK, Dr]

    def step(blk, carry, mask):
        c, kr = load(blk)  # carry: acc [BR, Dc], m [BR], l [BR]; the latent is also the value
        nt = (((1,), (1,)), ((), ()))
        sc = (lax.dot_general(qc, c, nt, preferred_element_type=jnp.float32)
              + lax.dot_general(qr, kr, nt, preferred_element_type=jnp.float32)) * scale  # [BR, BK]
        return online_softmax_step(sc, mask, c, carry)

    def prefix_block(blk, carry):  # prefix slots only: all visible
        return step(blk, carry, None)

    def tail_block(blk, carry):  # blocks that reach the local block
        mask = tail_mask_ref[b, tok, pl.ds((blk - pblk) * block_k, block_k)] != 0  # [BR, BK]
        return step(blk, carry, mask)

    walk_split(lo, hi, pblk, prefix_block, tail_block, o_ref, lse_ref)


# --------------------------------------------------------------------------- wrapper

def _tail_mask(meta: AttnMeta, pblk, *, block_k: int, num_tail: int, num_keys: int):
    """int8 [B, T, C = NL*BK]: whether token t sees slot pblk*BK + c (the reference's rule,
    `cache_mask`, restricted to the NL blocks that can hold local slots)."""
    Tl = meta.local_len
    B, T = meta.positions.shape
    slot = pblk[:, None] * block_k + jnp.arange(num_tail * block_k, dtype=jnp.int32)  # [B, C]
    rel = slot - meta.prefix_len[:, None]
    rel_c = jnp.clip(rel, 0, Tl - 1)
    C = slot.shape[1]
    local = jnp.take_along_axis(meta.local_mask, jnp.broadcast_to(rel_c[:, None, :], (B, T, C)),
                                axis=2)  # [B, T, C]
    visible = (rel < 0)[:, None, :] | (((rel >= 0) & (rel < Tl))[:, None, :] & local)
    visible = visible & (slot < num_keys)[:, None, :]
    return visible.astype(jnp.int8)


def default_block_rows(total_rows: int, itemsize: int, tiles: MlaDecodeTiles | None = None) -> int:
    """Query rows a program when the caller gives none, for B*T*H query rows in all: up to
    `tiles.small_rows_max` rows, MIN_ROWS (more, shorter programs); more rows,
    `tiles.block_rows` (fewer row blocks re-reading the keys), half that for float32 (64 x
    512 float32 queries do not fit shared memory beside the keys). tiles None: the
    defaults."""
    t = MlaDecodeTiles() if tiles is None else tiles
    if total_rows <= t.small_rows_max:
        return MIN_ROWS
    return t.block_rows if itemsize == 2 else t.block_rows // 2


def _row_tiling(rows: int, block_rows: int) -> tuple[int, int]:
    """T*H query rows -> (BR: rows a program, R: rows padded to a multiple of BR)."""
    BR = min(block_rows, max(MIN_ROWS, pow2_ceil(rows)))
    return BR, pl.cdiv(rows, BR) * BR


def _mla_call(q_lat, q_pe, lat_flat, table, meta: AttnMeta, *, page_size: int, num_keys: int,
              scale: float, block_k: int, block_rows: int, num_splits: int, interpret: bool,
              num_warps: int | None, num_stages: int):
    """q_lat [B,T,H,Dc], q_pe [B,T,H,Dr]; lat_flat [num_pages*P, Dc+Dr]; table [B, G].
    -> (o [B, NS, R, Dc] float32: each split's latent normalised over its keys, lse
    [B, NS, R] float32), R >= T*H rows (row r: token r // H, head r % H; the rest padding)."""
    B, T, H, Dc = q_lat.shape
    Dr = q_pe.shape[-1]
    rows = T * H
    BR, R = _row_tiling(rows, block_rows)
    Tl = meta.local_len
    num_tail = pl.cdiv(Tl + block_k - 1, block_k)  # blocks the local block can touch

    qc = q_lat.reshape(B, rows, Dc)  # row r: token r // H, head r % H (a free reshape)
    qr = q_pe.reshape(B, rows, Dr)
    if R != rows:
        qc = jnp.pad(qc, ((0, 0), (0, R - rows), (0, 0)))
        qr = jnp.pad(qr, ((0, 0), (0, R - rows), (0, 0)))

    prefix = meta.prefix_len
    eblk = pl.cdiv(jnp.minimum(prefix + Tl, num_keys), block_k)
    pblk = jnp.clip(prefix, 0, num_keys) // block_k
    bounds = jnp.stack([pblk, eblk], axis=1).astype(jnp.int32)  # [B, 2]
    tail_mask = _tail_mask(meta, pblk, block_k=block_k, num_tail=num_tail, num_keys=num_keys)

    kernel = functools.partial(
        _mla_kernel, scale=scale, block_k=block_k, page_size=page_size,
        dense=meta.page_table is None, num_pages=lat_flat.shape[0] // page_size,
        num_keys=num_keys, num_splits=num_splits, latent_dim=Dc, num_heads=H, num_tokens=T)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        if num_warps is None:  # the [BR, Dc] f32 accumulator: <= 64 values a thread
            num_warps = 4 if BR * Dc <= 16 * 512 else 8
        params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    whole = pl.BlockSpec()  # the whole array, indexed inside the kernel
    o, lse = pl.pallas_call(
        kernel,
        grid=(R // BR, num_splits, B),
        in_specs=[
            whole,  # bounds
            whole,  # page table
            whole,  # tail mask (rows gathered per token)
            whole,  # latent pool
            pl.BlockSpec((None, BR, Dc), lambda r, s, b: (b, r, 0)),
            pl.BlockSpec((None, BR, Dr), lambda r, s, b: (b, r, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, BR, Dc), lambda r, s, b: (b, s, r, 0)),
            pl.BlockSpec((None, None, BR), lambda r, s, b: (b, s, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, num_splits, R, Dc), jnp.float32),
            jax.ShapeDtypeStruct((B, num_splits, R), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=params,
        name="jspec_mla_decode",
    )(bounds, table.astype(jnp.int32), tail_mask, lat_flat, qc, qr)
    return o, lse


# --------------------------------------------------------------------------- public


def check_mla_args(q_lat, q_pe, latent_buf, meta: AttnMeta) -> None:
    """Raises ValueError / TypeError for arguments the kernel does not take."""
    if meta.prefill:
        raise ValueError("prefill metadata: the kernel reads the cache, prefill does not")
    if latent_buf is None:
        raise ValueError("the kernel needs the layer's latent cache buffer")
    if q_lat.ndim != 4 or q_pe.ndim != 4 or latent_buf.ndim != 3:
        raise ValueError(f"q_lat and q_pe must be [B,T,H,Dc] and [B,T,H,Dr] and the latent cache "
                         f"[.., .., Dc+Dr], got {q_lat.shape}, {q_pe.shape} and {latent_buf.shape}")
    if q_lat.shape[:3] != q_pe.shape[:3]:
        raise ValueError(f"q_lat {q_lat.shape} and q_pe {q_pe.shape} differ in [B,T,H]")
    for name, arr in (("q_lat", q_lat), ("q_pe", q_pe), ("latent cache", latent_buf)):
        if jnp.dtype(arr.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
            raise TypeError(f"{name} dtype {arr.dtype} is not float32, bfloat16 or float16")
    if not q_lat.dtype == q_pe.dtype == latent_buf.dtype:
        raise TypeError(f"q_lat, q_pe and latent cache dtypes differ: {q_lat.dtype}, {q_pe.dtype}, "
                        f"{latent_buf.dtype}")
    B, T, H, Dc = q_lat.shape
    Dr = q_pe.shape[-1]
    for name, d in (("latent rank Dc", Dc), ("rope dim Dr", Dr)):
        if not (is_pow2(d) and d >= 16):
            raise ValueError(f"{name} {d} is not a power of two >= 16 (Triton tiles)")
    if latent_buf.shape[2] != Dc + Dr:
        raise ValueError(f"latent cache rows hold {latent_buf.shape[2]} values, expected "
                         f"Dc + Dr = {Dc} + {Dr}")
    check_meta(meta, latent_buf, B, T)


def is_supported(q_lat, q_pe, latent_buf, meta: AttnMeta) -> bool:
    """Whether `paged_mla_attention` takes these arguments (the dispatch falls back to the
    reference when not)."""
    try:
        check_mla_args(q_lat, q_pe, latent_buf, meta)
    except (TypeError, ValueError):
        return False
    return True


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not (
            is_pow2(int(value)) and value >= 16):
        raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    return int(value)


def paged_mla_attention(q_lat, q_pe, latent_buf, meta: AttnMeta, *, scale: float, **tiling):
    """MLA attention (absorbed form) of q_lat [B,T,H,Dc] and q_pe [B,T,H,Dr] over a latent
    cache that already holds the new rows -> o_lat [B,T,H,Dc] float32: the key splits of
    `paged_mla_attention_splits` (same arguments) merged."""
    o, lse = paged_mla_attention_splits(q_lat, q_pe, latent_buf, meta, scale=scale, **tiling)
    B, T, H, Dc = q_lat.shape
    rows = T * H
    if o.shape[1] == 1:
        o = o[:, 0, :rows]  # already normalised; rows that saw nothing are 0
    else:
        o = merge_splits(o[:, None, :, :rows], lse[:, None, :, :rows])[:, 0]  # [B, rows, Dc]
    return o.reshape(B, T, H, Dc)


def paged_mla_attention_splits(q_lat, q_pe, latent_buf, meta: AttnMeta, *, scale: float,
                               interpret: bool | None = None, block_k: int | None = None,
                               block_rows: int | None = None, num_splits: int | None = None,
                               num_warps: int | None = None, num_stages: int | None = None,
                               tiles: MlaDecodeTiles | None = None):
    """MLA attention (absorbed form) of q_lat [B,T,H,Dc] and q_pe [B,T,H,Dr] over a latent
    cache that already holds the new rows.

    latent_buf: per slot the latent c [Dc] then the roped key k_pe [Dr]; dense [B,S,Dc+Dr]
    (meta.page_table None) or a paged pool [num_pages(+trash),P,Dc+Dr] with meta.page_table
    [B,G]. Returns the key splits unmerged: (o [B, NS, R, Dc] float32, each split's latent
    normalised over its keys, lse [B, NS, R] float32, the log of its softmax denominator,
    NEG_INF where it saw no key); row r < T*H is token r // H, head r % H, rows from T*H on
    are padding. Dc and Dr: powers of two >= 16.
    interpret None: interpret mode unless the default backend is a GPU. block_k: key slots
    a block (power of two >= 16; default `tiles.block_k`, half that for float32).
    block_rows: query rows a program (power of two >= 16; default `default_block_rows`).
    num_splits: key splits per (batch row, row block) (default: enough programs to fill the
    GPU, `tiles.target_programs`). num_warps (default `tiles.num_warps`, None: 4, or 8 for
    row tiles above 16 x 512) and num_stages (default `tiles.num_stages`) are Triton's.
    tiles: `MlaDecodeTiles` (None: the defaults).
    """
    check_mla_args(q_lat, q_pe, latent_buf, meta)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a static float, got {scale!r}")
    B, T, H, Dc = q_lat.shape
    page_size = latent_buf.shape[1]
    table, num_keys = slot_table(meta, B, page_size)

    t = MlaDecodeTiles() if tiles is None else tiles
    if block_k is None:
        block_k = t.block_k if jnp.dtype(q_lat.dtype).itemsize == 2 else t.block_k // 2
    block_k = _check_block("block_k", block_k)
    if block_rows is None:
        block_rows = default_block_rows(B * T * H, jnp.dtype(q_lat.dtype).itemsize, t)
    block_rows = _check_block("block_rows", block_rows)
    max_blocks = pl.cdiv(num_keys, block_k)
    BR, R = _row_tiling(T * H, block_rows)
    if num_splits is None:
        want = pl.cdiv(t.target_programs, B * (R // BR))
        num_splits = max(1, min(want, max_blocks))
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    num_splits = min(int(num_splits), max_blocks)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    lat_flat = latent_buf.reshape((-1, latent_buf.shape[2]))  # [num_pages * P, Dc + Dr]
    return _mla_call(q_lat, q_pe, lat_flat, table, meta, page_size=page_size, num_keys=num_keys,
                     scale=float(scale), block_k=block_k, block_rows=block_rows,
                     num_splits=num_splits, interpret=interpret,
                     num_warps=t.num_warps if num_warps is None else num_warps,
                     num_stages=t.num_stages if num_stages is None else num_stages)
