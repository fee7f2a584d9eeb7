"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the latent cache.

A decode or verification step attends in the absorbed form: the key up-projection is
folded into the query (q_lat = q_nope W_UK, per head [Dc]), every head scores the cached
latent rows directly (q_lat . c + q_pe . k_pe), and the softmax-weighted latent o_lat
[B,T,H,Dc] is up-projected per head by W_UV. The cache is read once for all heads: a
slot is Dc + Dr values (jspec.cache.latent).

`mla_attention_reference` is the jnp reference of the attention; the mask rule is the GQA
cache's (`jspec.kernels.attention.cache_mask`). `mla_attention` applies W_UV as well and
dispatches (jspec.kernels.dispatch) to two Pallas kernels, `jspec.kernels.mla_decode`
(attention, key splits unmerged) and `jspec.kernels.mla_output` (merge and up-projection),
or to the references.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.cache.kv import read_kv, write_kv
from jspec.cache.layout import AttnMeta
from jspec.config import DEFAULT_TUNING, Tuning
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


def mla_attention(q_lat, q_pe, latent_buf, meta: AttnMeta, w_uv, *, scale: float, tuning: Tuning | None = None):
    """Attention in the absorbed form, then the value up-projection: q_lat [B,T,H,Dc],
    q_pe [B,T,H,Dr], w_uv [H, Dv, Dc] -> o [B,T,H,Dv] in w_uv's dtype (the attention's
    float32 latent rounded to that dtype before the product, `mla_output.up_project`).

    Dispatch: for non-prefill calls the Pallas kernels support, `mla_decode` attends and
    returns its key splits unmerged and `mla_output` merges them and applies W_UV in one
    kernel (up to `tuning.mla_output.kernel_max_tokens` tokens); otherwise the references.
    JSPEC_KERNELS=pallas forces the kernels (and raises for arguments they do not take).
    tuning: the kernels' tiles, `tuning.mla_decode` and `tuning.mla_output` (None: the
    defaults)."""
    from jspec.kernels import mla_output

    if not uses_kernel(q_lat, q_pe, latent_buf, meta):
        o_lat = mla_attention_reference(q_lat, q_pe, latent_buf, meta, scale=scale)
        return mla_output.up_project(o_lat, w_uv, w_uv.dtype)
    from jspec.kernels import mla_decode

    tuning = DEFAULT_TUNING if tuning is None else tuning
    o, lse = mla_decode.paged_mla_attention_splits(q_lat, q_pe, latent_buf, meta, scale=scale,
                                                   tiles=tuning.mla_decode)
    T = q_lat.shape[1]
    if dispatch.backend() == "pallas" or mla_output.is_supported(o, lse, w_uv, T, tuning.mla_output):
        return mla_output.mla_output(o, lse, w_uv, num_tokens=T, tiles=tuning.mla_output)
    return mla_output.mla_output_reference(o, lse, w_uv, num_tokens=T, dtype=w_uv.dtype)


def cached_mla_attention(q_lat, q_pe, latent_new, latent_buf, meta: AttnMeta, w_uv, *, scale: float,
                         tuning: Tuning | None = None):
    """Writes the new latent rows latent_new [B,T,Dc+Dr] and attends over the cache (see
    `mla_attention`, which takes `tuning`). -> (o [B,T,H,Dv] in w_uv's dtype, buffer)."""
    latent_buf = write_kv(latent_buf, latent_new, meta.write_index, meta.page_table is None)
    return mla_attention(q_lat, q_pe, latent_buf, meta, w_uv, scale=scale, tuning=tuning), latent_buf
