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
from jspec.constraints.tables import GrammarTables, free_tables
from jspec.sampling import SamplingParams

RUNNING, STOP, LENGTH, CACHE_FULL = 0, 1, 2, 3
FINISH_REASONS = {RUNNING: None, STOP: "stop", LENGTH: "length", CACHE_FULL: "cache_full"}
MAX_LOGPROBS = 20  # the most alternatives a position's log-probabilities list (OpenAI's and vLLM's cap)


@struct.dataclass
class RequestRows:
    """A request's own values, one row per request ([B] in the state; [A] in an `Admission`)."""

    prompt_len: jax.Array  # [.] int32
    max_new: jax.Array  # [.] int32 tokens to generate at most
    room_bound: jax.Array  # [.] bool: max_new was cut to the cache's room (ends as cache_full)
    slot_limit: jax.Array  # [.] int32 slots the request may use (beyond: cache_full)
    sampling: SamplingParams  # [.] each: temperature, top-k/p, min-p, penalties, seed
    stop_ids: jax.Array  # [., Ks] int32 (-1: unused slot)
    min_tokens: jax.Array  # [.] int32 tokens generated before a stop id may be chosen (0: off)
    speculative: jax.Array  # [.] bool: drafts may be accepted (False: every round keeps the root alone)
    resumed: jax.Array  # [.] int32 the prompt's last tokens that are output already (a preempted request resumed)
    grammar_start: jax.Array  # [.] int32 its constraint's state after its output so far (0: FREE, unconstrained)


@struct.dataclass
class Admission:
    """A requests to put into rows (`rows.admit`): A of them, padded to a bucket."""

    prompt: jax.Array  # [A, Tp] int32, right-padded
    request: RequestRows  # [A]
    grammar: GrammarTables | None = None  # the tables its rows' states index (None: the state's stay)


@struct.dataclass
class TokenLogprobs:
    """The target's log-probabilities (log-softmax of its raw logits) of the token at each
    position of the token buffer given the tokens before it, and the k most likely
    alternatives there (`Plan.logprobs` = k); NaN / -1 where nothing was recorded."""

    chosen: jax.Array  # [B, buffer_len] float32
    top_ids: jax.Array  # [B, buffer_len, k] int32, most likely first
    top: jax.Array  # [B, buffer_len, k] float32


@struct.dataclass
class GrammarState:
    """The constraints of a batch (`jspec.constraints.tables`): the tables, and each row's
    state after its committed tokens (0, FREE: unconstrained)."""

    tables: GrammarTables
    state: jax.Array  # [B] int32


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
    logprobs: TokenLogprobs | None  # None unless Plan.logprobs > 0
    grammar: GrammarState | None = None  # None unless Plan.grammar (the tables' capacities)


def empty_requests(batch: int, num_stop: int) -> RequestRows:
    """Rows holding no request (neutral values)."""
    z = jnp.zeros((batch,), jnp.int32)
    return RequestRows(prompt_len=z, max_new=z, room_bound=jnp.zeros((batch,), bool), slot_limit=z,
                       sampling=sampling.neutral(batch), stop_ids=jnp.full((batch, num_stop), -1, jnp.int32),
                       min_tokens=z, speculative=jnp.ones((batch,), bool), resumed=z, grammar_start=z)


def empty_logprobs(batch: int, length: int, k: int) -> TokenLogprobs:
    return TokenLogprobs(chosen=jnp.full((batch, length), jnp.nan, jnp.float32),
                         top_ids=jnp.full((batch, length, k), -1, jnp.int32),
                         top=jnp.full((batch, length, k), jnp.nan, jnp.float32))


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
        hist=jnp.zeros((B, plan.max_rounds if plan.proposer is not None else 0), jnp.int32), step=jnp.int32(0),
        logprobs=empty_logprobs(B, plan.buffer_len, plan.logprobs) if plan.logprobs else None,
        grammar=GrammarState(tables=free_tables(*plan.grammar, V), state=jnp.zeros((B,), jnp.int32))
        if plan.grammar else None)


def readback(st: LoopState) -> dict:
    """What the host reads back from a state: every row whole."""
    back = dict(tokens=st.tokens, generated=st.generated, reason=st.reason, rounds=st.rounds, hist=st.hist,
                finished=st.finished, step=st.step)
    if st.logprobs is not None:
        back.update(lp_chosen=st.logprobs.chosen, lp_top_ids=st.logprobs.top_ids, lp_top=st.logprobs.top)
    return back


def window(a, start, width: int):
    """a [B, X, ...] -> a[b, start[b] : start[b] + width] [B, width, ...] (clipped at the end)."""
    idx = jnp.minimum(start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], a.shape[1] - 1)
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


def readback_window(st: LoopState, token_start, round_start, tokens: int, rounds: int) -> dict:
    """What a serving engine reads after a call: per row, `tokens` buffer positions from
    `token_start` [B] (tokens and, with logprobs, theirs) and the accept lengths of
    `rounds` rounds from round `round_start` [B], with the rows' counters, packed into one
    int32 array (and one float32 array of logprobs) so that a readback is one or two
    transfers; `unpack_window` names the parts on the host."""
    B = st.tokens.shape[0]
    counters = [token_start, st.generated, st.reason, st.rounds, round_start, st.finished.astype(jnp.int32),
                jnp.full((B,), st.step, jnp.int32), jnp.full((B,), tokens, jnp.int32),
                jnp.full((B,), rounds, jnp.int32)]
    hist = window(st.hist, round_start, rounds) if st.hist.shape[1] else jnp.zeros((B, rounds), jnp.int32)
    ints = [jnp.stack(counters, axis=1), window(st.tokens, token_start, tokens), hist]
    back = {}
    if st.logprobs is not None:
        ints.append(window(st.logprobs.top_ids, token_start, tokens).reshape(B, -1))
        back["lp"] = jnp.concatenate([window(st.logprobs.chosen, token_start, tokens)[..., None],
                                      window(st.logprobs.top, token_start, tokens)], axis=2)  # [B, W, 1 + k]
    back["ints"] = jnp.concatenate(ints, axis=1).astype(jnp.int32)
    return back


WINDOW_COUNTERS = ("tokens_from", "generated", "reason", "rounds", "rounds_from", "finished", "step")


def unpack_window(back: dict) -> dict:
    """A `readback_window` on the host (numpy) -> its parts by name, as `readback` names
    them (views, no copies): tokens [B, W], hist [B, R], the counters [B] (step: a scalar),
    and with logprobs lp_chosen [B, W], lp_top_ids and lp_top [B, W, k]."""
    ints = back["ints"]
    out = {name: ints[:, i] for i, name in enumerate(WINDOW_COUNTERS)}
    out["finished"] = out["finished"].astype(bool)
    out["step"] = ints[0, 6] if len(ints) else 0
    n = len(WINDOW_COUNTERS) + 2
    W, R = (int(ints[0, 7]), int(ints[0, 8])) if len(ints) else (0, 0)
    out["tokens"], out["hist"] = ints[:, n:n + W], ints[:, n + W:n + W + R]
    if "lp" in back:
        lp = back["lp"]
        out.update(lp_chosen=lp[..., 0], lp_top=lp[..., 1:],
                   lp_top_ids=ints[:, n + W + R:].reshape(len(ints), W, lp.shape[2] - 1))
    return out
