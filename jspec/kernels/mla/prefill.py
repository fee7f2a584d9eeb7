"""A prompt block's MLA in the non-absorbed form, over the latent cache.

Decoding and verification attend in the absorbed form (`jspec.kernels.mla.decode`): few
queries, so folding W_UK into each query and scoring the Dc + Dr latent row directly reads
the cache once and skips the up-projection of every key. A prompt block has thousands of
queries, and there the absorbed form costs more: per query, head and key it scores Dc + Dr
= 576 values and sums Dc = 512 (DeepSeek's shapes), against Dn + Dr = 192 and Dv = 128 in
the model's own form. So a prompt block after the first does what the model does and what
FlashMLA's and SGLang's prefill do: the cached latent rows are up-projected to per-head
keys [Dn + Dr] and values [Dv] one key block at a time (k_nope = c W_UK, v = c W_UV, k_pe
shared by the heads), inside the same online softmax over key blocks as the blocked
reference (`jspec.kernels.attention.decode.attend_in_blocks`), so neither the [T, S]
scores nor the up-projected keys of the whole cache are ever held. The cache itself keeps
only the latent rows, written before the call as for any step.

On the GPU (`fused_attention`, where `jspec.kernels.attention.gqa.uses_fused` says cuDNN
runs) the same form goes through cuDNN's fused attention, as the GQA prompt blocks do
(`jspec.kernels.attention.fused`): the block over its own keys causally, then the prefix
in blocks of `FUSED_BLOCK_K` slots (up-projected one block at a time, each block's call
bounded by `key_value_seq_lengths`), every part merged by its log-sum-exp. cuDNN through
jax wants the values as wide as the keys, so they are padded with zeros from Dv to Dn + Dr
and the padding is dropped from the output.

The first block of a prompt (no prefix) takes the same form over its own keys (the model's
reference path, or `fused_attention`); DeepSeek-V3.2's sparse attention keeps the absorbed
sparse path (each token reads its 2048 selected slots whatever the prompt's length).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.attention.decode import REFERENCE_BLOCK_K, attend_cache_in_blocks, pad_slots
from jspec.kernels.attention.fused import merge_by_lse, residual_lse
from jspec.kernels.meta import AttnMeta, read_kv, slot_blocks, widened

FUSED_BLOCK_K = 4096  # prefix slots a fused call (their up-projected keys and values live at once)


def up_project(rows, w_uk, w_uv):
    """The model's keys and values from latent rows [B,S,Dc+Dr] (the normed latent c, the
    roped key part k_pe): keys [B,S,H,Dn+Dr] = [c W_UK | k_pe] (k_pe shared by the heads)
    and values [B,S,H,Dv] = c W_UV, in the rows' dtype; w_uk [Dc,H,Dn], w_uv [H,Dv,Dc]."""
    Dc, H = w_uk.shape[:2]
    c, k_pe = rows[..., :Dc], rows[..., Dc:]
    k_nope = jnp.einsum("bsc,chn->bshn", c, w_uk).astype(rows.dtype)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None], k_pe.shape[:2] + (H, k_pe.shape[-1]))], axis=-1)
    return k, jnp.einsum("bsc,hvc->bshv", c, w_uv).astype(rows.dtype)


def expanded_attention(q_nope, q_pe, latent_buf, meta: AttnMeta, w_uk, w_uv, *, scale: float,
                       block_k: int = REFERENCE_BLOCK_K):
    """Attention of a prompt block in the non-absorbed form (see the module): q_nope
    [B,T,H,Dn] and q_pe [B,T,H,Dr] (roped), latent_buf the layer's latent cache already
    holding the block's rows [.., Dc + Dr], w_uk [Dc,H,Dn], w_uv [H,Dv,Dc]; the mask rule
    is the cache's (`cache_mask`). -> o [B,T,H,Dv] in q_nope's dtype (softmax in float32;
    the keys and values rounded to the cache's dtype, as the model's prefill makes them)."""
    rows = widened(read_kv(latent_buf, meta.page_table), q_nope.dtype)  # [B, Sk, Dc + Dr]
    Sk = rows.shape[1]
    BK = min(block_k, Sk)
    rows = pad_slots(rows, BK)

    def keys_at(i):  # the block's keys [B,H,BK,Dn+Dr] and values [B,H,BK,Dv], up-projected
        k, v = up_project(lax.dynamic_slice_in_dim(rows, i * BK, BK, axis=1), w_uk, w_uv)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    q = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
    return attend_cache_in_blocks(q, keys_at, meta, Sk, BK, scale)


def fused_attention(q_nope, q_pe, rows, latent_buf, meta: AttnMeta, w_uk, w_uv, *, scale: float,
                    block_k: int = FUSED_BLOCK_K, implementation: str = "cudnn"):
    """`expanded_attention` of a causal prompt block through fused attention calls (see the
    module): rows [B,T,Dc+Dr] the block's own latent rows; latent_buf the layer's cache,
    read for the prefix (unused on a prompt's first block, meta.prefill). -> o [B,T,H,Dv] in
    q_nope's dtype. implementation: "cudnn" on the GPU, "xla" in the CPU tests."""
    B, T, H, Dn = q_nope.shape
    Dv, Dq = w_uv.shape[1], Dn + q_pe.shape[-1]
    dtype = q_nope.dtype
    q = jnp.concatenate([q_nope, q_pe.astype(dtype)], axis=-1)  # [B,T,H,Dq]

    def expand(block):  # latent rows [B,S,Dc+Dr] -> keys [B,S,H,Dq], values [B,S,H,Dq] (zeros past Dv)
        k, v = up_project(block, w_uk, w_uv)
        return k, jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, Dq - Dv)))

    def attend(k, v, **kw):  # -> (o [B,T,H,Dv] float32, lse [B,T,H])
        o, lse = jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=implementation,
                                              return_residual=True, **kw)
        return o[..., :Dv].astype(jnp.float32), residual_lse(lse, B, T, H)
    own = attend(*expand(rows), is_causal=True)
    if meta.prefill:
        return own[0].astype(dtype)
    read, BK = slot_blocks(latent_buf, meta.page_table, block_k)  # [B, BK, Dc+Dr] a block

    def prefix_block(i, carry):
        seen = jnp.clip(meta.prefix_len - i * BK, 0, BK)  # [B] prefix slots in block i
        k, v = expand(widened(read(i), dtype))
        o, lse = attend(k, v, key_value_seq_lengths=jnp.maximum(seen, 1))
        return merge_by_lse(*carry, o, lse, seen > 0)
    o, _ = lax.fori_loop(0, pl.cdiv(jnp.max(meta.prefix_len), BK), prefix_block, own)
    return o.astype(dtype)
