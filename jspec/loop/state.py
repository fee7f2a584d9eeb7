"""The loop's state: everything a running batch holds, one row per request slot.

A row is free (finished, nothing to do) until `rows.admit` puts a request in it, and free
again after `rows.evict`. Every per-request value lives in a row of the state: the tokens,
the limits and stop ids (`RequestRows`), the sampling values and seeds, the penalties'
history, finished and the reason; the caches hold the row's slots (dense: its region;
paged: the pages its page-table row names). Nothing per request is an argument of the
round loop, so requests can join and leave a running batch.

Per row b the loop keeps L[b]: slots 0..L-1 of the target cache hold committed tokens and
tokens[b, L] is the root, the newest token, not yet in the target cache.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jspec import sampling
from jspec.cache.layout import PageState
from jspec.sampling import SamplingParams

RUNNING, STOP, LENGTH, CACHE_FULL = 0, 1, 2, 3
FINISH_REASONS = {RUNNING: None, STOP: "stop", LENGTH: "length", CACHE_FULL: "cache_full"}


@struct.dataclass
class RequestRows:
    """A request's own values, one row per request ([B] in the state; [A] in an `Admission`)."""

    prompt_len: jax.Array  # [.] int32
    max_new: jax.Array  # [.] int32 tokens to generate at most
    room_bound: jax.Array  # [.] bool: max_new was cut to the cache's room (ends as cache_full)
    slot_limit: jax.Array  # [.] int32 slots the request may use (beyond: cache_full)
    sampling: SamplingParams  # [.] each: temperature, top-k/p, min-p, penalties, seed
    stop_ids: jax.Array  # [., Ks] int32 (-1: unused slot)


@struct.dataclass
class Admission:
    """A requests to put into rows (`rows.admit`): A of them, padded to a bucket."""

    prompt: jax.Array  # [A, Tp] int32, right-padded
    request: RequestRows  # [A]


@struct.dataclass
class LoopState:
    tokens: jax.Array  # [B, buffer_len] prompt + generated; tokens[b, L[b]] is the root
    root: jax.Array  # [B] the root, kept apart so a round needs no gather from tokens
    L: jax.Array  # [B] committed target slots
    generated: jax.Array  # [B] tokens emitted
    finished: jax.Array  # [B] bool (a free row is finished)
    reason: jax.Array  # [B] int32 (RUNNING, STOP, LENGTH, CACHE_FULL)
    tcache: object  # the target's cache (its family's cache kind)
    pages: PageState | None  # the page table every cache shares (paged layouts)
    history: sampling.History  # what the penalties read: prompt tokens, generated counts [B, V]
    proposal: object  # the proposer's own state (`Proposer.init`); None for plain decoding
    request: RequestRows  # [B] each row's request
    rounds: jax.Array  # [B] verify rounds run since the row's admission
    hist: jax.Array  # [B, R] accept length per round ([B, 0] without a proposer: always 1)
    step: jax.Array  # [] rounds of the loop


def empty_requests(batch: int, num_stop: int) -> RequestRows:
    """Rows holding no request (neutral values)."""
    z = jnp.zeros((batch,), jnp.int32)
    return RequestRows(prompt_len=z, max_new=z, room_bound=jnp.zeros((batch,), bool), slot_limit=z,
                       sampling=sampling.neutral(batch), stop_ids=jnp.full((batch, num_stop), -1, jnp.int32))


def init_state(plan) -> LoopState:
    """Every row free: zero caches, all pages in the pool."""
    B, V = plan.batch, plan.target.vocab_size
    tcache = plan.family.cache_kind(plan.target).init(plan.layout, B)
    proposal = plan.proposer.init(plan, B) if plan.proposer is not None else None
    return LoopState(
        tokens=jnp.zeros((B, plan.buffer_len), jnp.int32), root=jnp.zeros((B,), jnp.int32),
        L=jnp.zeros((B,), jnp.int32), generated=jnp.zeros((B,), jnp.int32), finished=jnp.ones((B,), bool),
        reason=jnp.zeros((B,), jnp.int32), tcache=tcache, pages=plan.layout.init_pages(B),
        history=sampling.History(in_prompt=jnp.zeros((B, V), bool), counts=jnp.zeros((B, V), jnp.int32)),
        proposal=proposal, request=empty_requests(B, plan.num_stop), rounds=jnp.zeros((B,), jnp.int32),
        hist=jnp.zeros((B, plan.max_rounds if plan.proposer is not None else 0), jnp.int32), step=jnp.int32(0))


def readback(st: LoopState) -> dict:
    """What the host reads back from a state."""
    return dict(tokens=st.tokens, generated=st.generated, reason=st.reason, rounds=st.rounds, hist=st.hist,
                finished=st.finished, step=st.step)
