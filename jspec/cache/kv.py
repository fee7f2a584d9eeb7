"""The GQA key/value cache kind: per-head keys and values of every token, dense or paged.

One buffer per layer: dense [B, C + 1, 2, Hkv, Dh] or paged [num_pages + 1, P, 2, Hkv, Dh]
(slots and the trash row/page as in `jspec.cache.layout`). A slot holds its keys
([..., 0, :, :]) and values ([..., 1, :, :]) side by side, so writing or moving a token is
one operation per layer, not two.

A dense cache may also carry a forward's queries for the attention kernel, parked in the
slots after its new tokens by the same write (`with_queries`, `query_slots`); the kind
asks the loop for that room through `extra_slots`, and only `cached_attention` (which
writes a layer's new keys and values and calls `jspec.kernels.attention.gqa`) decides to park.
Nothing else sees it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from jspec.cache.layout import CacheLayout, PageState, slot_index
from jspec.quantization import FP8_DTYPES
from jspec.tuning import DEFAULT_TUNING
from jspec.kernels.attention.decode import AttentionTiles
from jspec.kernels.row.attention import RowAttentionTiles
from jspec.kernels.attention.gqa import attention, uses_fused, uses_kernel
from jspec.kernels.meta import AttnMeta, read_kv  # noqa: F401  (read_kv: the cache read in slot order, re-exported)
from jspec.sharding import constrain_heads, over_heads, tp_size
from jspec.util import cdiv


@struct.dataclass
class KVCache:
    """Per-layer keys and values, stacked on axis -3: dense [B, S+1, 2, Hkv, Dh] or paged
    [num_pages+1, P, 2, Hkv, Dh] (the last slot of a row, the last page of a pool: trash, see
    the module docstring)."""

    kv: tuple


@dataclasses.dataclass(frozen=True)
class KVCacheKind:
    """The cache a GQA model needs: per layer, keys and values of Hkv heads of Dh values.

    num_heads (H) sizes the parked queries (`extra_slots`)."""

    split_by_head: ClassVar[bool] = True  # split over a mesh's devices by KV head (`init`)
    prefill_in_chunks: ClassVar[bool] = True  # a prompt's later blocks attend to the earlier ones in the cache
    prefix_in_pages: ClassVar[bool] = True  # a prefix's whole state is in its pages (prefix caching)
    state_snapshots: ClassVar[bool] = False  # no state outside the pages to snapshot
    fp8_row_kernels: ClassVar[bool] = True  # the row-invariant kernels read an FP8 buffer (`CacheConfig.dtype`)

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def init(self, layout: CacheLayout, batch: int) -> KVCache:
        """Zero buffers, one per layer, trash row or page included, in `layout.kv_dtype`
        (None: the model's dtype); split by KV head over the devices of a mesh
        (`jspec.sharding`)."""
        shape = layout.buffer_shape(batch) + (2, self.num_kv_heads, self.head_dim)
        dtype = layout.kv_dtype or self.dtype
        return KVCache(kv=tuple(constrain_heads(jnp.zeros(shape, dtype), -2) for _ in range(self.num_layers)))

    def extra_slots(self, T: int, paged: bool) -> int:
        """Slots past the T written ones that a forward may use: a dense cache parks the
        forward's queries there for the attention kernel (`with_queries`)."""
        return 0 if paged else query_slots(T, self.num_heads, self.num_kv_heads)

    def commit(self, cache: KVCache, layout: CacheLayout, pages: PageState | None, L, path, accept_len,
               active, in_place: bool = False, tuning=DEFAULT_TUNING) -> KVCache:
        """A round's commit: the accepted path's keys and values move from slots L + path[d]
        to L + d (d < accept_len [B]; path [B, S+1] node indices, L [B] committed slots).
        in_place (static, a chain): the path is already there and nothing moves. tuning
        (`jspec.tuning.Tuning`): how a kind that computes in its commit computes (unused here)."""
        if in_place:
            return cache
        return move_slots(cache, *path_moves(layout, pages, L, path, accept_len, active), not layout.paged)


def path_moves(layout: CacheLayout, pages: PageState | None, L, path, accept_len, active):
    """A tree commit's moves for any cache kind -> flat (src, dst) [B, S+1]: slot L + path[d]
    to L + d for d < accept_len on active rows; the rest (and nodes already in place) have
    both ends in the trash."""
    d = jnp.arange(path.shape[1], dtype=jnp.int32)[None, :]
    move = active[:, None] & (d < accept_len[:, None]) & (path != d)
    return layout.slot_index(L[:, None] + path, move, pages), layout.slot_index(L[:, None] + d, move, pages)


def init_kv_cache(num_layers, num_kv_heads, head_dim, dtype, *, batch=0, max_len=0,
                  num_pages=0, page_size=0) -> KVCache:
    """Zero cache: dense (max_len slots per row) when num_pages == 0, else a paged pool;
    each with its trash slot or page."""
    shape = (num_pages + 1, page_size) if num_pages else (batch, max_len + 1)
    shape = shape + (2, num_kv_heads, head_dim)
    return KVCache(kv=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))


def query_slots(T: int, num_heads: int, num_kv_heads: int) -> int:
    """Slots that hold the queries of T tokens (a slot has 2 * Hkv head vectors).

    The Pallas attention kernel can read its queries from the cache: writing them in the
    same update as the new keys and values saves the separate kernel that would prepare
    the query tile, ~1.7 us a layer in batch-1 decoding on the H200."""
    return cdiv(T * num_heads, 2 * num_kv_heads)


def with_queries(new: jax.Array, q: jax.Array, meta: AttnMeta, buf: jax.Array):
    """Rows for `write_kv` that also park the queries: new [B, T, 2, Hkv, Dh] keys and
    values and q [B, T, H, Dh] -> ([B, T + Qs, 2, Hkv, Dh], flat indices [B, T + Qs]).

    The queries fill the Qs = `query_slots(T, H, Hkv)` slots right after the local block,
    token-major (query vector e = t * H + head sits in slot e // (2 Hkv) at position
    e % (2 Hkv) of its [2, Hkv] pairs). Dense caches only (meta.q_room): the loop keeps
    those slots inside the capacity of every live row, and nothing reads them as keys
    before a later forward writes its own tokens there."""
    B, T, H, Dh = q.shape
    Hkv = new.shape[3]
    Qs = query_slots(T, H, Hkv)
    flat = q.astype(new.dtype).reshape(B, T * H * Dh)
    flat = jnp.pad(flat, ((0, 0), (0, Qs * 2 * Hkv * Dh - T * H * Dh)))
    rows = jnp.concatenate([new, flat.reshape(B, Qs, 2, Hkv, Dh)], axis=1)
    slots = meta.prefix_len[:, None] + meta.local_len + jnp.arange(Qs, dtype=jnp.int32)[None, :]
    index = slot_index(slots, jnp.ones(slots.shape, bool), batch_capacity=buf.shape[1] - 1)
    return rows, jnp.concatenate([meta.write_index, index], axis=1)


def write_kv(buf: jax.Array, new: jax.Array, write_index: jax.Array, dense: bool = False) -> jax.Array:
    """Writes new [B, T, ...] (a slot's entries: keys and values [2, Hkv, Dh], or another
    kind's, e.g. the MLA latent) at flat indices [B, T] (in bounds: see `slot_index`).

    The T tokens of a forward pass go to consecutive slots, so one token, or a dense
    cache of one row, is one in-place block update (a scatter costs more). A dense row
    whose writes are invalid (a finished request) may then get garbage past its committed
    slots, which nothing reads before it is written again: only when the cache holds no
    other row."""
    B, T = write_index.shape
    shape = buf.shape
    rows = stored(new, buf.dtype)
    if dense and B == 1 and shape[0] == 1 and T <= shape[1]:
        start = write_index[0, 0]  # flat index of row 0 = its slot
        return jax.lax.dynamic_update_slice(buf, rows, (0, start) + (0,) * (buf.ndim - 2))
    flat = buf.reshape((-1,) + shape[2:])
    rows = rows.reshape((-1,) + shape[2:])
    if B * T == 1:
        flat = jax.lax.dynamic_update_slice(flat, rows, (write_index.reshape(()),) + (0,) * (flat.ndim - 1))
    else:
        flat = set_slots(flat, write_index, rows, shape[1], dense)
    return flat.reshape(shape)


def stored(x: jax.Array, dtype) -> jax.Array:
    """x as a cache of `dtype` holds it: an FP8 cache (`CacheConfig.dtype`) clips to its
    largest finite value first (E4M3 has no infinity: a value past it would be NaN)."""
    if jnp.dtype(dtype) in FP8_DTYPES and jnp.dtype(x.dtype) not in FP8_DTYPES:
        big = float(jnp.finfo(dtype).max)
        return jnp.clip(x.astype(jnp.float32), -big, big).astype(dtype)
    return x.astype(dtype)


def set_slots(flat: jax.Array, index: jax.Array, vals: jax.Array, slots_per_row: int, dense: bool) -> jax.Array:
    """flat [rows x slots, ...] with vals [n, ...] written at flat indices `index` (any
    shape, n in all), those in the trash dropped: each trash index becomes one of its own
    past the end, so that every index is distinct and the scatter needs no atomics.

    The valid slots of one pass or commit are distinct, but many writes go to the trash (a
    finished row's nodes, an admission's padding), and all to one slot of it (paged: the
    first of the trash page; dense: the row's). A scatter whose indices may repeat updates
    each element atomically on a GPU, and those writes then serialise. On the 8B shape cut
    to 8 layers, batch 32 with one row running (H200, 2026-11-28, docs/experiments.md), a
    round of a 5-draft chain cost 5.18 ms with them, 2.13 ms without (2.29 ms with all 32
    rows running); the scatter's kernels took 24.3 ms of a 2-chunk profile, then 0.19 ms."""
    index = index.reshape(-1)
    n = flat.shape[0]
    trash = index % slots_per_row == slots_per_row - 1 if dense else index >= n - slots_per_row
    index = jnp.where(trash, n + jnp.arange(index.shape[0], dtype=index.dtype), index)
    return flat.at[index].set(vals, mode="drop", unique_indices=True)


def move_slots(cache: KVCache, src_index: jax.Array, dst_index: jax.Array, dense: bool) -> KVCache:
    """Copies every layer's entries at flat src [B, M] to flat dst [B, M] (gather, then set;
    moves that must not happen have both ends in the trash)."""
    return KVCache(kv=move_buffers(cache.kv, src_index, dst_index, dense))


def move_buffers(bufs: tuple, src_index: jax.Array, dst_index: jax.Array, dense: bool) -> tuple:
    """`move_slots` over per-layer buffers [rows, slots, ...] of any cache kind (dense: the
    layout's, which says where the trash is)."""
    def move(buf):
        shape = buf.shape
        flat = buf.reshape((-1,) + shape[2:])
        vals = flat[src_index.reshape(-1)]
        return set_slots(flat, dst_index, vals, shape[1], dense).reshape(shape)
    return tuple(move(b) for b in bufs)


def cached_attention(q, k, v, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
                     tiles: AttentionTiles | None = None, row_tiles: RowAttentionTiles | None = None,
                     kv_scale=None):
    """Writes the new keys and values into the layer's cache and attends over it
    (`jspec.kernels.attention.gqa.attention`).

    kv_scale: an FP8 cache's per-layer scales float32 [2] (key, value; powers of two, as
    `quantization.kv_cache_scales` makes them; the layer's `kv_scale` param). The cache
    then holds key / ks and value / vs, and attention runs on q ks, k / ks and v / vs with
    its output times vs: every kernel and reference reads the cache as it is, and with
    powers of two each scaling is exact, so the result is attention over the widened cache
    times its scales. Ignored for other caches.

    q [B,T,H,Dh]; k/v [B,T,Hkv,Dh]; kv_buf: the layer's buffer or None (prefill without a
    cache: the block attends to itself). -> (out [B,T,H,Dh], buffer).
    When the Pallas kernel will run on a dense cache with room reserved (meta.q_room), the
    queries are parked in the cache by the same write (`with_queries`) and the kernel reads
    them there: no kernel of their own prepares the query tile. tiles: the kernel's
    (`attention`)."""
    if kv_scale is not None and kv_buf is not None and jnp.dtype(kv_buf.dtype) in FP8_DTYPES:
        ks, vs = kv_scale[0], kv_scale[1]
        out, kv_buf = cached_attention(q * ks.astype(q.dtype), k / ks.astype(k.dtype), v / vs.astype(v.dtype), kv_buf,
                                       meta, window=window, scale=scale, tiles=tiles, row_tiles=row_tiles)
        return out * vs.astype(out.dtype), kv_buf
    if kv_buf is None:
        if not meta.prefill:
            raise ValueError("attention without a cache needs a prefill AttnMeta")
        return attention(q, k, v, None, meta, window=window, scale=scale, tiles=tiles), None
    if tp_size() and (uses_kernel(q, kv_buf, meta, window=window) or uses_fused(q, meta, window=window, tiles=tiles)):
        # Split over devices: each runs the kernel on its own heads (XLA cannot split a Pallas call).
        local = functools.partial(_write_and_attend, window=window, scale=scale, tiles=tiles, row_tiles=row_tiles)
        return over_heads(local, q, k, v, kv_buf, meta)
    return _write_and_attend(q, k, v, kv_buf, meta, window=window, scale=scale, tiles=tiles, row_tiles=row_tiles)


def _write_and_attend(q, k, v, kv_buf, meta: AttnMeta, *, window: int, scale: float, tiles: AttentionTiles | None,
                      row_tiles: RowAttentionTiles | None):
    park = (meta.q_room and row_tiles is None and jnp.dtype(kv_buf.dtype) not in FP8_DTYPES
            and uses_kernel(q, kv_buf, meta, window=window))
    rows, index = jnp.stack([k, v], axis=2), meta.write_index  # a slot's keys and values: one write
    if park:
        rows, index = with_queries(rows, q, meta, kv_buf)
    kv_buf = write_kv(kv_buf, rows, index, meta.page_table is None)
    return attention(q, k, v, kv_buf, meta, window=window, scale=scale, q_in_cache=park, tiles=tiles,
                     row_tiles=row_tiles), kv_buf
