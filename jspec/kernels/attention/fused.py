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
from jax import lax

from jspec.kernels.attention.decode import AttentionTiles
from jspec.kernels.meta import AttnMeta, slot_blocks

FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
NO_KEYS = -1e30  # the log-sum-exp of a merge that saw no key yet (finite: two of them merge to no NaN)


def max_head_dim() -> int:
    """The largest head size cuDNN's fused attention takes through jax on this GPU: 256
    from Hopper (compute capability 9.0) on, 128 before (jax's own check)."""
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    return 256 if tuple(int(x) for x in capability.split(".")[:2]) >= (9, 0) else 128


def is_supported(q, meta: AttnMeta, *, window: int = 0) -> bool:
    """Whether `block_attention` runs these arguments through cuDNN: a causal prompt block
    of a multiple of 64 tokens without a sliding window, bf16 or fp16 queries, head size
    a multiple of 8 up to `max_head_dim`, on a GPU."""
    Dh = q.shape[-1]
    return (meta.causal_block and not window and jax.default_backend() == "gpu" and q.dtype in FUSED_DTYPES
            and Dh % 8 == 0 and q.shape[1] % 64 == 0 and Dh <= max_head_dim())


def residual_lse(lse, B: int, T: int, H: int):
    """A `jax.nn.dot_product_attention` log-sum-exp residual as [B, T, H] float32 (the
    implementations return BTN or BNT)."""
    if lse.shape == (B, H, T) and H != T:
        lse = lse.transpose(0, 2, 1)
    return lse.astype(jnp.float32)


def block_attention(q, k_new, v_new, kv_buf, meta: AttnMeta, *, scale: float, implementation: str = "cudnn",
                    prefix_block: int | None = None):
    """Attention of a causal prompt block (see the module): q [B,T,H,Dh], its keys and
    values k_new/v_new [B,T,Hkv,Dh], the layer's cache kv_buf (dense or paged, see
    jspec.cache.kv; None on a prompt's first block, meta.prefill) -> [B,T,H,Dh].
    prefix_block: slots of the cache's prefix read a step (`prefix_attention`; None:
    `AttentionTiles.prefix_block`)."""
    B, T, H, _ = q.shape
    own, own_lse = jax.nn.dot_product_attention(q, k_new, v_new, scale=scale, is_causal=True,
                                                implementation=implementation, return_residual=True)
    if meta.prefill:
        return own
    pre, pre_lse = prefix_attention(q, kv_buf, meta, scale=scale, implementation=implementation,
                                    block=prefix_block or AttentionTiles().prefix_block)
    has_prefix = meta.prefix_len > 0
    out, _ = merge_by_lse(own, residual_lse(own_lse, B, T, H), pre, pre_lse, has_prefix)
    return out.astype(q.dtype)


def prefix_attention(q, kv_buf, meta: AttnMeta, *, scale: float, implementation: str, block: int):
    """q [B,T,H,Dh] over the cache's first meta.prefix_len [B] slots, unmasked -> (out
    [B,T,H,Dh] float32, its log-sum-exp [B,T,H]; a row with no prefix reads a placeholder).
    The cache is read `block` slots at a time (`slot_blocks`: a paged one gathers only those
    pages), only as many steps as the longest prefix needs, the steps merged by their
    log-sum-exps: gathering a row's whole table (128k slots of an 8B layer: 512 MiB a row)
    ran a batch of admissions out of memory beside a full pool."""
    B, T, H, _ = q.shape
    read, step = slot_blocks(kv_buf, meta.page_table, block)  # (give 64-slot multiples for cuDNN)

    def body(j, carry):
        kv = read(j)  # [B, step, 2, Hkv, Dh]
        n = jnp.clip(meta.prefix_len - j * step, 0, step)
        o, lse = jax.nn.dot_product_attention(q, kv[:, :, 0], kv[:, :, 1], scale=scale,
                                              key_value_seq_lengths=jnp.maximum(n, 1),
                                              implementation=implementation, return_residual=True)
        return merge_by_lse(*carry, o.astype(jnp.float32), residual_lse(lse, B, T, H), n > 0)
    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((B, T, H), NO_KEYS, jnp.float32))
    return lax.fori_loop(0, (jnp.max(meta.prefix_len) + step - 1) // step, body, init)


def merge_by_lse(o_a, lse_a, o_b, lse_b, b_seen=None):
    """Two softmax attentions over disjoint key sets merged into the one over their union:
    o [B,T,H,Dv] and their log-sum-exps lse [B,T,H] float32; b_seen [B] bool or None: the
    rows whose part b saw any key (the others read a placeholder: b counts nothing there).
    -> (o float32, lse) of the union."""
    if b_seen is not None:
        o_b = jnp.where(b_seen[:, None, None, None], o_b, 0)
        lse_b = jnp.where(b_seen[:, None, None], lse_b, -jnp.inf)
    top = jnp.maximum(lse_a, lse_b)
    w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)  # [B, T, H]
    total = w_a + w_b
    out = (o_a.astype(jnp.float32) * w_a[..., None] + o_b.astype(jnp.float32) * w_b[..., None]) / total[..., None]
    return out, top + jnp.log(total)
