"""Requests join and leave a running batch: `admit` puts requests into free rows and
prefills only those rows; `evict` frees rows, returning their pages.

Both leave every other row bit for bit as it was: its tokens, request values, caches
(their slots and pages), history and proposer state. A row's tokens depend only on its
own request (its prompt, values and seed: the sampling noise is keyed by seed and
position), so a request admitted into a running batch produces what it produces alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import sampling
from jspec.cache.layout import causal_mask
from jspec.loop.plan import Plan
from jspec.loop.proposers.base import Observation
from jspec.loop.round import emit, release_pages, reserve_room
from jspec.loop.state import RUNNING, Admission, LoopState


def row_mask(batch: int, rows) -> jax.Array:
    """[batch] bool: the rows named in `rows` [A] (indices >= batch name no row)."""
    return jnp.zeros((batch,), bool).at[rows].set(True, mode="drop")


def admit(plan: Plan, tw, pw, st: LoopState, rows, adm: Admission) -> LoopState:
    """Puts the A requests of `adm` into rows `rows` [A] (an index >= B: no request, a
    padding entry; each named row's old pages are returned first) and prefills them: the
    target over their prompts, the first token chosen and emitted, the proposer's view of
    the prompt. A request that finds no room ends at once as cache_full."""
    B, T, V = plan.batch, plan.prompt_len, plan.target.vocab_size
    A = rows.shape[0]
    req = adm.request
    lens = req.prompt_len  # [A]
    mask = row_mask(B, rows)

    def put(old, new):
        return old.at[rows].set(new.astype(old.dtype), mode="drop")

    def take(a):  # [B, ...] -> the admitted rows' [A, ...] (padding entries: the last row's)
        return a[jnp.minimum(rows, B - 1)]

    st = release_pages(plan, st, mask)
    in_prompt = sampling.init_history(adm.prompt, lens, V).in_prompt  # [A, V]
    st = st.replace(
        tokens=put(st.tokens, jnp.pad(adm.prompt, ((0, 0), (0, plan.buffer_len - T)))),
        L=put(st.L, lens - 1),  # emit writes the first token after L
        generated=put(st.generated, jnp.zeros((A,), jnp.int32)), finished=st.finished & ~mask,
        reason=jnp.where(mask, RUNNING, st.reason), request=jax.tree.map(put, st.request, req),
        history=sampling.History(in_prompt=put(st.history.in_prompt, in_prompt),
                                 counts=put(st.history.counts, jnp.zeros((A, V), jnp.int32))),
        rounds=put(st.rounds, jnp.zeros((A,), jnp.int32)),
        hist=put(st.hist, jnp.zeros((A,) + st.hist.shape[1:], jnp.int32)))
    st, active = reserve_room(plan, st, st.request.prompt_len + plan.slack, mask, plan.layout.pages_per_seq)
    live = take(active) & (rows < B)  # [A] admitted rows with room

    ar = jnp.arange(T, dtype=jnp.int32)[None, :]
    meta = plan.layout.meta(st.pages, positions=jnp.broadcast_to(ar, (A, T)), prefix_len=jnp.zeros((A,), jnp.int32),
                            local_mask=causal_mask(lens, T), write_valid=(ar < lens[:, None]) & live[:, None],
                            prefill=True, rows=rows)
    hidden, aux, tcache = plan.family.forward(plan.target, tw, adm.prompt, st.tcache, meta, plan.capture,
                                              tuning=plan.tuning)
    last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
    logits = plan.family.logits(plan.target, tw, last, tuning=plan.tuning)[:, None]  # [A, 1, V]
    history = sampling.History(in_prompt=in_prompt, counts=jnp.zeros((A, V), jnp.int32))
    first = sampling.choose(plan.sampling, logits, req.sampling, lens[:, None], history)[:, 0]  # position len
    st = st.replace(tcache=tcache)
    st = emit(st, put(jnp.zeros((B,), jnp.int32), first)[:, None], jnp.ones((B,), jnp.int32), active)
    st = st.replace(L=put(st.L, lens), root=put(st.root, first))
    if plan.proposer is not None:
        obs = Observation(rows=rows, start=jnp.zeros((A,), jnp.int32), tokens=adm.prompt, count=lens, bonus=first,
                          L=lens, hidden=hidden, aux=aux, path=None, live=live & ~take(st.finished),
                          sampling=req.sampling, pages=st.pages, prefill=True)
        st = st.replace(proposal=plan.proposer.observe(plan, tw, pw, st.proposal, obs))
    return release_pages(plan, st, active & st.finished)


def evict(plan: Plan, st: LoopState, rows) -> LoopState:
    """Frees rows `rows` [A] (indices >= B: none): their pages back to the pool, the rows
    finished and reset. Rows that finished already hold no pages; evicting them resets them."""
    mask = row_mask(plan.batch, rows)
    st = release_pages(plan, st, mask)
    zero = lambda a: jnp.where(mask, 0, a)  # noqa: E731
    return st.replace(finished=st.finished | mask, reason=zero(st.reason), L=zero(st.L),
                      generated=zero(st.generated), rounds=zero(st.rounds))
