"""Attention over the KV cache: the dispatch point between the Pallas kernels and their
pure-jnp reference (`jspec.kernels.attention.decode`, `jspec.kernels.row.attention`). A
model calls `jspec.cache.kv.cached_attention`, which writes the new keys and values into
the cache and then calls `attention`.
"""
from __future__ import annotations

import jax.numpy as jnp

from jspec.kernels.attention import decode as da
from jspec.kernels.attention import fused
from jspec.kernels import dispatch
from jspec.kernels.attention.decode import AttentionTiles, attention_reference
from jspec.kernels.meta import AttnMeta
from jspec.kernels.row.attention import RowAttentionTiles, row_attention
from jspec.quantization import FP8_DTYPES


def uses_kernel(q, kv_buf, meta: AttnMeta, *, window: int = 0) -> bool:
    """Whether `attention` takes a Pallas kernel for these arguments (see the dispatch)."""
    if meta.prefill or dispatch.backend() == "reference":
        return False
    return dispatch.want_pallas(dispatch.backend() == "pallas" or da.is_supported(q, kv_buf, meta, window=window))


def uses_fused(q, meta: AttnMeta, *, window: int = 0, tiles: AttentionTiles | None = None) -> bool:
    """Whether `attention` takes cuDNN's fused attention for these arguments: a causal
    prompt block it supports (`fused.is_supported`), JSPEC_KERNELS auto, and
    `AttentionTiles.fused_prompt_blocks`."""
    on = tiles.fused_prompt_blocks if tiles is not None else AttentionTiles().fused_prompt_blocks
    return on and dispatch.backend() == "auto" and fused.is_supported(q, meta, window=window)


def attention(q, k_new, v_new, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
              q_in_cache: bool = False, tiles: AttentionTiles | None = None,
              row_tiles: RowAttentionTiles | None = None):
    """Dispatch (see jspec.kernels.dispatch): the Pallas decode kernel (with `tiles`, None:
    the defaults) for non-prefill calls it supports, else the reference.
    JSPEC_KERNELS=pallas forces the kernel (and raises for arguments it does not take).
    q_in_cache: the kernel reads the queries parked in the cache
    (`jspec.cache.kv.with_queries`) rather than q. row_tiles (`Tuning.row_invariant`):
    the row-invariant kernel (`kernels.row.attention`) with these tiles instead. A causal
    prompt block goes to cuDNN's fused attention where it runs (`uses_fused`). An FP8
    cache (`CacheConfig.dtype`) is read by the kernels as FP8 (widened block by block): a
    prompt's later blocks, which read the cached prefix, go to the decode kernel, not
    cuDNN's (its first block reads no cache and goes to cuDNN's as over any cache)."""
    fp8 = kv_buf is not None and jnp.dtype(kv_buf.dtype) in FP8_DTYPES
    if (not fp8 or meta.prefill) and uses_fused(q, meta, window=window, tiles=tiles):
        return fused.block_attention(q, k_new, v_new, kv_buf, meta, scale=scale,
                                     prefix_block=(tiles or AttentionTiles()).prefix_block)
    if row_tiles is not None and uses_kernel(q, kv_buf, meta, window=window):
        return row_attention(q, kv_buf, meta, window=window, scale=scale, tiles=row_tiles)
    if uses_kernel(q, kv_buf, meta, window=window):
        return da.paged_decode_attention(q, kv_buf, meta, window=window, scale=scale, q_in_cache=q_in_cache,
                                         tiles=tiles)
    return attention_reference(q, k_new, v_new, kv_buf, meta, window=window, scale=scale)
