"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the latent cache.

A decode or verification step attends in the absorbed form: the key up-projection is
folded into the query (q_lat = q_nope W_UK, per head [Dc]), every head scores the cached
latent rows directly (q_lat . c + q_pe . k_pe), and the softmax-weighted latent o_lat
[B,T,H,Dc] leaves here; the caller applies the value up-projection W_UV. The cache is
read once for all heads: a slot is Dc + Dr values (jspec.cache.latent).

`mla_attention_reference` is the jnp reference; the mask rule is the GQA cache's
(`jspec.kernels.attention.cache_mask`). `mla_attention` dispatches (jspec.kernels.dispatch)
to the Pallas kernel `jspec.kernels.mla_decode.paged_mla_attention` or the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.cache.kv import read_kv, write_kv
from jspec.cache.layout import AttnMeta
from jspec.kernels import dispatch
from jspec.kernels.attention import NEG_INF, cache_mask


def mla_attention_reference(q_lat, q_pe, latent_buf, meta: AttnMeta, *, scale: float):
    """q_lat [B,T,H,Dc], q_pe [B,T,H,Dr]; latent_buf: the layer's buffer, already holding
    the new rows. -> o_lat [B,T,H,Dc] float32 (softmax in float32)."""
    Dc = q_lat.shape[-1]
    rows = read_kv(latent_buf, meta.page_table)  # [B, Sk, Dc + Dr]
    c, k_pe = rows[..., :Dc], rows[..., Dc:]
    s = (jnp.einsum("bthc,bsc->bhts", q_lat, c, preferred_element_type=jnp.float32)
         + jnp.einsum("bthr,bsr->bhts", q_pe, k_pe, preferred_element_type=jnp.float32)) * scale
    mask = cache_mask(meta, rows.shape[1], q_lat.shape[1])
    s = jnp.where(mask[:, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(c.dtype)
    # p rounded to the cache dtype; products of two such values are exact in float32 (and
    # XLA's CPU dot has no bf16 x bf16 -> f32 form for this contraction)
    return jnp.einsum("bhts,bsc->bthc", p.astype(jnp.float32), c.astype(jnp.float32))


def uses_kernel(q_lat, q_pe, latent_buf, meta: AttnMeta) -> bool:
    """Whether `mla_attention` takes the Pallas kernel for these arguments (see the dispatch)."""
    if meta.prefill or dispatch.backend() == "reference":
        return False
    from jspec.kernels import mla_decode  # imports this module

    return dispatch.want_pallas(dispatch.backend() == "pallas"
                                or mla_decode.is_supported(q_lat, q_pe, latent_buf, meta))


def mla_attention(q_lat, q_pe, latent_buf, meta: AttnMeta, *, scale: float):
    """Dispatch: the Pallas kernel for non-prefill calls it supports, else the reference
    (same arguments and result as `mla_attention_reference`). JSPEC_KERNELS=pallas forces
    the kernel (and raises for arguments it does not take)."""
    if uses_kernel(q_lat, q_pe, latent_buf, meta):
        from jspec.kernels import mla_decode

        return mla_decode.paged_mla_attention(q_lat, q_pe, latent_buf, meta, scale=scale)
    return mla_attention_reference(q_lat, q_pe, latent_buf, meta, scale=scale)


def cached_mla_attention(q_lat, q_pe, latent_new, latent_buf, meta: AttnMeta, *, scale: float):
    """Writes the new latent rows latent_new [B,T,Dc+Dr] and attends over the cache.
    -> (o_lat [B,T,H,Dc] float32, buffer)."""
    latent_buf = write_kv(latent_buf, latent_new, meta.write_index, meta.page_table is None)
    return mla_attention(q_lat, q_pe, latent_buf, meta, scale=scale), latent_buf
