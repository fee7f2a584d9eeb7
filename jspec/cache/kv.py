"""KV cache storage, addressing, page allocation and compaction.

Both cache kinds address a request's tokens by *slot* (0, 1, 2, ... in sequence order):

- dense: per layer one buffer [B, S + 1, 2, Hkv, Dh]; slot s < S of request b lives at
  [b, s].
- paged: per layer one buffer [num_pages + 1, P, 2, Hkv, Dh] shared by all requests; slot
  s of request b lives in page `page_table[b, s // P]` at offset `s % P`. Pages are handed
  out on device by `alloc_pages` as sequences grow and returned by `free_pages`.

A slot holds its keys ([..., 0, :, :]) and values ([..., 1, :, :]) side by side, so writing
or moving a token is one operation per layer, not two.

The extra slot of each dense row and the extra page of a pool are *trash*: a write that
must not land (a finished request, a slot past the capacity, an unallocated page) goes
there instead of being dropped. Every write index is then in bounds, so a one-token write
is a plain in-place update; XLA turns a dropping scatter into a read, a select and an
update, three kernels per layer in batch-1 decoding. Nothing ever reads the trash.

A forward pass over T new tokens writes them to consecutive slots and attends to a
*prefix* (slots < prefix_len, all visible) plus a *local block* (the Tl slots from
prefix_len on, visible per `local_mask`). That one rule covers prefill, decode, chain and
tree verification and tree drafting. Target and draft caches share one page table.

A dense cache may also carry a forward's queries for the attention kernel, parked in the
slots after its new tokens by the same write (`with_queries`, `query_slots`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Per-layer keys and values, stacked on axis -3: dense [B, S+1, 2, Hkv, Dh] or paged
    [num_pages+1, P, 2, Hkv, Dh] (the last slot of a row, the last page of a pool: trash, see
    the module docstring)."""

    kv: tuple


def cache_capacity(buf: jax.Array, paged: bool) -> int:
    """Usable size of one layer's buffer: slots per row (dense) or pages (paged)."""
    return buf.shape[0 if paged else 1] - 1


@struct.dataclass
class PageState:
    """Page table shared by the target and draft caches of a batch.

    page_table [B, G]: physical page of each logical page (num_pages = unallocated).
    num_alloc [B]: pages held by each request. free [num_pages]: a stack of free pages,
    the first `num_free` entries valid.
    """

    page_table: jax.Array
    num_alloc: jax.Array
    free: jax.Array
    num_free: jax.Array


@struct.dataclass
class AttnMeta:
    """How the T new tokens of one forward pass meet the cache (see the module docstring).

    positions [B, T]: RoPE positions. prefix_len [B]: slots before the local block.
    local_mask [B, T, Tl]: which local-block slots each new token sees (new tokens are the
    last T of the Tl). local_positions [B, Tl]: positions of the local slots (for sliding
    windows). write_index [B, T]: flat cache index of each new token (out of range: not
    written). page_table [B, G] or None (dense).
    """

    positions: jax.Array
    prefix_len: jax.Array
    local_mask: jax.Array
    local_positions: jax.Array
    write_index: jax.Array
    page_table: jax.Array | None
    page_size: int = struct.field(pytree_node=False, default=0)
    # Prefill: the prefix is empty, so attention reads only the new keys (no cache read).
    prefill: bool = struct.field(pytree_node=False, default=False)
    # Dense caches only: the slots right after the local block are free and in capacity
    # for `query_slots(T, H, Hkv)` more slots, so a layer may park its queries there, in
    # the same write as its keys and values (see `query_slots`).
    q_room: bool = struct.field(pytree_node=False, default=False)

    @property
    def local_len(self) -> int:
        return self.local_mask.shape[-1]


def init_kv_cache(num_layers, num_kv_heads, head_dim, dtype, *, batch=0, max_len=0,
                  num_pages=0, page_size=0) -> KVCache:
    """Zero cache: dense (max_len slots per row) when num_pages == 0, else a paged pool;
    each with its trash slot or page."""
    shape = (num_pages + 1, page_size) if num_pages else (batch, max_len + 1)
    shape = shape + (2, num_kv_heads, head_dim)
    return KVCache(kv=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))


def init_page_state(batch: int, pages_per_seq: int, num_pages: int) -> PageState:
    return PageState(page_table=jnp.full((batch, pages_per_seq), num_pages, jnp.int32),
                     num_alloc=jnp.zeros((batch,), jnp.int32),
                     free=jnp.arange(num_pages, dtype=jnp.int32)[::-1],
                     num_free=jnp.int32(num_pages))


def alloc_pages(state: PageState, need_len: jax.Array, active: jax.Array, page_size: int,
                max_new_pages: int) -> tuple[PageState, jax.Array]:
    """Gives each active request enough pages to hold `need_len` [B] slots.

    Requests are served in batch order; one that does not fit gets nothing and is reported
    in the returned `ok` [B] = False, as is every later one that needs pages.
    `max_new_pages` is a static bound on pages one request may need in this call.
    """
    B, G = state.page_table.shape
    num_pages = state.free.shape[0]
    want = jnp.minimum((need_len + page_size - 1) // page_size, G)
    need = jnp.where(active, jnp.maximum(want - state.num_alloc, 0), 0)  # [B]
    overflow = active & ((need_len + page_size - 1) // page_size > G)
    need = jnp.where(overflow, 0, need)
    cum = jnp.cumsum(need)
    ok = ((need == 0) | (cum <= state.num_free)) & ~overflow
    need = jnp.where(ok, need, 0)
    start = jnp.cumsum(need) - need  # exclusive prefix sum
    j = jnp.arange(max_new_pages, dtype=jnp.int32)[None, :]  # [1, M]
    take = j < need[:, None]  # [B, M]
    stack_pos = state.num_free - 1 - (start[:, None] + j)
    pages = state.free[jnp.clip(stack_pos, 0, num_pages - 1)]
    cols = jnp.where(take, state.num_alloc[:, None] + j, G)  # G: dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], cols.shape)
    table = state.page_table.at[rows, cols].set(pages, mode="drop")
    new = state.replace(page_table=table, num_alloc=state.num_alloc + need,
                        num_free=state.num_free - need.sum())
    return new, ok | ~active


def free_pages(state: PageState, release: jax.Array) -> PageState:
    """Returns the pages of requests with `release` [B] = True to the free stack."""
    B, G = state.page_table.shape
    num_pages = state.free.shape[0]
    held = release[:, None] & (jnp.arange(G)[None, :] < state.num_alloc[:, None])  # [B, G]
    flat = held.reshape(-1)
    dest = state.num_free + jnp.cumsum(flat) - 1
    dest = jnp.where(flat, dest, num_pages)
    free = state.free.at[dest].set(state.page_table.reshape(-1), mode="drop")
    table = jnp.where(release[:, None], num_pages, state.page_table)
    return state.replace(page_table=table, num_alloc=jnp.where(release, 0, state.num_alloc),
                         free=free, num_free=state.num_free + flat.sum())


def slot_index(slots: jax.Array, valid: jax.Array, *, batch_capacity: int = 0,
               page_table: jax.Array | None = None, page_size: int = 0,
               num_pages: int = 0) -> jax.Array:
    """Flat cache index of `slots` [B, T] (dense: S = batch_capacity slots per row; paged:
    num_pages usable pages). Invalid slots map to the trash: slot S of their row (dense),
    or the first slot of page num_pages (paged)."""
    B = slots.shape[0]
    valid = valid & (slots >= 0)
    if page_table is None:
        row = jnp.arange(B, dtype=jnp.int32)[:, None] * (batch_capacity + 1)
        valid = valid & (slots < batch_capacity)
        return jnp.where(valid, row + slots, row + batch_capacity).astype(jnp.int32)
    G = page_table.shape[1]
    logical = slots // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, G - 1), axis=1)
    valid = valid & (logical < G) & (page < num_pages)
    return jnp.where(valid, page * page_size + slots % page_size, num_pages * page_size).astype(jnp.int32)


def query_slots(T: int, num_heads: int, num_kv_heads: int) -> int:
    """Slots that hold the queries of T tokens (a slot has 2 * Hkv head vectors).

    The Pallas attention kernel can read its queries from the cache: writing them in the
    same update as the new keys and values saves the separate kernel that would prepare
    the query tile, ~1.7 us a layer in batch-1 decoding on the H200."""
    return -(-T * num_heads // (2 * num_kv_heads))


def make_meta(cache: KVCache, *, positions, prefix_len, local_mask, write_valid,
              local_positions=None, page_state: PageState | None = None, page_size: int = 0,
              prefill: bool = False, q_room: bool = False) -> AttnMeta:
    """Builds the AttnMeta of a forward pass; the T new tokens go to the last T local slots."""
    B, T = positions.shape
    Tl = local_mask.shape[-1]
    slots = prefix_len[:, None] + (Tl - T) + jnp.arange(T, dtype=jnp.int32)[None, :]
    buf0 = cache.kv[0]
    if page_state is None:
        index = slot_index(slots, write_valid, batch_capacity=cache_capacity(buf0, False))
        table = None
    else:
        table = page_state.page_table
        index = slot_index(slots, write_valid, page_table=table, page_size=page_size,
                           num_pages=cache_capacity(buf0, True))
    if local_positions is None:
        if T != Tl:
            raise ValueError("local_positions is required when T != Tl")
        local_positions = positions
    return AttnMeta(positions=positions.astype(jnp.int32), prefix_len=prefix_len.astype(jnp.int32),
                    local_mask=local_mask, local_positions=local_positions.astype(jnp.int32),
                    write_index=index, page_table=table, page_size=page_size, prefill=prefill,
                    q_room=q_room and page_state is None and not prefill)


def with_queries(new: jax.Array, q: jax.Array, meta: AttnMeta, buf: jax.Array):
    """Rows for `write_kv` that also park the queries: new [B, T, 2, Hkv, Dh] keys and
    values and q [B, T, H, Dh] -> ([B, T + Qs, 2, Hkv, Dh], flat indices [B, T + Qs]).

    The queries fill the Qs = `query_slots(T, H, Hkv)` slots right after the local block,
    token-major (query vector e = t * H + head sits in slot e // (2 Hkv) at position
    e % (2 Hkv) of its [2, Hkv] pairs). Dense caches only (meta.q_room): the loop keeps
    those slots inside the capacity of every live row, and nothing reads them as keys
    before a later forward writes its own tokens there."""
    B, T, H, Dh = q.shape
    Hkv = new.shape[3]
    Qs = query_slots(T, H, Hkv)
    flat = q.astype(new.dtype).reshape(B, T * H * Dh)
    flat = jnp.pad(flat, ((0, 0), (0, Qs * 2 * Hkv * Dh - T * H * Dh)))
    rows = jnp.concatenate([new, flat.reshape(B, Qs, 2, Hkv, Dh)], axis=1)
    slots = meta.prefix_len[:, None] + meta.local_len + jnp.arange(Qs, dtype=jnp.int32)[None, :]
    index = slot_index(slots, jnp.ones(slots.shape, bool), batch_capacity=cache_capacity(buf, False))
    return rows, jnp.concatenate([meta.write_index, index], axis=1)


def write_kv(buf: jax.Array, new: jax.Array, write_index: jax.Array, dense: bool = False) -> jax.Array:
    """Writes new [B, T, 2, Hkv, Dh] (keys and values) at flat indices [B, T] (in bounds: see
    `slot_index`).

    The T tokens of a forward pass go to consecutive slots, so one token, or a dense
    cache of one row, is one in-place block update (a scatter costs more). A dense row
    whose writes are invalid (a finished request) may then get garbage past its committed
    slots, which nothing reads before it is written again."""
    B, T = write_index.shape
    shape = buf.shape
    rows = new.astype(buf.dtype)
    if dense and B == 1 and T <= shape[1]:
        start = write_index[0, 0]  # flat index of row 0 = its slot
        return jax.lax.dynamic_update_slice(buf, rows, (0, start, 0, 0, 0))
    flat = buf.reshape((-1,) + shape[-3:])
    rows = rows.reshape((-1,) + shape[-3:])
    if B * T == 1:
        flat = jax.lax.dynamic_update_slice(flat, rows, (write_index.reshape(()), 0, 0, 0))
    else:
        flat = flat.at[write_index.reshape(-1)].set(rows, mode="promise_in_bounds")
    return flat.reshape(shape)


def read_kv(buf: jax.Array, page_table: jax.Array | None) -> jax.Array:
    """One layer's buffer as [B, Sk, 2, Hkv, Dh] in slot order (paged: gathered)."""
    if page_table is None:
        return buf
    B, G = page_table.shape
    pages = buf[jnp.clip(page_table, 0, buf.shape[0] - 1)]  # [B, G, P, 2, Hkv, Dh]
    return pages.reshape((B, G * buf.shape[1]) + buf.shape[2:])


def move_slots(cache: KVCache, src_index: jax.Array, dst_index: jax.Array) -> KVCache:
    """Copies every layer's entries at flat src [B, M] to flat dst [B, M] (gather, then set;
    moves that must not happen have both ends in the trash)."""
    def move(buf):
        shape = buf.shape
        flat = buf.reshape((-1,) + shape[-3:])
        vals = flat[src_index.reshape(-1)]
        return flat.at[dst_index.reshape(-1)].set(vals, mode="promise_in_bounds").reshape(shape)
    return KVCache(kv=tuple(move(b) for b in cache.kv))
