"""A round of the loop, phase by phase, and the loop of rounds (`advance`).

A round is five phases, each a function with typed inputs and outputs (plain decoding is
the round with no proposer and N = 1):

  propose  the proposer drafts a chain or tree of N nodes per row   (`propose_phase`)
  verify   the target over the N nodes under the tree mask         (`verify_phase` -> Verified)
  accept   the accepted path, its length and the bonus token        (`accept_phase` -> Accepted)
  commit   the cache kind commits the path (every round, chains included); tokens are
           emitted, stops and limits checked                        (`commit_phase`)
  observe  the proposer reads the committed tokens                  (`observe_phase`)

Everything is static-shape and stays on device; per-request values are rows of the state
(`jspec.loop.state`), so new values never recompile and rows can be admitted and evicted
between calls (`jspec.loop.rows`). The loop calls only the target-family, cache-kind and
proposer protocols; it never asks which kind it runs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jspec import sampling
from jspec.cache.layout import clear_pages, free_pages, reserve
from jspec.constraints import tables as gt
from jspec.loop import accept, budget, logprobs
from jspec.loop.plan import Plan
from jspec.loop.proposers.base import Observation
from jspec.loop.state import CACHE_FULL, LENGTH, STOP, LoopState
from jspec.loop.tree import Tree, chain_tree
from jspec.util import cdiv


@struct.dataclass
class Verified:
    """The target's pass over a round's N nodes."""

    hidden: jax.Array  # [B, N, D] final-norm hidden states
    aux: dict  # {layer: [B, N, D]} the layer inputs the proposer reads
    logits: jax.Array  # [B, N, V] float32


@struct.dataclass
class Accepted:
    """What a round keeps. in_place (static): the path is nodes 0..accept_len-1, already in
    their slots (a chain)."""

    accept_len: jax.Array  # [B] nodes committed: the root + accepted drafts (>= 1)
    path: jax.Array  # [B, S+1] node index at each depth, valid < accept_len
    path_tokens: jax.Array  # [B, S+1] their tokens
    bonus: jax.Array  # [B] the target's token after the path: the next root
    grammar_after: jax.Array | None = None  # [B, S+1] constraint state after each emitted token (None: none)
    in_place: bool = struct.field(pytree_node=False, default=False)


# --------------------------------------------------------------------------- phases

def reserve_room(plan: Plan, st: LoopState, need_len, active, max_new_pages: int):
    """Room for need_len [B] slots per active row; a row that does not fit ends as
    cache_full -> (state, rows still active)."""
    pages, full = reserve(plan.layout, st.pages, need_len, active, st.request.slot_limit, max_new_pages)
    st = st.replace(pages=pages, finished=st.finished | full, reason=jnp.where(full, CACHE_FULL, st.reason))
    return st, active & ~full


def propose_phase(plan: Plan, tw, pw, st: LoopState, active):
    """The proposer drafts a chain or a tree under the root (plain decoding: the root alone)
    -> (state, tree, the draft's log q [B,S,V] of sampled drafts or None)."""
    if not plan.drafts:  # plain decoding, or a plain tier of a serving engine
        return st, chain_tree(st.root[:, None]), None
    proposal, tree, logq = plan.proposer.propose(plan, tw, pw, st.proposal, st, active)
    return st.replace(proposal=proposal), tree, logq


def verify_phase(plan: Plan, tw, st: LoopState, tree: Tree, active) -> tuple[LoopState, Verified]:
    """The target over the N nodes: node i at position L + depth, seeing the prefix and its
    ancestors (and told its parent and validity); it writes their keys and values at
    slots L + i."""
    B, N = plan.batch, plan.N
    live = jnp.broadcast_to(active[:, None], (B, N))
    meta = plan.layout.meta(st.pages, positions=st.L[:, None] + tree.depth, prefix_len=st.L,
                            local_mask=tree.anc, write_valid=live, parents=tree.parents, node_valid=tree.valid & live)
    hidden, aux, tcache = plan.family.forward(plan.target, tw, tree.tokens, st.tcache, meta, plan.capture,
                                              tuning=plan.tuning)
    logits = plan.family.logits(plan.target, tw, hidden, tuning=plan.tuning)  # [B,N,V]
    return st.replace(tcache=tcache), Verified(hidden=hidden, aux=aux, logits=logits)


def accept_phase(plan: Plan, st: LoopState, tree: Tree, logits, logq) -> Accepted:
    """The target's logits at every node are processed for that node's context (a request's
    stop ids barred before its min_tokens, the penalties); then either the target's own
    choice at every node (its argmax, or a draw for sampled rows) walks the tree, or sampled
    drafts (logq [B,S,V]) are accepted with probability min(1, p/q). Plain decoding is the
    tree of the root alone: its choice is the next token. A row whose request turned
    speculation off keeps the root alone: its bonus is the target's own choice there.
    With constraints (`st.grammar`) each node's logits allow only what its path's state
    allows, so the choices, the accepted path and the bonus follow the constraint (and a
    sampled row draws from the target's masked, renormalised distribution)."""
    req = st.request
    sp = req.sampling
    positions = st.L[:, None] + tree.depth + 1  # the choice at node i is the token at position L + depth_i + 1
    if plan.sampling:
        logits = bar_early_stops(logits, req, positions)
    node_q = None
    if st.grammar is not None:
        node_q = tree.states if tree.states is not None else gt.node_states(
            st.grammar.tables, st.grammar.state, tree.tokens, tree.parents, tree.depth, plan.S)
        logits = gt.mask_logits(st.grammar.tables, node_q, logits)
    acc = accept_masked(plan, st, tree, logits, logq, req, sp, positions)
    if node_q is None:
        return acc
    return acc.replace(grammar_after=states_after(st.grammar.tables, node_q, acc))


def states_after(tables, node_q, acc: "Accepted"):
    """The constraint state after each token a round emits [B, S+1]: emitted[j] (j < m) is
    path node j+1's token, whose state is that node's; emitted[m] is the bonus, after the
    last path node."""
    S1 = acc.path.shape[1]
    path_q = node_q[:, :S1] if acc.in_place else jnp.take_along_axis(node_q, acc.path, axis=1)  # [B, S+1]
    m = acc.accept_len - 1
    last = jnp.take_along_axis(path_q, m[:, None], axis=1)[:, 0]
    bonus_q = gt.next_state(tables, last, acc.bonus)
    shifted = jnp.concatenate([path_q[:, 1:], path_q[:, -1:]], axis=1)
    return jnp.where(jnp.arange(S1)[None, :] == m[:, None], bonus_q[:, None], shifted)


def accept_masked(plan: Plan, st: LoopState, tree: Tree, logits, logq, req, sp, positions) -> "Accepted":
    """`accept_phase` on logits already processed for each node."""
    valid = tree.valid
    if plan.drafts:
        valid = valid & (req.speculative[:, None] | (jnp.arange(plan.N) == 0)[None, :])
    if plan.sample_drafts:
        accept_len, path, bonus = accept.accept_sampled_chain(tree.tokens, logits, logq, sp, st.history, tree.anc,
                                                              st.L, valid)
        own = sampling.choose(True, logits[:, :1], sp, positions[:, :1], st.history)[:, 0]
        return Accepted(accept_len=accept_len, path=path, path_tokens=tree.tokens,
                        bonus=jnp.where(req.speculative, bonus, own), in_place=True)
    choice = sampling.choose(plan.sampling, logits, sp, positions, st.history, tree.tokens, tree.anc)
    if plan.K == 1:  # a chain (or the root alone): the path is 0..S, no gathers along it
        accept_len, path, bonus = accept.accept_chain(tree.tokens, choice, valid)
        return Accepted(accept_len=accept_len, path=path, path_tokens=tree.tokens, bonus=bonus, in_place=True)
    accept_len, path, bonus = accept.accept_tree(tree.replace(valid=valid), choice, plan.S)
    path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)  # [B,S+1]
    return Accepted(accept_len=accept_len, path=path, path_tokens=path_tokens, bonus=bonus)


def bar_early_stops(logits, req, positions):
    """logits [B,N,V] with each row's stop ids at -inf at the nodes whose token (at
    `positions` [B,N]) would be one of its first min_tokens generated tokens."""
    early = positions - req.prompt_len[:, None] < req.min_tokens[:, None]  # [B,N]
    return sampling.bar_tokens(logits, req.stop_ids, early)


def commit_phase(plan: Plan, st: LoopState, acc: Accepted, active, logits=None) -> LoopState:
    """The target's cache kind commits the accepted path (a tree's path moves into place; a
    chain's is already there), the accepted drafts and the bonus are emitted, stops and
    limits end rows, and L moves past the path. logits [B,N,V]: the verification's, whose
    log-probabilities of the emitted tokens are kept (`Plan.token_logprobs`)."""
    B = plan.batch
    kind = plan.family.cache_kind(plan.target)
    st = st.replace(tcache=kind.commit(st.tcache, plan.layout, st.pages, st.L, acc.path, acc.accept_len, active,
                                       acc.in_place, plan.tuning))
    S1 = acc.path.shape[1]
    m = acc.accept_len - 1
    nxt = jnp.concatenate([acc.path_tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(S1)[None, :] == m[:, None], acc.bonus[:, None], nxt)  # [B,S+1], valid <= m
    values = None
    if plan.token_logprobs:  # emitted[j] was chosen at path node j
        at_path = logits[:, :S1] if acc.in_place else jnp.take_along_axis(logits, acc.path[:, :, None], axis=1)
        values = logprobs.of_tokens(at_path, emitted, plan.logprobs)
    complete = None
    if st.grammar is not None:  # a token that completes its constraint ends the row after it
        complete = st.grammar.tables.terminal[acc.grammar_after]
        last = jnp.take_along_axis(acc.grammar_after, m[:, None], axis=1)[:, 0]
        st = st.replace(grammar=st.grammar.replace(state=jnp.where(active, last, st.grammar.state)))
    st = emit(st, emitted, acc.accept_len, active, values, complete=complete)
    if plan.proposer is not None:  # plain decoding accepts one token a round: no histogram to keep
        st = st.replace(hist=st.hist.at[jnp.arange(B), jnp.where(active, st.rounds, plan.max_rounds)].set(
            acc.accept_len, mode="drop"))
    return st.replace(L=jnp.where(active, st.L + acc.accept_len, st.L), root=jnp.where(active, acc.bonus, st.root),
                      rounds=st.rounds + active.astype(jnp.int32))


def observe_phase(plan: Plan, tw, pw, st: LoopState, verified: Verified, acc: Accepted, live) -> LoopState:
    """The proposer reads the committed path (from the old root) and the bonus, with the
    target's pass over the nodes; `live` [B]: rows that go on."""
    obs = Observation(rows=None, start=st.L - acc.accept_len, tokens=acc.path_tokens, count=acc.accept_len,
                      bonus=acc.bonus, L=st.L, hidden=verified.hidden, aux=verified.aux,
                      path=None if acc.in_place else acc.path, live=live, sampling=st.request.sampling,
                      pages=st.pages)
    return st.replace(proposal=plan.proposer.observe(plan, tw, pw, st.proposal, obs))


def emit(st: LoopState, emitted, count, active, values=None, complete=None) -> LoopState:
    """Writes up to `count` [B] of `emitted` [B,E] after the root, stopping at one of the
    row's stop tokens or at its max_new; marks finished rows. values: their
    log-probabilities (`logprobs.of_tokens`), kept beside them. complete [B,E] bool: the
    token completes the row's constraint (a stop, kept as a stop token is). The stop ids and the E
    emitted slots are few and static: unrolled comparisons instead of reductions let XLA
    compute all of this in a few fused kernels."""
    B, E = emitted.shape
    req = st.request
    stop_ids = req.stop_ids  # [B, Ks]
    j = jnp.arange(E)[None, :]
    is_stop = functools.reduce(jnp.logical_or, [emitted == stop_ids[:, k:k + 1] for k in range(stop_ids.shape[1])])
    if complete is not None:
        is_stop = is_stop | complete
    is_stop = is_stop & (j < count[:, None])  # [B, E]
    first_stop = jnp.full((B,), E, jnp.int32)
    for i in reversed(range(E)):
        first_stop = jnp.where(is_stop[:, i], i, first_stop)
    budget = req.max_new - st.generated
    n = jnp.minimum(jnp.minimum(count, first_stop + 1), budget)
    n = jnp.where(active, n, 0)
    pos = jnp.where(j < n[:, None], st.L[:, None] + 1 + j, st.tokens.shape[1])
    tokens = st.tokens.at[jnp.arange(B)[:, None], pos].set(emitted, mode="drop")
    if values is not None:
        st = st.replace(logprobs=logprobs.record(st.logprobs, jnp.arange(B), pos, j < n[:, None], values))
    generated = st.generated + n
    history = sampling.record(st.history, emitted, j < n[:, None])
    hit_stop = active & (first_stop < n)
    at_len = active & (generated >= req.max_new)
    # max_new is cut to the cache's room when that is smaller (room_bound).
    reason = jnp.where(hit_stop, STOP, jnp.where(at_len, jnp.where(req.room_bound, CACHE_FULL, LENGTH), st.reason))
    return st.replace(tokens=tokens, generated=generated, history=history, finished=st.finished | hit_stop | at_len,
                      reason=reason)


def release_pages(plan: Plan, st: LoopState, done) -> LoopState:
    """Returns the pages of rows `done` [B] to the pool (paged layouts; with the host's
    pages, `CacheLayout.host_pages`, their tables are cleared: the host takes them back)."""
    if not plan.layout.paged:
        return st
    return st.replace(pages=(clear_pages if plan.layout.host_pages else free_pages)(st.pages, done))


# --------------------------------------------------------------------------- a round

def round_step(plan: Plan, tw, pw, st: LoopState, reserved: bool = False) -> LoopState:
    """One round: propose, verify, accept, commit, observe; with `SpecConfig.verify_lengths`
    the rest of the round after propose is one branch a chain length, the length chosen on
    device (`jspec.loop.budget`). reserved: the room of this round was reserved before it
    (`advance_rounds`)."""
    active = ~st.finished
    if not reserved:
        st, active = reserve_room(plan, st, st.L + plan.slack, active,
                                  cdiv(plan.slack, max(plan.layout.page_size, 1)) + 1)
    with jax.named_scope("draft"):  # the scopes name each phase's kernels in profiles
        st, tree, logq = propose_phase(plan, tw, pw, st, active)
    if plan.drafts and plan.spec.verify_lengths:  # confidence-budgeted: one branch a length
        with jax.named_scope("budget"):
            pick = budget.choose(tree.survival, active, active & st.request.speculative, plan.spec)

        def verify_first(length):
            return lambda s: finish_round(plan.verifying(length), tw, pw, s, *budget.truncated(tree, logq, length),
                                          active)
        return jax.lax.switch(pick, [verify_first(n) for n in plan.spec.verify_choices], st)
    return finish_round(plan, tw, pw, st, tree, logq, active)


def finish_round(plan: Plan, tw, pw, st: LoopState, tree: Tree, logq, active) -> LoopState:
    """The rest of a round once its drafts exist: verify, accept, commit, observe."""
    with jax.named_scope("verify"):
        st, verified = verify_phase(plan, tw, st, tree, active)
    with jax.named_scope("accept"):
        acc = accept_phase(plan, st, tree, verified.logits, logq)
    with jax.named_scope("commit"):
        st = commit_phase(plan, st, acc, active, verified.logits)
    newly_done = active & st.finished
    if plan.proposer is not None:
        with jax.named_scope("extend"):
            st = observe_phase(plan, tw, pw, st, verified, acc, active & ~st.finished)
    return release_pages(plan, st, newly_done).replace(step=st.step + 1)


def advance(plan: Plan, tw, pw, st: LoopState, until) -> LoopState:
    """Rounds until every row has finished or the loop's step count reaches `until` (a
    traced int32)."""
    return jax.lax.while_loop(lambda s: jnp.any(~s.finished) & (s.step < until),
                              lambda s: round_step(plan, tw, pw, s), st)


def advance_rounds(plan: Plan, tw, pw, st: LoopState, rounds: int) -> LoopState:
    """Exactly `rounds` rounds (a static count; rows that finish idle), the room of all of
    them reserved first: min(L + rounds x slack, the row's slot limit), a round advancing
    L by at most `plan.slack`. XLA runs a while loop of known trip count without reading
    its predicate, so the host reads no predicate at all (with a pool that cannot run dry;
    else one, the page allocation's retry loop in `reserve`, before the rounds) instead of
    one or more a round: the call returns once the rounds are enqueued (the serving
    engine's chunks)."""
    need = jnp.minimum(st.L + rounds * plan.slack, st.request.slot_limit)
    st, _ = reserve_room(plan, st, need, ~st.finished, cdiv(rounds * plan.slack, max(plan.layout.page_size, 1)) + 1)
    return jax.lax.fori_loop(0, rounds, lambda _, s: round_step(plan, tw, pw, s, reserved=True), st)

