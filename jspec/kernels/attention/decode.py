"""Pallas (Triton) attention for decode and verification over the KV cache.

Same semantics as `attention_reference` for a non-prefill AttnMeta (see jspec.cache.kv):
every prefix slot (< prefix_len) is visible, the Tl local-block slots from prefix_len on
are visible per `local_mask`, and an optional sliding window hides old keys.

Design (flash decoding):
- Grid (B, Hkv, R // BR, num_splits). One program takes one batch row, one kv head, BR
  query rows of that head and one contiguous share of the row's key blocks, and runs an
  online softmax over them.
- The Gq*T query rows of a kv head (Gq = H // Hkv query heads per kv head) are padded to
  R, a power of two >= 16, and taken BR = min(R, max_rows = 64) at a time as a [BR, Dh]
  tile, so both matmuls run on tensor cores (usually BR = R: one program sees all of them).
- Keys come in blocks of BK slots. Each block is gathered row by row through the page
  table (slot -> page_table[b, slot // P] * P + slot % P), so any page size works and a
  block may span several small pages. A dense cache [B, S, 2, Hkv, Dh] is the same thing
  with one page of S slots per row (addressed directly, without the table lookup). A
  slot's keys and values sit side by side (jspec.cache.kv), loaded from one buffer.
- A row only visits blocks [wblk, eblk): eblk = cdiv(min(prefix_len + Tl, S), BK) (ragged
  lengths), wblk > 0 only with a sliding window. Blocks before pblk = prefix_len // BK
  hold prefix keys only and need no mask (at most the window test); the few blocks from
  pblk on (at most cdiv(Tl + BK - 1, BK)) take an int8 mask [BR, BK] cut from `tail_mask`,
  which the wrapper builds with the exact rule of the reference.
- Each split writes its output normalised over its own keys and the log of its softmax
  denominator (lse); `merge_splits` combines the splits (log-sum-exp weights).
- q_in_cache (dense caches): the queries were parked in the cache right after the local
  block (`jspec.cache.kv.with_queries`) and each program gathers its query rows there,
  which spares the kernel that would otherwise build the padded query tile.

An FP8 cache (`CacheConfig.dtype`) is read as FP8 and each key and value block widened in
the kernel (E4M3 values are exact in every float dtype): to float32 for float32 queries,
to float16 for bfloat16 ones, which are then taken in float16 (`fp8_queries`: each row
scaled by a power of two into float16's range, its scores scaled back), as the widening to
bfloat16 took the kernel as long as reading a bfloat16 cache.

A query row that sees no key at all gets zeros (the reference gives a meaningless
uniform average there).

Tiles: `AttentionTiles` (below; `Tuning.attention`), taken as `tiles=` (None: the
defaults, with the measurements behind them).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.meta import AttnMeta, pool_rows, read_kv
from jspec.kernels.tiling import KERNEL_DTYPES, half_factor, is_pow2, pow2_ceil, wraps_triton_offsets
from jspec.quantization import FP8_DTYPES


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
    """Tiles of the GQA attention kernel over the KV cache (flash decoding; `Tuning.attention`)."""

    block_k: int = 128  # batch-1 decode on the H200: 128 beat 64, 32 and 16 (docs/benchmarks.md)
    target_programs: int = 256  # about two waves of programs on an H200 (132 SMs)
    max_rows: int = 64  # query rows per program (more: split over programs, keeps registers in check)
    num_warps: int | None = None  # None: 4, or 8 for row tiles above 32 x 128
    num_stages: int = 2
    fp8_num_stages: int = 3  # over an FP8 cache: 3 beat 2 by 5-10% on the H200 (docs/experiments.md)
    # A prompt's causal blocks through cuDNN's fused attention where it runs
    # (`kernels.attention.fused`): 3.6x faster than this kernel at a 32k prompt on the H200.
    fused_prompt_blocks: bool = True
    # Slots of a paged cache's prefix such a block reads a step (`fused.prefix_attention`):
    # bounded memory for many rows of a long context (8B: 1 GiB a step at 128 rows).
    prefix_block: int = 4096

NEG_INF = -1e30
MIN_ROWS = 16  # smallest M of a tensor-core dot in Triton




def _softmax_attend(q, k, v, mask, scale):
    """q/k [B,T,H,Dh]/[B,Sk,Hkv,Dh], v [B,Sk,Hkv,Dv], mask [B,T,Sk] -> [B,T,H,Dv]
    (softmax in float32)."""
    B, T, H, Dh = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, H // Hkv, Dh)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, v.shape[-1]).astype(q.dtype)


def attend_in_blocks(q, keys_at, mask_at, num_blocks, scale: float, open_blocks=0):
    """Softmax attention of q [B,T,H,Dh] over key blocks 0 .. num_blocks-1 (an online
    softmax in loops; num_blocks may be traced): keys_at(i) -> keys [B,Hkv,BK,Dh] and
    values [B,Hkv,BK,Dv] of block i, mask_at(i) -> [B,T,BK] bool (slots that hold no
    key: False); blocks below open_blocks (may be traced) are seen whole by every query
    and take no mask. At most [B,H,T,BK] float32 scores live at once. A query that sees no
    key gets zeros. -> [B,T,H,Dv] in q's dtype."""
    B, T, H, Dh = q.shape
    k0, v0 = jax.eval_shape(keys_at, 0)
    Hkv, Dv = k0.shape[1], v0.shape[-1]
    G = H // Hkv
    qm = q.reshape(B, T, Hkv, G, Dh).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, Dh)  # row m = g * T + t
    qm = (qm.astype(jnp.float32) * scale).astype(q.dtype) if q.dtype == jnp.float32 else qm

    def block(i, carry, masked: bool):
        acc, m, l = carry  # [B,Hkv,G*T,Dv] float32, running max and denominator [B,Hkv,G*T]
        k, v = keys_at(i)
        s = jnp.einsum("bkmd,bksd->bkms", qm, k, preferred_element_type=jnp.float32)
        s = s if q.dtype == jnp.float32 else s * scale  # float32 queries come scaled (one pass less a block)
        if masked:
            mask = jnp.broadcast_to(mask_at(i)[:, None, None], (B, 1, G, T, k.shape[2])).reshape(B, 1, G * T, -1)
            s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bkms,bksd->bkmd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc * corr[..., None] + pv, m_new, l * corr + jnp.sum(p, axis=-1)

    carry = (jnp.zeros((B, Hkv, G * T, Dv), jnp.float32), jnp.full((B, Hkv, G * T), NEG_INF, jnp.float32),
             jnp.zeros((B, Hkv, G * T), jnp.float32))
    # Static bounds (a prompt's keys) make the loops scans, which differentiate (training).
    static = isinstance(open_blocks, int) and isinstance(num_blocks, int)
    open_blocks = min(open_blocks, num_blocks) if static else jnp.minimum(open_blocks, num_blocks)
    carry = lax.fori_loop(0, open_blocks, functools.partial(block, masked=False), carry)
    acc, _, l = lax.fori_loop(open_blocks, num_blocks, functools.partial(block, masked=True), carry)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return o.reshape(B, Hkv, G, T, Dv).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dv).astype(q.dtype)


def attend_cache_in_blocks(q, keys_at, meta: AttnMeta, num_slots: int, block_k: int, scale: float):
    """`attend_in_blocks` over a cache of `num_slots` slots read in blocks of `block_k`
    (keys_at(i): block i's keys and values) under the cache's mask rule (`cache_mask`, no
    window): up to the last block any row reads, every row's prefix blocks unmasked."""
    T = q.shape[1]
    num_blocks = pl.cdiv(jnp.minimum(jnp.max(meta.prefix_len) + meta.local_len, num_slots), block_k)
    return attend_in_blocks(q, keys_at, lambda i: cache_mask(meta, block_k, T, first=i * block_k, num_slots=num_slots),
                            num_blocks, scale, jnp.min(meta.prefix_len) // block_k)


def pad_slots(a, multiple: int, axis: int = 1):
    """a padded with zeros along `axis` to a multiple of `multiple`."""
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def _window_ok(q_pos, k_pos, window: int):
    """[B,T] x [B,Sk] -> [B,T,Sk]: key inside the sliding window of the query."""
    if not window:
        return True
    return k_pos[:, None, :] > q_pos[:, :, None] - window


# Keys a step of the blocked reference takes: above this many keys the reference runs an
# online softmax over blocks of them, so its float32 scores stay [B, H, T, 1024].
REFERENCE_BLOCK_K = 1024


def attention_reference(q, k_new, v_new, kv_buf, meta: AttnMeta, *, window: int = 0,
                        scale: float, block_k: int = REFERENCE_BLOCK_K):
    """q [B,T,H,Dh]; k_new/v_new [B,T,Hkv,Dh]; kv_buf: the layer's cache buffer (see
    jspec.cache.kv), already holding the new keys and values (None for prefill). Returns
    [B,T,H,Dh]; `scale` is the softmax scale. Over more than block_k keys, an online
    softmax over blocks of block_k keys, up to the last block a row reads
    (`attend_in_blocks`: the same result within rounding; a query that sees no key gets
    zeros there). With `meta.differentiable` every block is read, in loops of static bounds
    (training)."""
    if meta.prefill:
        Sk = k_new.shape[1]
        if Sk <= block_k:
            mask = meta.local_mask & _window_ok(meta.positions, meta.local_positions, window)
            return _softmax_attend(q, k_new, v_new, mask, scale)
        keys, values = (pad_slots(x.transpose(0, 2, 1, 3), block_k, axis=2) for x in (k_new, v_new))  # [B,Hkv,Sk',D]
        local_mask, k_pos = pad_slots(meta.local_mask, block_k, axis=2), pad_slots(meta.local_positions, block_k)

        def mask_at(lo):
            mask = lax.dynamic_slice_in_dim(local_mask, lo, block_k, axis=2)
            return mask & _window_ok(meta.positions, lax.dynamic_slice_in_dim(k_pos, lo, block_k, axis=1), window)
        num_blocks, open_blocks = pl.cdiv(Sk, block_k), 0
    else:
        kv = read_kv(kv_buf, meta.page_table)  # [B, Sk, 2, Hkv, Dh]
        if jnp.dtype(kv.dtype) in FP8_DTYPES:  # an FP8 cache (`CacheConfig.dtype`), widened
            kv = kv.astype(q.dtype)
        Sk = kv.shape[1]
        if Sk <= block_k:
            mask = cache_mask(meta, Sk, q.shape[1], window)
            return _softmax_attend(q, kv[:, :, 0], kv[:, :, 1], mask, scale)
        kv = pad_slots(kv.transpose(2, 0, 3, 1, 4), block_k, axis=3)  # [2, B, Hkv, Sk', Dh]
        keys, values = kv[0], kv[1]

        def mask_at(lo):
            return cache_mask(meta, block_k, q.shape[1], window, first=lo, num_slots=Sk)
        if meta.differentiable:  # every block, static bounds (scans)
            num_blocks, open_blocks = keys.shape[2] // block_k, 0
        else:
            num_blocks = pl.cdiv(jnp.minimum(jnp.max(meta.prefix_len) + meta.local_len, Sk), block_k)  # the rest: unread
            open_blocks = 0 if window else jnp.min(meta.prefix_len) // block_k  # every row's prefix: seen whole

    def keys_at(i):
        return tuple(lax.dynamic_slice_in_dim(x, i * block_k, block_k, axis=2) for x in (keys, values))
    return attend_in_blocks(q, keys_at, lambda i: mask_at(i * block_k), num_blocks, scale, open_blocks)


def cache_mask(meta: AttnMeta, Sk: int, T: int, window: int = 0, first=0, num_slots: int | None = None):
    """[B, T, Sk] bool: which of the Sk cache slots first .. first+Sk (in slot order) each
    of the T new tokens sees, by the rule in the module docstring; slots from num_slots on
    (None: no limit) are never seen."""
    Tl = meta.local_len
    slot = first + jnp.arange(Sk, dtype=jnp.int32)[None, :]  # [1, Sk]
    rel = slot - meta.prefix_len[:, None]  # [B, Sk]
    in_prefix = rel < 0
    in_local = (rel >= 0) & (rel < Tl)
    if num_slots is not None:
        in_prefix, in_local = in_prefix & (slot < num_slots), in_local & (slot < num_slots)
    rel_c = jnp.clip(rel, 0, Tl - 1)
    local = jnp.take_along_axis(meta.local_mask, jnp.broadcast_to(rel_c[:, None, :], (rel.shape[0], T, Sk)), axis=2)
    mask = in_prefix[:, None, :] | (in_local[:, None, :] & local)
    if window:
        k_pos = jnp.where(in_prefix, slot, jnp.take_along_axis(meta.local_positions, rel_c, axis=1))
        mask = mask & _window_ok(meta.positions, k_pos, window)
    return mask


def decode_attention_reference(q, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float):
    """The reference for `paged_decode_attention` (same arguments)."""
    return attention_reference(q, None, None, kv_buf, meta, window=window, scale=scale)


# --------------------------------------------------------------------------- kernel

def fp8_queries(cache_dtype, *qs):
    """The query tiles [BR, *] a flash-decoding kernel multiplies with the blocks of a cache
    of `cache_dtype`, and the factor [BR, 1] float32 its scores are multiplied back by
    (None: 1). Over an FP8 cache, bfloat16 queries become float16 (each row divided by its
    power of two `tiling.half_factor`, shared over the tiles, whose scores add), so that
    the blocks widen to float16, one instruction a pair, not to bfloat16: widened to
    bfloat16 an FP8 cache read no faster than a bfloat16 one (H200, docs/experiments.md
    "An FP8 cache read at its bytes"). Other queries are taken as they are."""
    if jnp.dtype(cache_dtype) not in FP8_DTYPES or qs[0].dtype != jnp.bfloat16:
        return (*qs, None)
    factor = half_factor(*qs)
    return (*((x.astype(jnp.float32) / factor).astype(jnp.float16) for x in qs), factor)


def online_softmax_step(sc, mask, v, carry):
    """One key block of a flash-decoding online softmax (shared by the GQA and MLA kernels):
    scores sc [BR, BK] float32, already scaled; mask [BR, BK] or None (all visible); values
    v [BK, Dv]; carry (acc [BR, Dv] float32, running max m [BR], denominator l [BR])."""
    acc, m, l = carry
    if mask is not None:
        sc = jnp.where(mask, sc, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    p = jnp.exp(sc - m_new[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return acc * corr[:, None] + pv, m_new, l


def slot_table(meta: AttnMeta, batch: int, page_size: int):
    """The page table a flash-decoding kernel walks (shared by the GQA and MLA kernels) and
    the slots a row can address: (meta.page_table [B, G], G * P), or for a dense cache the
    identity table [B, 1] (row b's one page of S slots is b) and S."""
    if meta.page_table is None:  # dense: one page of S slots per row, identity table
        table = jnp.arange(batch, dtype=jnp.int32)[:, None]
    else:
        table = meta.page_table
    return table, table.shape[1] * page_size


def walk_split(lo, hi, pblk, prefix_block, tail_block, o_ref, lse_ref):
    """A split's key blocks [lo, hi) of a flash-decoding kernel (shared by the GQA and MLA
    kernels): the blocks below pblk (prefix keys only) by `prefix_block`, the rest by
    `tail_block` (each (blk, carry) -> carry, an `online_softmax_step`), from an empty carry
    shaped as o_ref [BR, Dv]. Writes the split's softmax-weighted values, normalised over
    its keys, to o_ref (float32) and the log of its denominator to lse_ref [BR] (NEG_INF
    where it saw no key)."""
    BR, Dv = o_ref.shape
    carry = (jnp.zeros((BR, Dv), jnp.float32), jnp.full((BR,), NEG_INF, jnp.float32),
             jnp.zeros((BR,), jnp.float32))
    carry = lax.fori_loop(lo, jnp.minimum(hi, pblk), prefix_block, carry)
    carry = lax.fori_loop(jnp.maximum(lo, pblk), hi, tail_block, carry)
    acc, m, l = carry
    seen = l > 0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)


def _decode_kernel(bounds_ref, table_ref, qpos_ref, tail_mask_ref, kv_ref, *refs,
                   scale: float, block_k: int, page_size: int, dense: bool,
                   num_pages: int, num_keys: int, window: int, num_splits: int,
                   q_in_cache: bool, rows_per_block: int, num_rows: int, num_heads: int):
    """One (batch row b, kv head h, query-row block, split s).

    bounds_ref [B, 4] int32: wblk, pblk, eblk of each row (see the module docstring) and
    the slot holding its first query when q_in_cache.
    table_ref [B, G] int32: page table (entries >= num_pages: unallocated, clamped).
    qpos_ref [BR] int32; tail_mask_ref [BR, C] int8 (C = NL*BK).
    kv_ref [num_pages * P, 2, Hkv, Dh]: the pool, flattened over pages (keys at [:, 0],
    values at [:, 1]). dense: one page per row (table[b, 0] = b), so no table lookup.
    refs: (q_ref, o_ref, lse_ref), or (o_ref, lse_ref) with q_in_cache, where each program
    gathers its query rows from kv_ref (queries parked after the local block, see
    `jspec.cache.kv.query_slots`; num_rows real rows of T * Gq). The cache comes in once
    and in this shape only: given also as a [.., Dh] view, XLA copied each layer's
    buffer twice per tree round (the compaction after the verify updates it in place).
    q_ref [BR, Dh]; o_ref [BR, Dh] float32: this split's softmax-weighted values
    (normalised over its keys); lse_ref [BR] float32: log of its softmax denominator
    (NEG_INF where it saw no key).
    """
    q_ref, o_ref, lse_ref = (None, *refs) if q_in_cache else refs
    Hkv = kv_ref.shape[2]
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    wblk, pblk, eblk = bounds_ref[b, 0], bounds_ref[b, 1], bounds_ref[b, 2]
    per_split = pl.cdiv(eblk - wblk, num_splits)
    lo = wblk + s * per_split
    hi = jnp.minimum(lo + per_split, eblk)

    if q_in_cache:  # row i: token i // Gq, head h * Gq + i % Gq, parked in slot order
        Gq = num_heads // Hkv
        i = pl.program_id(2) * rows_per_block + jnp.arange(rows_per_block, dtype=jnp.int32)
        e = (i // Gq) * num_heads + h * Gq + i % Gq  # query vector index, token-major
        slot = jnp.minimum(bounds_ref[b, 3] + e // (2 * Hkv), page_size - 1)
        pair = e % (2 * Hkv)  # keys' half (0) or values' half (1), then the kv head
        q = kv_ref[b * page_size + slot, pair // Hkv, pair % Hkv, :]  # [BR, Dh]
        q = jnp.where((i < num_rows)[:, None], q, jnp.zeros_like(q))
    else:
        q = q_ref[...]  # [BR, Dh]
    q, factor = fp8_queries(kv_ref.dtype, q)
    BR, Dh = q.shape
    offs = jnp.arange(block_k, dtype=jnp.int32)  # [BK]

    def load_kv(blk):  # an FP8 cache's keys and values widened to q's dtype (E4M3 values are exact in it)
        slot = jnp.minimum(blk * block_k + offs, num_keys - 1)  # [BK], clamped in range
        row = pool_rows(table_ref, b, slot, page_size=page_size, num_pages=num_pages, dense=dense)
        return kv_ref[row, 0, h, :].astype(q.dtype), kv_ref[row, 1, h, :].astype(q.dtype)  # [BK, Dh] each

    def step(blk, carry, mask):  # carry: acc [BR, Dh], m [BR], l [BR]
        k, v = load_kv(blk)
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * (scale if factor is None else scale * factor)
        return online_softmax_step(sc, mask, v, carry)  # sc [BR, BK]

    def prefix_block(blk, carry):  # only prefix keys: at most the window hides some
        mask = None
        if window:
            slot = blk * block_k + offs
            mask = slot[None, :] > qpos_ref[...][:, None] - window  # [BR, BK]
        return step(blk, carry, mask)

    def tail_block(blk, carry):  # blocks that reach the local block
        mask = tail_mask_ref[:, pl.ds((blk - pblk) * block_k, block_k)] != 0  # [BR, BK]
        return step(blk, carry, mask)

    walk_split(lo, hi, pblk, prefix_block, tail_block, o_ref, lse_ref)


# --------------------------------------------------------------------------- wrapper

SMEM_BYTES = 232448  # shared memory a Triton program may take on Hopper (227 KiB)


def shared_bytes(block_k: int, stages: int, Dh: int, itemsize: int, BR: int, local_len: int,
                 widened: int = 0) -> int:
    """The kernel's shared memory: `stages` buffers of a key and a value block [block_k,
    Dh] and a tail-mask tile [BR, C] of int8 (the compiler's request for Qwen3.5's Dh of
    256, 2 stages, blocks of 128 and a 512-token block: 303,104 bytes, over the limit), and
    over an FP8 cache one copy of the key and value blocks widened to `widened` bytes an
    element (H200, Dh 256, 96 query rows: 311,296 bytes requested at 3 stages of 128)."""
    C = pl.cdiv(local_len + block_k - 1, block_k) * block_k
    return stages * block_k * 2 * Dh * itemsize + block_k * 2 * Dh * widened + BR * C


def fitting_block(tiles: AttentionTiles, stages: int, rows: int, Dh: int, itemsize: int, local_len: int,
                  widened: int = 0) -> int:
    """`tiles.block_k`, halved (down to 16) until the kernel's buffers fit a program's
    shared memory (`shared_bytes`; rows: query rows per kv head; widened: the bytes an
    element of an FP8 cache's blocks takes widened, 0 for other caches)."""
    _, _, BR = _row_tiling(rows, tiles.max_rows)
    block_k = tiles.block_k
    while block_k > 16 and shared_bytes(block_k, stages, Dh, itemsize, BR, local_len, widened) > SMEM_BYTES:
        block_k //= 2
    return block_k


def _row_tiling(rows: int, max_rows: int) -> tuple[int, int, int]:
    """Query rows per kv head -> (rows, R: padded to a power of two >= 16, BR: per program,
    at most max_rows)."""
    R = max(MIN_ROWS, pow2_ceil(rows))
    return rows, R, min(R, max_rows)


def _tail_mask(meta: AttnMeta, pblk, rows_t, *, window: int, block_k: int, num_tail: int,
               num_keys: int):
    """int8 [B, R, C = NL*BK]: whether query row r sees slot pblk*BK + c (the reference's
    rule, restricted to the NL blocks that can hold local slots)."""
    Tl = meta.local_len
    B = pblk.shape[0]
    slot = pblk[:, None] * block_k + jnp.arange(num_tail * block_k, dtype=jnp.int32)  # [B, C]
    rel = slot - meta.prefix_len[:, None]
    rel_c = jnp.clip(rel, 0, Tl - 1)
    R, C = rows_t.shape[0], slot.shape[1]
    local = meta.local_mask[:, rows_t, :]  # [B, R, Tl]
    local = jnp.take_along_axis(local, jnp.broadcast_to(rel_c[:, None, :], (B, R, C)), axis=2)
    visible = (rel < 0)[:, None, :] | (((rel >= 0) & (rel < Tl))[:, None, :] & local)
    visible = visible & (slot < num_keys)[:, None, :]
    if window:
        k_pos = jnp.where(rel < 0, slot, jnp.take_along_axis(meta.local_positions, rel_c, axis=1))
        q_pos = meta.positions[:, rows_t]  # [B, R]
        visible = visible & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    return visible.astype(jnp.int8)


def _decode_call(q, kv_flat, table, meta: AttnMeta, *, page_size: int, num_keys: int,
                 window: int, scale: float, block_k: int, num_splits: int, interpret: bool,
                 num_warps: int | None, num_stages: int, q_in_cache: bool, max_rows: int):
    """q [B,T,H,Dh]; kv_flat [num_pages*P, 2, Hkv, Dh]; table [B, G]. -> [B,T,H,Dh].
    q_in_cache: the queries are read from the (dense) cache instead; q gives shapes only."""
    B, T, H, Dh = q.shape
    Hkv = kv_flat.shape[2]
    Gq = H // Hkv  # query heads per kv head
    Tl = meta.local_len
    rows, R, BR = _row_tiling(T * Gq, max_rows)
    num_tail = pl.cdiv(Tl + block_k - 1, block_k)  # blocks the local block can touch

    # Row r of kv head h's tile is query token r // Gq, query head h * Gq + r % Gq.
    if not q_in_cache:  # else the kernel gathers its rows from the cache
        qt = q.reshape(B, T, Hkv, Gq, Dh).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, rows, Dh)
        qt = jnp.pad(qt, ((0, 0), (0, 0), (0, R - rows), (0, 0)))  # [B, Hkv, R, Dh]
    rows_t = jnp.minimum(jnp.arange(R, dtype=jnp.int32) // Gq, T - 1)  # [R] (pads: copies)
    qpos = meta.positions[:, rows_t]  # [B, R]

    # Per row: blocks [wblk, eblk) to visit; blocks < pblk hold prefix keys only.
    prefix = meta.prefix_len
    end = jnp.minimum(prefix + Tl, num_keys)
    eblk = pl.cdiv(end, block_k)
    pblk = jnp.clip(prefix, 0, num_keys) // block_k
    wblk = jnp.zeros_like(pblk)
    if window:  # prefix slots <= min position - window are hidden from every query
        first = jnp.min(meta.positions, axis=1) - window + 1
        wblk = jnp.clip(first // block_k, 0, pblk)
    bounds = jnp.stack([wblk, pblk, eblk, prefix + Tl], axis=1).astype(jnp.int32)  # [B, 4]
    tail_mask = _tail_mask(meta, pblk, rows_t, window=window, block_k=block_k,
                           num_tail=num_tail, num_keys=num_keys)  # [B, R, C]
    C = tail_mask.shape[-1]

    kernel = functools.partial(
        _decode_kernel, scale=scale, block_k=block_k, page_size=page_size,
        dense=meta.page_table is None,
        num_pages=kv_flat.shape[0] // page_size, num_keys=num_keys, window=window,
        num_splits=num_splits, q_in_cache=q_in_cache, rows_per_block=BR, num_rows=rows, num_heads=H)
    whole = pl.BlockSpec()  # the whole array, indexed inside the kernel
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        if num_warps is None:  # 4 warps hold a [BR, Dh] f32 accumulator up to 32 x 128
            num_warps = 4 if BR * Dh <= 32 * 128 else 8
        params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    in_specs = [
        whole,  # bounds
        whole,  # page table
        pl.BlockSpec((None, BR), lambda b, h, r, s: (b, r)),  # q positions
        pl.BlockSpec((None, BR, C), lambda b, h, r, s: (b, r, 0)),  # tail mask
        whole,  # kv pool
    ]
    args = [bounds, table.astype(jnp.int32), qpos, tail_mask, kv_flat]
    if not q_in_cache:
        in_specs.append(pl.BlockSpec((None, None, BR, Dh), lambda b, h, r, s: (b, h, r, 0)))
        args.append(qt)
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, Hkv, R // BR, num_splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, BR, Dh), lambda b, h, r, s: (b, h, s, r, 0)),
            pl.BlockSpec((None, None, None, BR), lambda b, h, r, s: (b, h, s, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hkv, num_splits, R, Dh), jnp.float32),
            jax.ShapeDtypeStruct((B, Hkv, num_splits, R), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=params,
        name="jspec_decode_attention",
    )(*args)

    o = merge_splits(o[:, :, :, :rows], lse[:, :, :, :rows])  # [B, Hkv, rows, Dh]
    o = o.reshape(B, Hkv, T, Gq, Dh).transpose(0, 2, 1, 3, 4)
    return o.reshape(B, T, H, Dh).astype(q.dtype)


def merge_splits(o, lse):
    """o [B,Hkv,NS,R,Dh] (each split normalised over its keys), lse [B,Hkv,NS,R] -> the
    attention over all keys [B,Hkv,R,Dh]; a row that saw no key gets 0.

    XLA makes two small kernels of this (the max, then the weighted sums). Splits that
    arrive normalised make the second one cheaper than merging raw sums (0.3 us a layer
    on the H200); one variadic reduction and a Pallas merge kernel measured slower
    (docs/benchmarks.md)."""
    w = jnp.exp(lse - jnp.max(lse, axis=2, keepdims=True))  # [B, Hkv, NS, R]
    return jnp.sum(w[..., None] * o, axis=2) / jnp.sum(w, axis=2)[..., None]


# --------------------------------------------------------------------------- public


def check_attention_args(q, kv_buf, meta: AttnMeta, window) -> None:
    """Raises ValueError / TypeError for arguments the kernel does not take."""
    if meta.prefill:
        raise ValueError("prefill metadata: the kernel reads the cache, prefill does not")
    if kv_buf is None:
        raise ValueError("the kernel needs the layer's cache buffer")
    if q.ndim != 4 or kv_buf.ndim != 5 or kv_buf.shape[2] != 2:
        raise ValueError(f"q must be [B,T,H,Dh] and the cache [.., .., 2, Hkv, Dh], got {q.shape} "
                         f"and {kv_buf.shape}")
    if jnp.dtype(q.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
        raise TypeError(f"q dtype {q.dtype} is not float32, bfloat16 or float16")
    if q.dtype != kv_buf.dtype and jnp.dtype(kv_buf.dtype) not in FP8_DTYPES:
        raise TypeError(f"q and cache dtypes differ: {q.dtype}, {kv_buf.dtype} (the cache must be q's dtype or FP8)")
    if wraps_triton_offsets(kv_buf):
        raise ValueError(f"the cache {kv_buf.dtype} {kv_buf.shape} has more than 2^31 elements in at most 2^32 bytes, "
                         f"which Pallas' Triton lowering indexes with wrapping 32-bit offsets")
    B, T, H, Dh = q.shape
    Hkv = kv_buf.shape[3]
    if not (is_pow2(Dh) and Dh >= 16):
        raise ValueError(f"head_dim {Dh} is not a power of two >= 16 (Triton tiles)")
    if kv_buf.shape[4] != Dh:
        raise ValueError(f"cache head_dim {kv_buf.shape[4]} != q head_dim {Dh}")
    if H % Hkv:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {Hkv}")
    check_meta(meta, kv_buf, B, T)
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise ValueError(f"window must be a static int >= 0, got {window!r}")


def check_meta(meta: AttnMeta, buf, B: int, T: int) -> None:
    """Raises ValueError / TypeError unless `meta` describes T new tokens of B rows over the
    cache buffer `buf` (dense [B, S, ...] or a pool [num_pages, P, ...]); shared by the
    cache-reading kernels."""
    Tl = meta.local_len
    for name, shape in (("positions", (B, T)), ("prefix_len", (B,)),
                        ("local_mask", (B, T, Tl)), ("local_positions", (B, Tl))):
        arr = getattr(meta, name)
        if arr.shape != shape:
            raise ValueError(f"meta.{name} has shape {arr.shape}, expected {shape}")
        want_bool = name == "local_mask"
        ok = arr.dtype == jnp.bool_ if want_bool else jnp.issubdtype(arr.dtype, jnp.integer)
        if not ok:
            raise TypeError(f"meta.{name} must be {'bool' if want_bool else 'integer'}, "
                            f"got {arr.dtype}")
    if meta.page_table is None:
        if buf.shape[0] != B:
            raise ValueError(f"dense cache batch {buf.shape[0]} != q batch {B}")
    else:
        table = meta.page_table
        if table.ndim != 2 or table.shape[0] != B:
            raise ValueError(f"meta.page_table has shape {table.shape}, expected ({B}, G)")
        if not jnp.issubdtype(table.dtype, jnp.integer):
            raise TypeError(f"meta.page_table must be integer, got {table.dtype}")
        if meta.page_size and meta.page_size != buf.shape[1]:
            raise ValueError(f"meta.page_size {meta.page_size} != pool page size {buf.shape[1]}")


def is_supported(q, kv_buf, meta: AttnMeta, *, window: int = 0) -> bool:
    """Whether `paged_decode_attention` takes these arguments (the dispatch falls back to
    the reference when not)."""
    try:
        check_attention_args(q, kv_buf, meta, window)
    except (TypeError, ValueError):
        return False
    return True


def paged_decode_attention(q, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
                           interpret: bool | None = None, block_k: int | None = None,
                           num_splits: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, q_in_cache: bool = False,
                           tiles: AttentionTiles | None = None):
    """Attention of q [B,T,H,Dh] over a cache that already holds the new keys.

    kv_buf: keys and values, dense [B,S,2,Hkv,Dh] (meta.page_table None) or a paged pool
    [num_pages,P,2,Hkv,Dh] with meta.page_table [B,G], in q's dtype or FP8 (an FP8 cache,
    `CacheConfig.dtype`: each block widened to q's dtype as it is loaded, so the kernel reads
    half a bfloat16 cache's bytes). Returns [B,T,H,Dh] in q's dtype.
    interpret None: interpret mode unless the default backend is a GPU. block_k: keys
    per block (power of two >= 16; default `tiles.block_k`). num_splits: key splits per
    (row, kv head) (default: enough programs to fill the GPU, `tiles.target_programs`).
    num_warps (default `tiles.num_warps`, None: 4, or 8 for big row tiles) and num_stages
    (default `tiles.num_stages`, over an FP8 cache `tiles.fp8_num_stages`) are Triton's.
    tiles: `AttentionTiles` (None: the defaults; `max_rows` query rows a program).
    q_in_cache: a dense cache already holds the queries in the `query_slots(T, H, Hkv)`
    slots after the local block (see `jspec.cache.kv.query_slots`); q then gives only
    shapes and dtype.
    """
    check_attention_args(q, kv_buf, meta, window)
    if q_in_cache and meta.page_table is not None:
        raise ValueError("q_in_cache needs a dense cache (paged pools have no room reserved)")
    if q_in_cache and kv_buf.dtype != q.dtype:
        raise ValueError(f"q_in_cache needs a cache of q's dtype ({q.dtype}), got {kv_buf.dtype}: queries are not "
                         f"parked in an FP8 cache")
    window = int(window)
    B, T, H, Dh = q.shape
    Hkv = kv_buf.shape[3]
    page_size = kv_buf.shape[1]
    table, num_keys = slot_table(meta, B, page_size)

    t = AttentionTiles() if tiles is None else tiles
    if num_stages is None:
        num_stages = t.fp8_num_stages if jnp.dtype(kv_buf.dtype) in FP8_DTYPES else t.num_stages
    if block_k is None:
        widened = 0 if jnp.dtype(kv_buf.dtype) not in FP8_DTYPES else 4 if q.dtype == jnp.float32 else 2
        block_k = fitting_block(t, num_stages, T * (H // Hkv), Dh, kv_buf.dtype.itemsize, meta.local_len, widened)
    if not (is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    max_blocks = pl.cdiv(num_keys, block_k)
    if num_splits is None:
        _, R, BR = _row_tiling(T * (H // Hkv), t.max_rows)  # row blocks also make programs
        want = pl.cdiv(t.target_programs, B * Hkv * (R // BR))
        num_splits = max(1, min(want, max_blocks))
    if not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    num_splits = min(num_splits, max_blocks)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    kv_flat = kv_buf.reshape((-1, 2, Hkv, Dh))  # [num_pages * P, 2, Hkv, Dh] (dense: [B * S, ...])
    return _decode_call(q, kv_flat, table, meta, page_size=page_size, num_keys=num_keys,
                        window=window, scale=float(scale), block_k=block_k,
                        num_splits=num_splits, interpret=interpret,
                        num_warps=t.num_warps if num_warps is None else num_warps,
                        num_stages=num_stages, q_in_cache=q_in_cache, max_rows=t.max_rows)
