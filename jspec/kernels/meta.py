"""What the cache-reading kernels know of a cache: how the T new tokens of a forward pass
meet it (`AttnMeta`), a layer's buffer read in slot order (`read_kv`, or a block of slots
at a time: `slot_blocks`), and where a slot
lies in a pool flattened over pages (`pool_rows`, inside a kernel).

The slot layouts themselves (dense rows, paged pools, the trash slot, page allocation) are
`jspec.cache.layout`'s, which builds every AttnMeta of the loop (`CacheLayout.meta`,
`make_meta`, `prefill_meta`); the kernels and their references only read one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jspec.quantization import FP8_DTYPES


@struct.dataclass
class AttnMeta:
    """How the T new tokens of one forward pass meet the cache (see `jspec.cache.layout`).

    positions [B, T]: RoPE positions. prefix_len [B]: slots before the local block.
    local_mask [B, T, Tl]: which local-block slots each new token sees (new tokens are the
    last T of the Tl). local_positions [B, Tl]: positions of the local slots (for sliding
    windows). write_index [B, T]: flat cache index of each new token (out of range: not
    written). page_table [B, G] or None (dense).
    parents [B, T]: each new token's parent among the T (-1: the newest token before the
    block, none in a prefill): t - 1 in a sequence, the tree's parent in a verification;
    a layer that is not attention (a recurrent state) follows it. valid [B, T]: the token
    is real (a prompt token, a proposed node of a live row); a layer may skip the rest.
    rows [B]: the request rows the pass's rows are (admission), None: rows 0..B-1; a cache
    kept per request row (a recurrent state) reads and writes those rows.
    """

    positions: jax.Array
    prefix_len: jax.Array
    local_mask: jax.Array
    local_positions: jax.Array
    write_index: jax.Array
    page_table: jax.Array | None
    parents: jax.Array | None = None  # None: not given (a kernel test's hand-made meta)
    valid: jax.Array | None = None
    rows: jax.Array | None = None
    page_size: int = struct.field(pytree_node=False, default=0)
    # Prefill: the prefix is empty, so attention reads only the new keys (no cache read).
    prefill: bool = struct.field(pytree_node=False, default=False)
    # A prompt's block: the local mask is causal over the block (token t sees local slots
    # up to t, of the valid ones), so fused causal attention may take it (`kernels.attention.fused`).
    causal_block: bool = struct.field(pytree_node=False, default=False)
    # Dense caches only: the slots right after the local block are free and in capacity for
    # what a cache kind keeps there during one forward (`KVCacheKind.extra_slots`).
    q_room: bool = struct.field(pytree_node=False, default=False)
    # Training: the jnp reference reads every block of the cache, its loops' bounds static
    # (scans, which differentiate), not up to the last block a row reads (traced bounds).
    differentiable: bool = struct.field(pytree_node=False, default=False)

    @property
    def local_len(self) -> int:
        return self.local_mask.shape[-1]


def read_kv(buf: jax.Array, page_table: jax.Array | None) -> jax.Array:
    """One layer's buffer as [B, Sk, ...] in slot order (paged: gathered through the page
    table), whatever a slot holds: keys and values [2, Hkv, Dh], an MLA latent row, an
    indexer key."""
    if page_table is None:
        return buf
    B, G = page_table.shape
    pages = buf[jnp.clip(page_table, 0, buf.shape[0] - 1)]  # [B, G, P, ...]
    return pages.reshape((B, G * buf.shape[1]) + buf.shape[2:])


def widened(rows: jax.Array, dtype) -> jax.Array:
    """Rows read from a cache as attention computes with them: an FP8 cache's
    (`CacheConfig.dtype`) widened to `dtype` (E4M3 values are exact in bfloat16, float16
    and float32), any other as it is."""
    return rows.astype(dtype) if jnp.dtype(rows.dtype) in FP8_DTYPES else rows


def slot_blocks(buf: jax.Array, page_table: jax.Array | None, block: int):
    """A reader of one layer's buffer `block` slots at a time, in slot order -> (read,
    block) where read(i) [B, block, ...] holds slots i*block .. (i+1)*block - 1 of each row
    (past the buffer: whatever, to be masked). block: at most the row's slots rounded up to
    64, then (paged) to whole pages; give a multiple of 64 for cuDNN's fused attention.
    Paged: only block i's pages are gathered, so a loop over the blocks a prefix needs
    holds one block of each row, not the row's whole table (at a 128k context, 512 MiB a
    row of an 8B layer's keys and values). Dense: the block's slots taken from the buffer,
    those past its end clamped to its last (padding the buffer to whole blocks instead
    copied all of it at every read: docs/experiments.md, "The dense cache's prefill gap")."""
    page = buf.shape[1] if page_table is not None else 1
    slots = page_table.shape[1] * page if page_table is not None else buf.shape[1]
    cols = -(-min(block, -(-slots // 64) * 64) // page)
    block = cols * page
    if page_table is None:
        return (lambda i: jnp.take(buf, i * block + jnp.arange(block), axis=1, mode="clip")), block
    table = jnp.pad(page_table, [(0, 0), (0, -page_table.shape[1] % cols)])  # (page 0: past every prefix)
    return (lambda i: read_kv(buf, lax.dynamic_slice_in_dim(table, i * cols, cols, axis=1))), block


def pool_rows(table_ref, b, slot, *, page_size: int, num_pages: int, dense: bool):
    """Inside a kernel: the rows of a cache pool flattened over pages [num_pages * P, ...]
    that batch row b's slots `slot` (int32, in range) are: dense, b's one page of S slots
    (no table lookup); paged, through table_ref [B, G] (entries >= num_pages: unallocated,
    clamped)."""
    if dense:
        return b * page_size + slot
    page = table_ref[b, lax.div(slot, page_size)]
    return jnp.clip(page, 0, num_pages - 1) * page_size + lax.rem(slot, page_size)
