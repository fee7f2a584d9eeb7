"""The whole generation as one jitted function: prefill, then a `lax.while_loop` of rounds.

A round is five phases, each a function with typed inputs and outputs (plain decoding is
the round with no draft and N = 1):

  draft   S draft steps -> a chain or tree of N nodes        (`draft_phase`)
  verify  the target over the N nodes under the tree mask    (`verify_phase` -> Verified)
  accept  the accepted path, its length and the bonus token  (`accept_phase` -> Accepted)
  commit  the cache kind commits the path; tokens are emitted, stops and limits checked
                                                             (`commit_phase`)
  extend  the draft reads the committed tokens -> the next round's first level
                                                             (`extend_phase`)

Everything is static-shape and stays on device; per-request values (`LoopInputs`) are
arrays, so new values never recompile. The loop calls only the target-family, cache-kind
and draft protocols; it never asks which kind it runs.

Per request b the loop keeps L[b]: slots 0..L-1 of the target cache hold committed tokens
and tokens[b, L] is the root, the newest token, not yet in the target cache.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jspec import sampling
from jspec.cache.layout import PageState, causal_mask, free_pages, reserve
from jspec.loop import accept
from jspec.loop.plan import LoopInputs, Plan
from jspec.loop.propose import first_level, propose_chain, propose_tree
from jspec.loop.tree import Tree, chain_tree
from jspec.util import cdiv

RUNNING, STOP, LENGTH, CACHE_FULL = 0, 1, 2, 3
FINISH_REASONS = {RUNNING: None, STOP: "stop", LENGTH: "length", CACHE_FULL: "cache_full"}


@struct.dataclass
class LoopState:
    tokens: jax.Array  # [B, buffer_len] prompt + generated; tokens[b, L[b]] is the root
    root: jax.Array  # [B] the root, kept apart so a round needs no gather from tokens
    L: jax.Array  # [B] committed target slots
    generated: jax.Array  # [B] tokens emitted
    finished: jax.Array  # [B] bool
    reason: jax.Array  # [B] int32 (RUNNING, STOP, LENGTH, CACHE_FULL)
    tcache: object  # the target's cache (its family's cache kind)
    dcache: object  # the draft's cache, or None
    pages: PageState | None  # the page table both caches share (paged layouts)
    history: sampling.History  # what the penalties read: prompt tokens, generated counts [B, V]
    first_tokens: jax.Array  # [B, K] the root's children drafted by the last extend (target ids)
    first_probs: jax.Array  # [B, K] their draft probabilities
    first_logq: jax.Array  # [B, V] the draft's log q of the first's draw (sampled drafts; else [B, 0])
    draft_hidden: jax.Array  # [B, Dd] the draft hidden that produced them
    rounds: jax.Array  # [B] verify rounds run
    hist: jax.Array  # [B, R] accept length per round ([B, 0] without a draft: always 1)
    step: jax.Array  # [] rounds of the loop


@struct.dataclass
class Verified:
    """The target's pass over a round's N nodes."""

    hidden: jax.Array  # [B, N, D] final-norm hidden states
    aux: dict  # {layer: [B, N, D]} the layer inputs the draft reads
    logits: jax.Array  # [B, N, V] float32


@struct.dataclass
class Accepted:
    """What a round keeps."""

    accept_len: jax.Array  # [B] nodes committed: the root + accepted drafts (>= 1)
    path: jax.Array  # [B, S+1] node index at each depth, valid < accept_len
    path_tokens: jax.Array  # [B, S+1] their tokens
    bonus: jax.Array  # [B] the target's token after the path: the next root


# --------------------------------------------------------------------------- phases

def reserve_room(plan: Plan, inp: LoopInputs, st: LoopState, need_len, active, max_new_pages: int):
    """Room for need_len [B] slots per active row; a row that does not fit ends as
    cache_full -> (state, rows still active)."""
    pages, full = reserve(plan.layout, st.pages, need_len, active, inp.slot_limit, max_new_pages)
    st = st.replace(pages=pages, finished=st.finished | full, reason=jnp.where(full, CACHE_FULL, st.reason))
    return st, active & ~full


def draft_phase(plan: Plan, tw, dw, inp: LoopInputs, st: LoopState, active):
    """The draft proposes a chain or a tree under the root (plain decoding: the root alone)
    -> (state, tree, the draft's log q [B,S,V] of sampled drafts or None)."""
    if plan.draft is None:
        return st, chain_tree(st.root[:, None]), None
    logq = None
    if plan.K == 1:
        dcache, tree, logq = propose_chain(plan, tw, dw, st.pages, st.dcache, st.first_tokens, st.first_logq,
                                           st.draft_hidden, st.L, st.root, active, inp.sampling)
    else:
        dcache, tree = propose_tree(plan, tw, dw, st.pages, st.dcache, st.first_tokens, st.first_probs,
                                    st.draft_hidden, st.L, st.root, active)
    return st.replace(dcache=dcache), tree, logq


def verify_phase(plan: Plan, tw, st: LoopState, tree: Tree, active) -> tuple[LoopState, Verified]:
    """The target over the N nodes: node i at position L + depth, seeing the prefix and its
    ancestors; it writes their keys and values at slots L + i."""
    B, N = plan.batch, plan.N
    meta = plan.layout.meta(st.pages, positions=st.L[:, None] + tree.depth, prefix_len=st.L,
                            local_mask=tree.anc, write_valid=jnp.broadcast_to(active[:, None], (B, N)))
    capture = plan.draft.target_layers if plan.draft else ()
    hidden, aux, tcache = plan.family.forward(plan.target, tw, tree.tokens, st.tcache, meta, capture)
    logits = plan.family.logits(plan.target, tw, hidden)  # [B,N,V]
    return st.replace(tcache=tcache), Verified(hidden=hidden, aux=aux, logits=logits)


def accept_phase(plan: Plan, inp: LoopInputs, st: LoopState, tree: Tree, logits, logq) -> Accepted:
    """The target's logits at every node are penalised for that node's context; then either
    the target's own choice at every node (its argmax, or a draw for sampled rows) walks the
    tree, or sampled drafts (logq [B,S,V]) are accepted with probability min(1, p/q).
    Plain decoding is the tree of the root alone: its choice is the next token."""
    sp = inp.sampling
    if plan.sample_drafts:
        accept_len, path, bonus = accept.accept_sampled_chain(tree.tokens, logits, logq, sp, st.history, tree.anc,
                                                              st.L)
        return Accepted(accept_len=accept_len, path=path, path_tokens=tree.tokens, bonus=bonus)
    # The choice at node i is the token at position L + depth_i + 1.
    choice = sampling.choose(plan.sampling, logits, sp, st.L[:, None] + tree.depth + 1, st.history, tree.tokens,
                             tree.anc)
    if plan.K == 1:  # a chain (or the root alone): the path is 0..S, no gathers along it
        accept_len, path, bonus = accept.accept_chain(tree.tokens, choice)
        path_tokens = tree.tokens
    else:
        accept_len, path, bonus = accept.accept_tree(tree, choice, plan.S)
        path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)  # [B,S+1]
    return Accepted(accept_len=accept_len, path=path, path_tokens=path_tokens, bonus=bonus)


def commit_phase(plan: Plan, inp: LoopInputs, st: LoopState, acc: Accepted, active) -> LoopState:
    """The target's cache kind commits the accepted path (a tree's path moves into place;
    a chain's is already there), the accepted drafts and the bonus are emitted, stops and
    limits end rows, and L moves past the path."""
    B = plan.batch
    if plan.draft is not None and plan.K > 1:
        kind = plan.family.cache_kind(plan.target)
        st = st.replace(tcache=kind.commit(st.tcache, plan.layout, st.pages, st.L, acc.path, acc.accept_len,
                                           active))
    S1 = acc.path.shape[1]
    m = acc.accept_len - 1
    nxt = jnp.concatenate([acc.path_tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(S1)[None, :] == m[:, None], acc.bonus[:, None], nxt)  # [B,S+1], valid <= m
    st = emit(plan, inp, st, emitted, acc.accept_len, active)
    if plan.draft is not None:  # plain decoding accepts one token a round: no histogram to keep
        st = st.replace(hist=st.hist.at[jnp.arange(B), jnp.where(active, st.rounds, plan.max_rounds)].set(
            acc.accept_len, mode="drop"))
    return st.replace(L=jnp.where(active, st.L + acc.accept_len, st.L), root=jnp.where(active, acc.bonus, st.root),
                      rounds=st.rounds + active.astype(jnp.int32))


def extend_phase(plan: Plan, tw, dw, inp: LoopInputs, st: LoopState, start, path_tokens, feats, n_path, bonus,
                 live, prefill: bool = False) -> LoopState:
    """Feeds the newly committed tokens (and the bonus) to the draft, with the target's
    features along the path; keeps the next round's first level for `live` rows.

    start [B]: first draft slot; path_tokens [B,T'] with n_path [B] valid; feats
    [B,T',F] or None (`Draft.target_features` along the path)."""
    d = plan.draft
    ext = _extend_tokens(path_tokens, n_path, bonus, plan.lag)  # [B, T]
    B, T = ext.shape
    if feats is not None and feats.shape[1] < T:
        feats = jnp.pad(feats, ((0, 0), (0, T - feats.shape[1]), (0, 0)))
    count = n_path + plan.lag
    valid = jnp.arange(T, dtype=jnp.int32)[None, :] < count[:, None]
    meta = plan.layout.meta(st.pages, positions=start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :],
                            prefix_len=start, local_mask=causal_mask(count, T), write_valid=valid & live[:, None],
                            prefill=prefill)
    hidden, dcache = d.forward(plan.target, tw, dw, ext, feats, st.dcache, meta, True)
    last = jnp.take_along_axis(hidden, (count - 1)[:, None, None], axis=1)[:, 0]  # [B, Dd]
    # The root is at L (already moved past the path): the first draft is the token at L + 1.
    tokens, probs, logq = first_level(plan, dw, d.logits(plan.target, tw, dw, last), inp.sampling, st.L + 1)
    keep = live[:, None]
    return st.replace(dcache=dcache, first_tokens=jnp.where(keep, tokens, st.first_tokens),
                      first_probs=jnp.where(keep, probs, st.first_probs),
                      first_logq=jnp.where(keep, logq, st.first_logq),
                      draft_hidden=jnp.where(keep, last.astype(st.draft_hidden.dtype), st.draft_hidden))


def _extend_tokens(path_tokens, n_path, bonus, lag: int):
    """Draft-extend inputs: an EAGLE head's slot d takes token d+1 (lag 0); a standalone
    draft's slot d takes token d (lag 1). The bonus follows the n_path path tokens."""
    B, P = path_tokens.shape
    if lag == 0:
        shifted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), path_tokens.dtype)], axis=1)
    else:
        shifted = jnp.concatenate([path_tokens, jnp.zeros((B, 1), path_tokens.dtype)], axis=1)
    idx = jnp.arange(shifted.shape[1])[None, :]
    at = (n_path - 1 + lag)[:, None]
    return jnp.where(idx == at, bonus[:, None], jnp.where(idx < at, shifted, 0)).astype(jnp.int32)


def emit(plan: Plan, inp: LoopInputs, st: LoopState, emitted, count, active) -> LoopState:
    """Writes up to `count` [B] of `emitted` [B,E] after the root, stopping at a stop token
    or the request's max_new; marks finished rows. The stop ids and the E emitted slots
    are few and static: unrolled comparisons instead of reductions let XLA compute all
    of this in a few fused kernels."""
    B, E = emitted.shape
    stop_ids = inp.stop_ids
    j = jnp.arange(E)[None, :]
    is_stop = functools.reduce(jnp.logical_or, [emitted == stop_ids[k] for k in range(stop_ids.shape[0])])
    is_stop = is_stop & (j < count[:, None])  # [B, E]
    first_stop = jnp.full((B,), E, jnp.int32)
    for i in reversed(range(E)):
        first_stop = jnp.where(is_stop[:, i], i, first_stop)
    budget = inp.max_new - st.generated
    n = jnp.minimum(jnp.minimum(count, first_stop + 1), budget)
    n = jnp.where(active, n, 0)
    pos = jnp.where(j < n[:, None], st.L[:, None] + 1 + j, st.tokens.shape[1])
    tokens = st.tokens.at[jnp.arange(B)[:, None], pos].set(emitted, mode="drop")
    generated = st.generated + n
    history = sampling.record(st.history, emitted, j < n[:, None])
    hit_stop = active & (first_stop < n)
    at_len = active & (generated >= inp.max_new)
    # max_new is cut to the cache's room when that is smaller (inp.room_bound).
    reason = jnp.where(hit_stop, STOP, jnp.where(at_len, jnp.where(inp.room_bound, CACHE_FULL, LENGTH),
                                                 st.reason))
    return st.replace(tokens=tokens, generated=generated, history=history, finished=st.finished | hit_stop | at_len,
                      reason=reason)


def release_pages(plan: Plan, st: LoopState, done) -> LoopState:
    """Returns the pages of rows `done` [B] to the pool (paged layouts)."""
    return st.replace(pages=free_pages(st.pages, done)) if plan.layout.paged else st


# --------------------------------------------------------------------------- a round

def round_step(plan: Plan, tw, dw, inp: LoopInputs, st: LoopState) -> LoopState:
    """One round: draft, verify, accept, commit, extend."""
    active = ~st.finished
    st, active = reserve_room(plan, inp, st, st.L + plan.slack, active,
                              cdiv(plan.slack, max(plan.layout.page_size, 1)) + 1)
    with jax.named_scope("draft"):  # the scopes name each phase's kernels in profiles
        st, tree, logq = draft_phase(plan, tw, dw, inp, st, active)
    with jax.named_scope("verify"):
        st, verified = verify_phase(plan, tw, st, tree, active)
    with jax.named_scope("accept"):
        acc = accept_phase(plan, inp, st, tree, verified.logits, logq)
    with jax.named_scope("commit"):
        st = commit_phase(plan, inp, st, acc, active)
    newly_done = active & st.finished
    if plan.draft is not None:
        with jax.named_scope("extend"):
            feats = plan.draft.target_features(verified.hidden, verified.aux)
            if feats is not None and plan.K > 1:
                feats = jnp.take_along_axis(feats, acc.path[:, :, None], axis=1)
            st = extend_phase(plan, tw, dw, inp, st, st.L - acc.accept_len, acc.path_tokens, feats, acc.accept_len,
                              acc.bonus, active & ~st.finished)
    return release_pages(plan, st, newly_done).replace(step=st.step + 1)


# --------------------------------------------------------------------------- prefill

def prefill(plan: Plan, tw, dw, inp: LoopInputs, st: LoopState) -> LoopState:
    """The target over the prompts, the first token, and the draft's first extend."""
    B, T = plan.batch, plan.prompt_len
    lens = inp.prompt_len
    active = ~st.finished
    st, active = reserve_room(plan, inp, st, lens + plan.slack, active, plan.layout.pages_per_seq)
    ar = jnp.arange(T, dtype=jnp.int32)[None, :]
    meta = plan.layout.meta(st.pages, positions=jnp.broadcast_to(ar, (B, T)), prefix_len=jnp.zeros_like(lens),
                            local_mask=causal_mask(lens, T), write_valid=(ar < lens[:, None]) & active[:, None],
                            prefill=True)
    capture = plan.draft.target_layers if plan.draft else ()
    hidden, aux, tcache = plan.family.forward(plan.target, tw, inp.prompt, st.tcache, meta, capture)
    last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
    logits = plan.family.logits(plan.target, tw, last)[:, None]
    first = sampling.choose(plan.sampling, logits, inp.sampling, lens[:, None], st.history)[:, 0]  # the token at position len
    st = st.replace(tcache=tcache, tokens=st.tokens.at[:, :T].set(inp.prompt), L=lens - 1)  # emit writes after L
    st = emit(plan, inp, st, first[:, None], jnp.ones((B,), jnp.int32), active)
    st = st.replace(L=lens, root=first)
    if plan.draft is not None:
        feats = plan.draft.target_features(hidden, aux)
        st = extend_phase(plan, tw, dw, inp, st, jnp.zeros_like(lens), inp.prompt, feats, lens, first,
                          active & ~st.finished, prefill=True)
    return release_pages(plan, st, active & st.finished)


# --------------------------------------------------------------------------- entry

def init_state(plan: Plan, inp: LoopInputs) -> LoopState:
    B = plan.batch
    tcache = plan.family.cache_kind(plan.target).init(plan.layout, B)
    dcache = plan.draft.cache_kind().init(plan.layout, B) if plan.draft else None
    Dd = plan.draft.hidden_size if plan.draft else 1
    V = plan.target.vocab_size
    return LoopState(
        tokens=jnp.zeros((B, plan.buffer_len), jnp.int32), root=jnp.zeros((B,), jnp.int32),
        L=jnp.zeros((B,), jnp.int32), generated=jnp.zeros((B,), jnp.int32), finished=~inp.real,
        reason=jnp.zeros((B,), jnp.int32), tcache=tcache, dcache=dcache, pages=plan.layout.init_pages(B),
        history=sampling.init_history(inp.prompt, inp.prompt_len, V),
        first_tokens=jnp.zeros((B, plan.K), jnp.int32), first_probs=jnp.zeros((B, plan.K), jnp.float32),
        first_logq=jnp.zeros((B, V if plan.sample_drafts else 0), jnp.float32),
        draft_hidden=jnp.zeros((B, Dd), jnp.dtype(plan.target.dtype)), rounds=jnp.zeros((B,), jnp.int32),
        hist=jnp.zeros((B, plan.max_rounds if plan.draft else 0), jnp.int32), step=jnp.int32(0))


def start(plan: Plan, tw, dw, inp: LoopInputs) -> LoopState:
    """A fresh state, prefilled: the first token of every request is emitted."""
    return prefill(plan, tw, dw, inp, init_state(plan, inp))


def advance(plan: Plan, tw, dw, inp: LoopInputs, st: LoopState, until) -> LoopState:
    """Rounds until every request has finished or `until` (a traced int32) rounds have run."""
    until = jnp.minimum(until, plan.max_rounds)
    return jax.lax.while_loop(lambda s: jnp.any(~s.finished) & (s.step < until),
                              lambda s: round_step(plan, tw, dw, inp, s), st)


def run(plan: Plan, tw, dw, inp: LoopInputs) -> LoopState:
    """Prefill and the loop of rounds -> the final state."""
    return advance(plan, tw, dw, inp, start(plan, tw, dw, inp), plan.max_rounds)


def generate_fn(plan: Plan, tw, dw, inp: LoopInputs):
    """run, returning only what the API reads back."""
    return readback(run(plan, tw, dw, inp))


def readback(st: LoopState) -> dict:
    """What the API reads back from a state."""
    return dict(tokens=st.tokens, generated=st.generated, reason=st.reason, rounds=st.rounds, hist=st.hist,
                finished=st.finished, step=st.step)


def start_fn(plan: Plan, tw, dw, inp: LoopInputs):
    """`start`, returning the state and what the API reads back."""
    st = start(plan, tw, dw, inp)
    return st, readback(st)


def advance_fn(plan: Plan, tw, dw, inp: LoopInputs, st: LoopState, until):
    """`advance`, returning the state and what the API reads back."""
    st = advance(plan, tw, dw, inp, st, until)
    return st, readback(st)


generate_jit = jax.jit(generate_fn, static_argnums=0)
# Streaming (`jspec.stream`) runs the same rounds in bounded chunks, the state (caches
# included) carried from call to call and donated, so each chunk updates it in place.
start_jit = jax.jit(start_fn, static_argnums=0)
advance_jit = jax.jit(advance_fn, static_argnums=0, donate_argnums=4)
