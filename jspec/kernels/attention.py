"""Attention over the KV cache: the dispatch point between the Pallas kernel and its
pure-jnp reference (both in `jspec.kernels.decode_attention`), and `cached_attention`, the
one call a model makes (write the new keys and values, attend).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jspec import sharding
from jspec.cache.kv import with_queries, write_kv
from jspec.cache.layout import AttnMeta
from jspec.config import AttentionTiles, RowAttentionTiles
from jspec.kernels import decode_attention as da
from jspec.kernels import dispatch
from jspec.kernels.decode_attention import attention_reference, cache_mask  # noqa: F401  (the reference, re-exported)
from jspec.kernels.row_attention import row_attention

def uses_kernel(q, kv_buf, meta: AttnMeta, *, window: int = 0) -> bool:
    """Whether `attention` takes a Pallas kernel for these arguments (see the dispatch)."""
    if meta.prefill or dispatch.backend() == "reference":
        return False
    return dispatch.want_pallas(dispatch.backend() == "pallas" or da.is_supported(q, kv_buf, meta, window=window))


def attention(q, k_new, v_new, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
              q_in_cache: bool = False, tiles: AttentionTiles | None = None,
              row_tiles: RowAttentionTiles | None = None):
    """Dispatch (see jspec.kernels.dispatch): the Pallas decode kernel (with `tiles`, None:
    the defaults) for non-prefill calls it supports, else the reference.
    JSPEC_KERNELS=pallas forces the kernel (and raises for arguments it does not take).
    q_in_cache: the kernel reads the queries parked in the cache
    (`jspec.cache.kv.with_queries`) rather than q. row_tiles (`Tuning.row_invariant`):
    the row-invariant kernel (`kernels.row_attention`) with these tiles instead."""
    if row_tiles is not None and uses_kernel(q, kv_buf, meta, window=window):
        return row_attention(q, kv_buf, meta, window=window, scale=scale, tiles=row_tiles)
    if uses_kernel(q, kv_buf, meta, window=window):
        return da.paged_decode_attention(q, kv_buf, meta, window=window, scale=scale, q_in_cache=q_in_cache,
                                         tiles=tiles)
    return attention_reference(q, k_new, v_new, kv_buf, meta, window=window, scale=scale)


def cached_attention(q, k, v, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
                     tiles: AttentionTiles | None = None, row_tiles: RowAttentionTiles | None = None):
    """Writes the new keys and values into the layer's cache and attends over it.

    q [B,T,H,Dh]; k/v [B,T,Hkv,Dh]; kv_buf: the layer's buffer (jspec.cache.kv) or None
    (prefill without a cache: the block attends to itself). -> (out [B,T,H,Dh], buffer).
    When the Pallas kernel will run on a dense cache with room reserved (meta.q_room), the
    queries are parked in the cache by the same write (`jspec.cache.kv.with_queries`) and
    the kernel reads them there: no kernel of their own prepares the query tile. tiles:
    the kernel's (`attention`)."""
    if kv_buf is None:
        if not meta.prefill:
            raise ValueError("attention without a cache needs a prefill AttnMeta")
        return attention_reference(q, k, v, None, meta, window=window, scale=scale), None
    if sharding.tp_size() and uses_kernel(q, kv_buf, meta, window=window):
        # Split over devices: each runs the kernel on its own heads (XLA cannot split a Pallas call).
        local = functools.partial(_write_and_attend, window=window, scale=scale, tiles=tiles, row_tiles=row_tiles)
        return sharding.over_heads(local, q, k, v, kv_buf, meta)
    return _write_and_attend(q, k, v, kv_buf, meta, window=window, scale=scale, tiles=tiles, row_tiles=row_tiles)


def _write_and_attend(q, k, v, kv_buf, meta: AttnMeta, *, window: int, scale: float, tiles: AttentionTiles | None,
                      row_tiles: RowAttentionTiles | None):
    park = meta.q_room and row_tiles is None and uses_kernel(q, kv_buf, meta, window=window)
    rows, index = jnp.stack([k, v], axis=2), meta.write_index  # a slot's keys and values: one write
    if park:
        rows, index = with_queries(rows, q, meta, kv_buf)
    kv_buf = write_kv(kv_buf, rows, index, meta.page_table is None)
    return attention(q, k, v, kv_buf, meta, window=window, scale=scale, q_in_cache=park, tiles=tiles,
                     row_tiles=row_tiles), kv_buf
