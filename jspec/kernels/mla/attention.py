"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the latent cache.

A decode or verification step attends in the absorbed form: the key up-projection is
folded into the query (q_lat = q_nope W_UK, per head [Dc]), every head scores the cached
latent rows directly (q_lat . c + q_pe . k_pe), and the softmax-weighted latent o_lat
[B,T,H,Dc] is up-projected per head by W_UV. The cache is read once for all heads: a
slot is Dc + Dr values (jspec.cache.latent).

`mla_decode.mla_attention_reference` is the jnp reference of the attention; the mask rule
is the GQA cache's (`jspec.kernels.attention.decode.cache_mask`). `mla_attention` applies W_UV as well and
dispatches (jspec.kernels.dispatch) to two Pallas kernels, `jspec.kernels.mla.decode`
(attention, key splits unmerged) and `jspec.kernels.mla.output` (merge and up-projection),
or to the references.
"""
from __future__ import annotations

import jax.numpy as jnp

from jspec.kernels import dispatch
from jspec.kernels.mla import decode as mla_decode, output as mla_output, sparse as mla_sparse
from jspec.kernels.meta import AttnMeta
from jspec.kernels.mla.decode import MlaDecodeTiles, mla_attention_reference
from jspec.kernels.mla.output import MlaOutputTiles
from jspec.quantization import FP8_DTYPES


def uses_kernel(q_lat, q_pe, latent_buf, meta: AttnMeta) -> bool:
    """Whether `mla_attention` takes the Pallas kernel for these arguments (see the dispatch)."""
    if meta.prefill or dispatch.backend() == "reference":
        return False
    return dispatch.want_pallas(dispatch.backend() == "pallas"
                                or mla_decode.is_supported(q_lat, q_pe, latent_buf, meta))


def mla_attention(q_lat, q_pe, latent_buf, meta: AttnMeta, w_uv, *, scale: float,
                  decode_tiles: MlaDecodeTiles | None = None, output_tiles: MlaOutputTiles | None = None,
                  index=None):
    """Attention in the absorbed form, then the value up-projection: q_lat [B,T,H,Dc],
    q_pe [B,T,H,Dr], w_uv [H, Dv, Dc] -> o [B,T,H,Dv] in w_uv's dtype (the attention's
    float32 latent rounded to that dtype before the product, `mla_output.up_project`).

    Dispatch: for non-prefill calls the Pallas kernels support, `mla_decode` attends and
    returns its key splits unmerged and `mla_output` merges them and applies W_UV in one
    kernel (up to `output_tiles.kernel_max_tokens` tokens); otherwise the references.
    JSPEC_KERNELS=pallas forces the kernels (and raises for arguments they do not take).
    decode_tiles, output_tiles: the kernels' tiles (`Tuning.mla_decode`, `Tuning.mla_output`;
    None: the defaults). index [B,T,Ki] int32: sparse attention (DeepSeek-V3.2), the slots each token
    attends to (-1: none) instead of every slot it sees: `jspec.kernels.mla.sparse`, its
    Pallas kernel or its gather reference. An FP8 cache (`CacheConfig.dtype`) is read by
    the references, widened to the queries' dtype (the kernels do not take it yet)."""
    fp8 = jnp.dtype(latent_buf.dtype) in FP8_DTYPES
    if index is not None:
        mode = dispatch.backend()
        if mode != "reference" and not fp8 and dispatch.want_pallas(
                mode == "pallas" or mla_sparse.is_supported(q_lat, q_pe, latent_buf, index)):
            o_lat = mla_sparse.sparse_mla_attention(q_lat, q_pe, latent_buf, meta.page_table, index, scale=scale)
        else:
            o_lat = mla_sparse.sparse_mla_reference(q_lat, q_pe, latent_buf, meta.page_table, index, scale=scale)
        return mla_output.up_project(o_lat, w_uv, w_uv.dtype)
    if fp8 or not uses_kernel(q_lat, q_pe, latent_buf, meta):
        o_lat = mla_attention_reference(q_lat, q_pe, latent_buf, meta, scale=scale)
        return mla_output.up_project(o_lat, w_uv, w_uv.dtype)
    o, lse = mla_decode.paged_mla_attention_splits(q_lat, q_pe, latent_buf, meta, scale=scale,
                                                   tiles=decode_tiles)
    T = q_lat.shape[1]
    if dispatch.backend() == "pallas" or mla_output.is_supported(o, lse, w_uv, T, output_tiles):
        return mla_output.mla_output(o, lse, w_uv, num_tokens=T, tiles=output_tiles)
    return mla_output.mla_output_reference(o, lse, w_uv, num_tokens=T, dtype=w_uv.dtype)
