"""Pure functions around the target module: the jit boundary takes arrays, not modules."""
from __future__ import annotations

import jax.numpy as jnp

from jspec.cache.kv import AttnMeta, KVCache
from jspec.config import ModelConfig
from jspec.models.llama import LlamaModel


def forward(weights, cfg: ModelConfig, tokens, cache: KVCache | None, meta: AttnMeta,
            capture: tuple[int, ...] = ()):
    """tokens [B,T] -> (hidden [B,T,D] after the final norm, captured layer inputs, cache)."""
    return LlamaModel(cfg).apply(weights, tokens, cache, meta, capture)


def logits(weights, cfg: ModelConfig, hidden):
    """hidden [..., D] -> float32 logits [..., V]."""
    return LlamaModel(cfg).apply(weights, hidden, method=LlamaModel.logits)


def embed(weights, cfg: ModelConfig, tokens):
    return LlamaModel(cfg).apply(weights, tokens, method=LlamaModel.embed)


def prefill_meta(lengths, T: int) -> AttnMeta:
    """Causal self-attention over a right-padded block, no cache (rows valid < lengths)."""
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (lengths.shape[0], T))
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    valid = pos < lengths[:, None]
    return AttnMeta(positions=pos, prefix_len=jnp.zeros_like(lengths), local_mask=causal & valid[:, None, :],
                    local_positions=pos, write_index=jnp.zeros_like(pos), page_table=None, prefill=True)
