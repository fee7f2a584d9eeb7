"""Where a request's tokens live in a cache, whatever a slot holds (shared by every cache kind).

Every cache kind addresses a request's tokens by *slot* (0, 1, 2, ... in sequence order),
in one of two layouts:

- dense: per layer one buffer [B, C + 1, ...]; slot s < C of request b lives at [b, s].
- paged: per layer one buffer [num_pages + 1, P, ...] shared by all requests; slot s of
  request b lives in page `page_table[b, s // P]` at offset `s % P`. Pages are handed out
  on device by `alloc_pages` as sequences grow and returned by `free_pages`, or (a
  layout of `host_pages`, the serving engine's) by the host, which sets each row's pages
  in the table before the programs that write them (`set_pages`).

The extra slot of each dense row and the extra page of a pool are *trash*: a write that
must not land (a finished request, a slot past the capacity, an unallocated page) goes
there instead of being dropped. Every write index is then in bounds, so a one-token write
is a plain in-place update; XLA turns a dropping scatter into a read, a select and an
update, three kernels per layer in batch-1 decoding. Nothing ever reads the trash. A
scatter of many tokens (`jspec.cache.kv.set_slots`) drops its trash writes after all, each
at an index of its own past the end: all to one trash slot, they serialised on a GPU.

A forward pass over T new tokens writes them to consecutive slots and attends to a
*prefix* (slots < prefix_len, all visible) plus a *local block* (the Tl slots from
prefix_len on, visible per `local_mask`). That one rule covers prefill, decode, chain and
tree verification and tree drafting; `AttnMeta` (`jspec.kernels.meta`, what the kernels
read) carries it. Target and draft caches share one page table.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jspec.kernels.meta import AttnMeta
from jspec.util import cdiv


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static shape of every cache of one compiled generation.

    paged: a shared page pool (else a dense region per request). capacity: slots per
    request (paged: a multiple of page_size). page_size, num_pages: the pool (0 when dense).
    host_pages: the host owns the pool (the serving engine's `jspec.serve.pages.PagePool`):
    before each program it sets the pages each row will write (`set_pages`); the device
    neither hands pages out nor takes them back, and clears a row's table when it ends. A
    page may then sit in several rows' tables at once (a shared prefix). snapshots: the
    recurrent-state snapshots a hybrid cache keeps for prefix caching (`jspec.cache.recurrent`).
    kv_dtype: the dtype a cache stores keys and values (or MLA latent rows) in
    (`CacheConfig.dtype`; None: the model's).
    """

    paged: bool
    capacity: int
    page_size: int = 0
    num_pages: int = 0
    host_pages: bool = False
    snapshots: int = 0
    kv_dtype: str | None = None

    @property
    def pages_per_seq(self) -> int:
        return self.capacity // self.page_size if self.paged else 0

    def init_pages(self, batch: int) -> PageState | None:
        if not self.paged:
            return None
        state = init_page_state(batch, self.pages_per_seq, self.num_pages)
        return state.replace(num_free=jnp.int32(0)) if self.host_pages else state  # the device hands out none

    def buffer_shape(self, batch: int) -> tuple[int, int]:
        """Leading [rows, slots] of one layer's buffer, trash included."""
        return (self.num_pages + 1, self.page_size) if self.paged else (batch, self.capacity + 1)

    def slot_index(self, slots, valid, pages: PageState | None, rows=None):
        """Flat cache index of slots [B, T] (invalid: the trash), see `slot_index`. rows [B]:
        the request rows the B rows of `slots` are (None: rows 0..B-1); a row index past
        the batch must have no valid slot."""
        if self.paged:
            return slot_index(slots, valid, page_table=row_pages(pages, rows), page_size=self.page_size,
                              num_pages=self.num_pages)
        return slot_index(slots, valid, batch_capacity=self.capacity, rows=rows)

    def meta(self, pages: PageState | None, *, positions, prefix_len, local_mask, write_valid,
             local_positions=None, prefill: bool = False, rows=None, parents=None, node_valid=None) -> AttnMeta:
        """The AttnMeta of a forward pass of the loop. Dense rows keep room after the local
        block for what a cache kind asks (`extra_slots`), so `q_room` is set for them.
        rows [B]: which request rows the pass's B rows are (admission); None: all of them."""
        return make_meta(self, pages, positions=positions, prefix_len=prefix_len, local_mask=local_mask,
                         write_valid=write_valid, local_positions=local_positions, prefill=prefill,
                         q_room=not self.paged, rows=rows, parents=parents, node_valid=node_valid)


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


def causal_mask(lengths, T: int):
    """[B, T, T] bool: a right-padded block of T tokens attending causally, rows valid < lengths."""
    valid = jnp.arange(T, dtype=jnp.int32)[None, :] < lengths[:, None]
    return jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :]


def prefill_meta(lengths, T: int) -> AttnMeta:
    """Causal self-attention over a right-padded block, no cache (rows valid < lengths)."""
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (lengths.shape[0], T))
    return AttnMeta(positions=pos, prefix_len=jnp.zeros_like(lengths), local_mask=causal_mask(lengths, T),
                    local_positions=pos, write_index=jnp.zeros_like(pos), page_table=None, parents=pos - 1,
                    valid=pos < lengths[:, None], prefill=True, causal_block=True)


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
    want = cdiv(need_len, page_size)
    overflow = active & (want > G)
    need = jnp.where(active & ~overflow, jnp.maximum(jnp.minimum(want, G) - state.num_alloc, 0), 0)  # [B]
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


def row_pages(state: PageState, rows=None) -> jax.Array:
    """The page-table rows [R, G] of request rows `rows` [R] (None: every row; an index past
    the batch reads the last row, whose slots the caller marks invalid)."""
    if rows is None:
        return state.page_table
    return state.page_table[jnp.minimum(rows, state.page_table.shape[0] - 1)]


def set_pages(state: PageState, rows, cols, pages) -> PageState:
    """Page-table entries [rows[u], cols[u]] = pages[u] (U updates; a row index past the
    batch: none) -- the host's pages (`CacheLayout.host_pages`)."""
    return state.replace(page_table=state.page_table.at[rows, cols].set(pages, mode="drop"))


def clear_pages(state: PageState, release: jax.Array) -> PageState:
    """Rows `release` [B] hold no pages (their tables cleared; the host takes them back)."""
    return state.replace(page_table=jnp.where(release[:, None], state.free.shape[0], state.page_table),
                         num_alloc=jnp.where(release, 0, state.num_alloc))


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


def reserve(layout: CacheLayout, pages: PageState | None, need_len, active, cap, max_new_pages: int):
    """Room for need_len [B] slots per active row -> (pages, full [B]: rows that do not fit).

    A row fits when need_len <= its limit cap [B]. Paged, additionally: rows get pages in
    batch order; when the pool runs dry, the first row that cannot be served is dropped
    and returns its pages, and the rest are served again. A pool of at least
    pages_per_seq pages a row (the default) cannot run dry: one allocation, no retry loop
    (whose predicate XLA would read on the host). With `host_pages` the host set every
    row's pages before: nothing is allocated."""
    full = active & (need_len > cap)
    if not layout.paged:
        return pages, full
    if layout.host_pages:
        return clear_pages(pages, full), full
    max_new = min(layout.pages_per_seq, max_new_pages)
    pages = free_pages(pages, full)
    if layout.num_pages >= pages.page_table.shape[0] * layout.pages_per_seq:
        return alloc_pages(pages, need_len, active & ~full, layout.page_size, max_new)[0], full

    def attempt(c):
        pages, full, _ = c
        new, ok = alloc_pages(pages, need_len, active & ~full, layout.page_size, max_new)
        failed = ~ok
        first = jnp.argmax(failed)
        drop = failed.any() & (jnp.arange(failed.shape[0]) == first)
        pages = jax.tree.map(lambda a, b: jnp.where(failed.any(), a, b), free_pages(pages, drop), new)
        return pages, full | drop, failed.any()

    pages, full, _ = jax.lax.while_loop(lambda c: c[2], attempt, (pages, full, jnp.bool_(True)))
    return pages, full


def slot_index(slots: jax.Array, valid: jax.Array, *, batch_capacity: int = 0,
               page_table: jax.Array | None = None, page_size: int = 0,
               num_pages: int = 0, rows: jax.Array | None = None) -> jax.Array:
    """Flat cache index of `slots` [B, T] (dense: C = batch_capacity slots per row, the B
    rows being request rows `rows` [B] (None: 0..B-1); paged: num_pages usable pages, the
    page table's rows those of the slots). Invalid slots map to the trash: slot C of their
    row (dense; row 0 for a row index that is no row), or the first slot of page
    num_pages (paged)."""
    B = slots.shape[0]
    valid = valid & (slots >= 0)
    if page_table is None:
        row_ids = jnp.arange(B, dtype=jnp.int32) if rows is None else jnp.where(valid.any(axis=1), rows, 0)
        row = row_ids.astype(jnp.int32)[:, None] * (batch_capacity + 1)
        valid = valid & (slots < batch_capacity)
        return jnp.where(valid, row + slots, row + batch_capacity).astype(jnp.int32)
    G = page_table.shape[1]
    logical = slots // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, G - 1), axis=1)
    valid = valid & (logical < G) & (page < num_pages)
    return jnp.where(valid, page * page_size + slots % page_size, num_pages * page_size).astype(jnp.int32)


def make_meta(layout: CacheLayout, pages: PageState | None, *, positions, prefix_len, local_mask,
              write_valid, local_positions=None, prefill: bool = False, q_room: bool = False, rows=None,
              parents=None, node_valid=None) -> AttnMeta:
    """Builds the AttnMeta of a forward pass; the T new tokens go to the last T local slots.
    q_room: see `AttnMeta` (only a caller that reserved that room may set it). rows [B]:
    the request rows of the pass (None: all, in order). parents [B, T] (None: a sequence,
    t - 1) and node_valid [B, T] (None: write_valid): see `AttnMeta`."""
    B, T = positions.shape
    Tl = local_mask.shape[-1]
    slots = prefix_len[:, None] + (Tl - T) + jnp.arange(T, dtype=jnp.int32)[None, :]
    index = layout.slot_index(slots, write_valid, pages, rows)
    if local_positions is None:
        if T != Tl:
            raise ValueError("local_positions is required when T != Tl")
        local_positions = positions
    table = row_pages(pages, rows) if layout.paged else None
    if parents is None:
        parents = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :] - 1, (B, T))
    return AttnMeta(positions=positions.astype(jnp.int32), prefix_len=prefix_len.astype(jnp.int32),
                    local_mask=local_mask, local_positions=local_positions.astype(jnp.int32),
                    write_index=index, page_table=table, parents=parents.astype(jnp.int32),
                    valid=write_valid if node_valid is None else node_valid, rows=rows, page_size=layout.page_size,
                    prefill=prefill, q_room=q_room and not layout.paged and not prefill)
