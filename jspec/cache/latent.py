"""The MLA latent cache kind (DeepSeek-V2/V3): per token and layer only the normalised KV
latent (kv_lora_rank values) and the roped key part shared by all heads (qk_rope_head_dim
values), side by side in one slot: 512 + 64 = 576 values for DeepSeek-V3, no per-head keys
or values.

One buffer per layer: dense [B, C + 1, Dc + Dr] or paged [num_pages + 1, P, Dc + Dr], in
the slot layout of `jspec.cache.layout` (trash row or page included). Writes, reads and
tree compaction are the GQA cache's (`jspec.cache.kv`), which work on any slot entry;
`cached_mla_attention` writes a layer's new rows and attends (`jspec.kernels.mla.attention`).

DeepSeek-V3.2's sparse attention adds, beside each layer's latent buffer, a buffer of the
lightning indexer's keys (Di values a token, `index_keys`) in the same slot layout: a
token's latent row and indexer key share a slot, so every write goes to both at the same
flat index and a tree commit moves both by the same moves, at every page size.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from flax import struct

from jspec.cache.kv import move_buffers, path_moves, write_kv
from jspec.cache.layout import CacheLayout, PageState
from jspec.tuning import DEFAULT_TUNING, Tuning
from jspec.kernels.meta import AttnMeta
from jspec.kernels.mla.attention import mla_attention


@struct.dataclass
class LatentCache:
    """Per-layer latent rows [rows, slots, Dc + Dr]: the normalised latent, then the roped
    key; with sparse attention per-layer indexer keys [rows, slots, Di] (else empty)."""

    latent: tuple
    index_keys: tuple = ()

    def layer(self, i: int):
        """Layer i's buffers as a layer takes them: its latent buffer, or (latent, indexer
        keys) with sparse attention."""
        return (self.latent[i], self.index_keys[i]) if self.index_keys else self.latent[i]

    @staticmethod
    def of_layers(bufs) -> "LatentCache":
        """`layer`'s inverse over all layers."""
        if bufs and isinstance(bufs[0], tuple):
            return LatentCache(latent=tuple(b[0] for b in bufs), index_keys=tuple(b[1] for b in bufs))
        return LatentCache(latent=tuple(bufs))


@dataclasses.dataclass(frozen=True)
class LatentCacheKind:
    """The cache an MLA model needs: per layer, Dc latent and Dr roped key values a token."""

    split_by_head: ClassVar[bool] = False  # replicated on every device of a mesh (one latent for all heads)
    prefill_in_chunks: ClassVar[bool] = True  # a prompt's later blocks attend to the earlier ones in the cache
    prefix_in_pages: ClassVar[bool] = True  # a prefix's whole state is in its pages (prefix caching)
    state_snapshots: ClassVar[bool] = False  # no state outside the pages to snapshot
    fp8_row_kernels: ClassVar[bool] = False  # an FP8 buffer is read by the jnp references only

    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    index_dim: int = 0  # Di: the indexer key's values a token (sparse attention; 0: none)

    @property
    def entry_size(self) -> int:
        """Values a token keeps per layer."""
        return self.kv_lora_rank + self.rope_dim

    def init(self, layout: CacheLayout, batch: int) -> LatentCache:
        """Zero buffers, one per layer: latent rows in `layout.kv_dtype` (an FP8 cache:
        written clipped to E4M3's range, `kv.stored`, and widened where attention reads
        them, `kernels.meta.widened`) or the model's dtype; indexer keys in the model's."""
        rows = layout.buffer_shape(batch)
        index = tuple(jnp.zeros(rows + (self.index_dim,), self.dtype) for _ in range(self.num_layers)
                      ) if self.index_dim else ()
        dtype = layout.kv_dtype or self.dtype
        return LatentCache(latent=tuple(jnp.zeros(rows + (self.entry_size,), dtype) for _ in range(self.num_layers)),
                           index_keys=index)

    def extra_slots(self, T: int, paged: bool) -> int:
        return 0

    def commit(self, cache: LatentCache, layout: CacheLayout, pages: PageState | None, L, path, accept_len,
               active, in_place: bool = False, tuning=DEFAULT_TUNING) -> LatentCache:
        """A round's commit: the accepted path's latent rows (and indexer keys) move from
        slots L + path[d] to L + d; nothing moves for a path already in place (a chain)."""
        if in_place:
            return cache
        moves = path_moves(layout, pages, L, path, accept_len, active)
        dense = not layout.paged
        return LatentCache(latent=move_buffers(cache.latent, *moves, dense),
                           index_keys=move_buffers(cache.index_keys, *moves, dense))


def cached_mla_attention(q_lat, q_pe, latent_new, latent_buf, meta: AttnMeta, w_uv, *, scale: float,
                         tuning: Tuning | None = None, index=None):
    """Writes the new latent rows latent_new [B,T,Dc+Dr] and attends over the cache (see
    `jspec.kernels.mla.attention.mla_attention`, which takes `tuning`'s tiles and `index`).
    -> (o [B,T,H,Dv] in w_uv's dtype, buffer)."""
    latent_buf = write_kv(latent_buf, latent_new, meta.write_index, meta.page_table is None)
    t = DEFAULT_TUNING if tuning is None else tuning
    return mla_attention(q_lat, q_pe, latent_buf, meta, w_uv, scale=scale, decode_tiles=t.mla_decode,
                         output_tiles=t.mla_output, index=index), latent_buf
