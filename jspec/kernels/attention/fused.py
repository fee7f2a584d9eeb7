"""cuDNN's fused (flash) attention for a prompt's causal blocks, where it runs.

A prompt block of T tokens (`AttnMeta.causal_block`: token t sees the block's tokens up to
t, and every slot before the block) is attended in two fused calls that never materialise
[T, S]: the block over itself, causally (or, on a prompt's first block, alone), and the
block over the cache's prefix slots (`key_value_seq_lengths` = prefix_len, no mask); the
two are merged by their log-sum-exps. `jax.nn.dot_product_attention` takes both (GQA
included), with `implementation="cudnn"` on the GPU (the Pallas cache kernel is 3.6x
slower there at a 32k prompt: docs/benchmarks.md) and "xla" in the CPU tests of the merge.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.kernels.attention.decode import pad_slots
from jspec.kernels.meta import AttnMeta, read_kv

FUSED_DTYPES = (jnp.bfloat16, jnp.float16)


def is_supported(q, meta: AttnMeta, *, window: int = 0) -> bool:
    """Whether `block_attention` runs these arguments through cuDNN: a causal prompt block
    of a multiple of 64 tokens without a sliding window, bf16 or fp16 queries, head size
    a multiple of 8 up to 128, on a GPU."""
    Dh = q.shape[-1]
    return (meta.causal_block and not window and jax.default_backend() == "gpu" and q.dtype in FUSED_DTYPES
            and Dh % 8 == 0 and Dh <= 128 and q.shape[1] % 64 == 0)


def _btn(lse, B: int, T: int, H: int):
    """A log-sum-exp residual as [B, T, H] float32 (implementations return BTN or BNT)."""
    if lse.shape == (B, H, T) and H != T:
        lse = lse.transpose(0, 2, 1)
    return lse.astype(jnp.float32)


def block_attention(q, k_new, v_new, kv_buf, meta: AttnMeta, *, scale: float, implementation: str = "cudnn"):
    """Attention of a causal prompt block (see the module): q [B,T,H,Dh], its keys and
    values k_new/v_new [B,T,Hkv,Dh], the layer's cache kv_buf (dense or paged, see
    jspec.cache.kv; None on a prompt's first block, meta.prefill) -> [B,T,H,Dh]."""
    B, T, H, _ = q.shape
    own, own_lse = jax.nn.dot_product_attention(q, k_new, v_new, scale=scale, is_causal=True,
                                                implementation=implementation, return_residual=True)
    if meta.prefill:
        return own
    kv = pad_slots(read_kv(kv_buf, meta.page_table), 64)  # [B, S, 2, Hkv, Dh], slots in order
    pre, pre_lse = jax.nn.dot_product_attention(q, kv[:, :, 0], kv[:, :, 1], scale=scale,
                                                key_value_seq_lengths=jnp.maximum(meta.prefix_len, 1),
                                                implementation=implementation, return_residual=True)
    has_prefix = (meta.prefix_len > 0)[:, None, None]
    pre = jnp.where(has_prefix[..., None], pre, 0)  # a row without a prefix read one placeholder key
    own_lse, pre_lse = _btn(own_lse, B, T, H), jnp.where(has_prefix, _btn(pre_lse, B, T, H), -jnp.inf)
    top = jnp.maximum(own_lse, pre_lse)
    w_own, w_pre = jnp.exp(own_lse - top), jnp.exp(pre_lse - top)  # [B, T, H]
    out = (own.astype(jnp.float32) * w_own[..., None] + pre.astype(jnp.float32) * w_pre[..., None]) \
        / (w_own + w_pre)[..., None]
    return out.astype(q.dtype)
