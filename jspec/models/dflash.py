"""DFlash block drafters as Flax modules (z-lab's `DFlashDraftModel`, arXiv 2602.06036).

A DFlash draft is a stack of Qwen3-style decoder layers (pre-norm, per-head q/k norms,
SwiGLU) with no embedding or LM head of its own (the target's serve). It proposes a whole
block in one forward:

- **Context.** The target's features at every committed position (the outputs of a few
  target layers, concatenated) are projected by `fc` and normed by `hidden_norm`; each
  layer turns that context into keys and values of its own (its `k_proj`/`v_proj`, its
  k-norm, RoPE at the token's position). Those are the draft's cache: written once per
  committed token (`context`), never through an attention pass.
- **Block.** The root (the last committed token, not yet in the target's cache) followed
  by mask tokens, at positions L, L+1, ...: queries, keys and values from the block's own
  hidden states; every block token sees the whole context and every other block token
  (attention inside the block is bidirectional). The output at block slot i predicts the
  token at L + i (slot 0's is unused).

Weights: the attention keeps `q_proj` [D, H Dh] apart from `kv_proj` [D, Hkv 2 Dh] (per KV
head its key, then its value), so the context pays for keys and values only.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jspec.cache.kv import KVCache, cached_attention, write_kv
from jspec.config import ModelConfig
from jspec.models.layers import Linear, RMSNorm, apply_rope
from jspec.models.llama import MLP
from jspec.tuning import DEFAULT_TUNING, Tuning


class DFlashAttention(nn.Module):
    cfg: ModelConfig
    tuning: Tuning = DEFAULT_TUNING

    def setup(self):
        c = self.cfg
        H, Hkv, Dh = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = Linear(H * Dh, c.qkv_bias, c.dtype, tuning=self.tuning)
        self.kv_proj = Linear(2 * Hkv * Dh, c.qkv_bias, c.dtype, tuning=self.tuning)
        self.o_proj = Linear(c.hidden_size, c.o_bias, c.dtype, tuning=self.tuning)
        self.q_norm = RMSNorm(c.rms_norm_eps, c.dtype)
        self.k_norm = RMSNorm(c.rms_norm_eps, c.dtype)

    def keys_values(self, x, positions):
        """x [B,T,D] at positions [B,T] -> (keys [B,T,Hkv,Dh], normed and rotated; values
        [B,T,Hkv,Dh], as projected)."""
        c = self.cfg
        B, T, _ = x.shape
        kv = self.kv_proj(x).reshape(B, T, c.num_kv_heads, 2, c.head_dim)
        k = apply_rope(self.k_norm(kv[:, :, :, 0]), positions, c.rope.inv_freq(c.head_dim), c.rope.cos_sin_scale())
        return k, kv[:, :, :, 1]

    def __call__(self, x, kv_buf, meta, ctx=None):
        """The block: x [B,T,D] -> (out [B,T,D], the buffer with the block's keys and values
        written at meta.write_index). meta.local_mask says which block tokens each sees.
        Training (`DFlashModel.train_blocks`): no buffer; the context ctx [B,Tc,D] at
        positions meta.local_positions[:, :Tc] gives keys and values placed before the
        block's, and meta (a prefill's) masks the Tc + T keys."""
        c = self.cfg
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, c.num_heads, c.head_dim))
        q = apply_rope(q, meta.positions, c.rope.inv_freq(c.head_dim), c.rope.cos_sin_scale())
        k, v = self.keys_values(x, meta.positions)
        if ctx is not None:
            kc, vc = self.keys_values(ctx, meta.local_positions[:, :ctx.shape[1]])
            k, v = jnp.concatenate([kc, k], axis=1), jnp.concatenate([vc, v], axis=1)
        o, kv_buf = cached_attention(q, k, v, kv_buf, meta, scale=c.head_dim ** -0.5, tiles=self.tuning.attention)
        return self.o_proj(o.reshape(B, T, c.num_heads * c.head_dim)), kv_buf

    def context(self, ctx, kv_buf, meta):
        """The context ctx [B,T,D] (projected target features) -> the buffer with its keys and
        values written at meta.write_index (positions meta.positions)."""
        k, v = self.keys_values(ctx, meta.positions)
        return write_kv(kv_buf, jnp.stack([k, v], axis=2), meta.write_index, meta.page_table is None)


class DFlashLayer(nn.Module):
    cfg: ModelConfig
    tuning: Tuning = DEFAULT_TUNING

    def setup(self):
        c = self.cfg
        self.input_layernorm = RMSNorm(c.rms_norm_eps, c.dtype)
        self.self_attn = DFlashAttention(c, self.tuning)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, c.dtype)
        self.mlp = MLP(c, self.tuning)

    def __call__(self, x, kv_buf, meta, ctx=None):
        a, kv_buf = self.self_attn(self.input_layernorm(x), kv_buf, meta, ctx)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv_buf

    def context(self, ctx, kv_buf, meta):
        return self.self_attn.context(ctx, kv_buf, meta)


class DFlashModel(nn.Module):
    """`__call__`: block embeddings [B,T,D] -> (final-norm hidden [B,T,D], cache);
    `context`: target features [B,T,F] -> cache with their keys and values written."""

    cfg: ModelConfig
    tuning: Tuning = DEFAULT_TUNING

    def setup(self):
        c = self.cfg
        self.fc = Linear(c.hidden_size, False, c.dtype, tuning=self.tuning)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, c.dtype)
        self.layers = [DFlashLayer(c, self.tuning, name=f"layers_{i}") for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, c.dtype)

    def __call__(self, embeds, cache: KVCache, meta):
        x, kvs = embeds, []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cache.kv[i], meta)
            kvs.append(kv)
        return self.norm(x), KVCache(kv=tuple(kvs))

    def context(self, feats, cache: KVCache, meta):
        ctx = self.project(feats)
        return KVCache(kv=tuple(layer.context(ctx, cache.kv[i], meta) for i, layer in enumerate(self.layers)))

    def project(self, feats):
        """Target features [B,T,F] -> the context [B,T,D] every layer's keys and values come from."""
        return self.hidden_norm(self.fc(feats.astype(self.cfg.jnp_dtype)))

    def train_blocks(self, embeds, feats, meta):
        """Training: blocks embeds [B,T,D] over the context of feats [B,Tc,F], no cache ->
        final-norm hidden [B,T,D]. meta: a prefill's over the Tc + T keys (the context's
        first: `local_positions` [B,Tc+T], `local_mask` [B,T,Tc+T]); the same keys,
        values and mask drafting reads from its cache, in one pass a differentiable
        reference attends over."""
        ctx, x = self.project(feats), embeds
        for layer in self.layers:
            x, _ = layer(x, None, meta, ctx)
        return self.norm(x)

    def init_all(self, embeds, feats, cache, meta):
        """Touches every parameter (for `init`)."""
        cache = self.context(feats, cache, meta)
        return self(embeds, cache, meta)
