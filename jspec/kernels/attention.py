"""Attention over the KV cache: the pure-jnp reference, the dispatch point, and
`cached_attention`, the one call a model makes (write the new keys and values, attend).

The mask rule (see jspec.cache.layout): a query sees every prefix slot (< prefix_len) and the
local-block slots its `local_mask` row allows; a sliding window W additionally hides keys
whose position is <= the query position - W.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec import sharding
from jspec.cache.kv import read_kv, with_queries, write_kv
from jspec.cache.layout import AttnMeta
from jspec.config import AttentionTiles
from jspec.kernels import dispatch

NEG_INF = -1e30


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


def _window_ok(q_pos, k_pos, window: int):
    """[B,T] x [B,Sk] -> [B,T,Sk]: key inside the sliding window of the query."""
    if not window:
        return True
    return k_pos[:, None, :] > q_pos[:, :, None] - window


def attention_reference(q, k_new, v_new, kv_buf, meta: AttnMeta, *, window: int = 0,
                        scale: float):
    """q [B,T,H,Dh]; k_new/v_new [B,T,Hkv,Dh]; kv_buf: the layer's cache buffer (see
    jspec.cache.kv), already holding the new keys and values (None for prefill). Returns
    [B,T,H,Dh]; `scale` is the softmax scale."""
    if meta.prefill:
        mask = meta.local_mask & _window_ok(meta.positions, meta.local_positions, window)
        return _softmax_attend(q, k_new, v_new, mask, scale)
    kv = read_kv(kv_buf, meta.page_table)  # [B, Sk, 2, Hkv, Dh]
    k, v = kv[:, :, 0], kv[:, :, 1]
    mask = cache_mask(meta, k.shape[1], q.shape[1], window)
    return _softmax_attend(q, k, v, mask, scale)


def cache_mask(meta: AttnMeta, Sk: int, T: int, window: int = 0):
    """[B, T, Sk] bool: which of the Sk cache slots (in slot order) each of the T new
    tokens sees, by the rule in the module docstring."""
    Tl = meta.local_len
    rel = jnp.arange(Sk, dtype=jnp.int32)[None, :] - meta.prefix_len[:, None]  # [B, Sk]
    in_prefix = rel < 0
    in_local = (rel >= 0) & (rel < Tl)
    rel_c = jnp.clip(rel, 0, Tl - 1)
    local = jnp.take_along_axis(meta.local_mask, jnp.broadcast_to(rel_c[:, None, :], (rel.shape[0], T, Sk)), axis=2)
    mask = in_prefix[:, None, :] | (in_local[:, None, :] & local)
    if window:
        k_pos = jnp.where(in_prefix, jnp.arange(Sk)[None, :],
                          jnp.take_along_axis(meta.local_positions, rel_c, axis=1))
        mask = mask & _window_ok(meta.positions, k_pos, window)
    return mask


def uses_kernel(q, kv_buf, meta: AttnMeta, *, window: int = 0) -> bool:
    """Whether `attention` takes the Pallas kernel for these arguments (see the dispatch)."""
    if meta.prefill or dispatch.backend() == "reference":
        return False
    from jspec.kernels import decode_attention as da  # imports this module

    return dispatch.want_pallas(dispatch.backend() == "pallas" or da.is_supported(q, kv_buf, meta, window=window))


def attention(q, k_new, v_new, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
              q_in_cache: bool = False, tiles: AttentionTiles | None = None):
    """Dispatch (see jspec.kernels.dispatch): the Pallas decode kernel (with `tiles`, None:
    the defaults) for non-prefill calls it supports, else the reference.
    JSPEC_KERNELS=pallas forces the kernel (and raises for arguments it does not take).
    q_in_cache: the kernel reads the queries parked in the cache
    (`jspec.cache.kv.with_queries`) rather than q."""
    if uses_kernel(q, kv_buf, meta, window=window):
        from jspec.kernels import decode_attention as da

        return da.paged_decode_attention(q, kv_buf, meta, window=window, scale=scale, q_in_cache=q_in_cache,
                                         tiles=tiles)
    return attention_reference(q, k_new, v_new, kv_buf, meta, window=window, scale=scale)


def cached_attention(q, k, v, kv_buf, meta: AttnMeta, *, window: int = 0, scale: float,
                     tiles: AttentionTiles | None = None):
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
        local = functools.partial(_write_and_attend, window=window, scale=scale, tiles=tiles)
        return sharding.over_heads(local, q, k, v, kv_buf, meta)
    return _write_and_attend(q, k, v, kv_buf, meta, window=window, scale=scale, tiles=tiles)


def _write_and_attend(q, k, v, kv_buf, meta: AttnMeta, *, window: int, scale: float, tiles: AttentionTiles | None):
    park = meta.q_room and uses_kernel(q, kv_buf, meta, window=window)
    rows, index = jnp.stack([k, v], axis=2), meta.write_index  # a slot's keys and values: one write
    if park:
        rows, index = with_queries(rows, q, meta, kv_buf)
    kv_buf = write_kv(kv_buf, rows, index, meta.page_table is None)
    return attention(q, k, v, kv_buf, meta, window=window, scale=scale, q_in_cache=park, tiles=tiles), kv_buf
