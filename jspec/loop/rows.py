"""Requests join and leave a running batch: `admit` puts requests into free rows and
prefills only those rows (long prompts in blocks: `prefill`); `evict` frees rows,
returning their pages.

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
from jspec.constraints import tables as gt
from jspec.loop import logprobs
from jspec.loop.plan import Plan
from jspec.loop.proposers.base import Observation
from jspec.loop.round import bar_early_stops, emit, release_pages, reserve_room
from jspec.loop.state import RUNNING, Admission, LoopState


def row_mask(batch: int, rows) -> jax.Array:
    """[batch] bool: the rows named in `rows` [A] (indices >= batch name no row)."""
    return jnp.zeros((batch,), bool).at[rows].set(True, mode="drop")


def admit(plan: Plan, tw, pw, st: LoopState, rows, adm: Admission, stop=None) -> LoopState:
    """Puts the A requests of `adm` into rows `rows` [A] (an index >= B: no request, a
    padding entry; each named row's old pages are returned first), reserves the room of
    their whole prompts and prefills them: the target over their prompts, the first token
    chosen and emitted, the proposer's view of the prompt. A request that finds no room
    ends at once as cache_full.

    With `plan.prefill_chunk` = C > 0 this pass takes the prompts' first C tokens; a row
    whose prompt is longer waits, parked (finished, reason RUNNING, holding its pages),
    for `prefill` to take the rest C tokens at a time, between rounds of the others.
    stop [A] (None: none): the slot each row's pass stops at, before its block's end (see
    `prompt_pass`)."""
    st, live = setup(plan, st, rows, adm)
    C = plan.prefill_chunk or adm.prompt.shape[1]
    return prompt_pass(plan, tw, pw, st, rows, jnp.zeros(rows.shape, jnp.int32), adm.prompt[:, :C], live, first=True,
                       stop=stop)


def admit_cached(plan: Plan, tw, pw, st: LoopState, rows, adm: Admission) -> LoopState:
    """`admit` of requests whose prompts begin with a prefix already in their rows' pages
    (a shared prefix: the host set those pages, `CacheLayout.host_pages`): the rows are set
    up and parked with no pass; `prefill` takes their prompts from the first slot past the
    prefix. tw, pw: unused (one signature for the admission programs)."""
    del tw, pw
    st, live = setup(plan, st, rows, adm)
    return st.replace(finished=st.finished | row_mask(plan.batch, jnp.where(live, rows, plan.batch)))


def setup(plan: Plan, st: LoopState, rows, adm: Admission) -> tuple[LoopState, jax.Array]:
    """The rows of an admission (see `admit`) set up for their requests, their prompts'
    room reserved -> (state, live [A]: admitted rows with room)."""
    B, V = plan.batch, plan.target.vocab_size
    A, T = adm.prompt.shape  # T <= Tp: an admission of short prompts may pass fewer columns
    req = adm.request
    lens = req.prompt_len  # [A]
    mask = row_mask(B, rows)

    def put(old, new):
        return old.at[rows].set(new.astype(old.dtype), mode="drop")

    if not plan.layout.host_pages:  # the host set the rows' pages (evicted rows hold none)
        st = release_pages(plan, st, mask)
    in_prompt = sampling.init_history(adm.prompt, lens, V).in_prompt  # [A, V]
    # A resumed request's output so far (the prompt's last `resumed` tokens) counts as generated.
    j = jnp.arange(T, dtype=jnp.int32)[None, :]
    outputs = (j >= lens[:, None] - req.resumed[:, None]) & (j < lens[:, None])
    counts = sampling.record(sampling.History(in_prompt=in_prompt, counts=jnp.zeros((A, V), jnp.int32)),
                             adm.prompt, outputs).counts
    st = st.replace(
        tokens=put(st.tokens, jnp.pad(adm.prompt, ((0, 0), (0, plan.buffer_len - T)))),
        L=put(st.L, lens - 1),  # emit writes the first token after L
        generated=put(st.generated, jnp.zeros((A,), jnp.int32)), finished=st.finished & ~mask,
        reason=jnp.where(mask, RUNNING, st.reason), request=jax.tree.map(put, st.request, req),
        history=sampling.History(in_prompt=put(st.history.in_prompt, in_prompt),
                                 counts=put(st.history.counts, counts)),
        rounds=put(st.rounds, jnp.zeros((A,), jnp.int32)),
        hist=put(st.hist, jnp.zeros((A,) + st.hist.shape[1:], jnp.int32)))
    if st.grammar is not None:  # the rows' constraint states (and the admission's tables, if it brings them)
        tables = st.grammar.tables if adm.grammar is None else adm.grammar
        st = st.replace(grammar=st.grammar.replace(tables=tables, state=put(st.grammar.state, req.grammar_start)))
    st, active = reserve_room(plan, st, st.request.prompt_len + plan.slack, mask, plan.layout.pages_per_seq)
    return st, active[jnp.minimum(rows, B - 1)] & (rows < B)


def prefill(plan: Plan, tw, pw, st: LoopState, rows, start, stop=None) -> LoopState:
    """The next C = `plan.prefill_chunk` prompt tokens of parked rows `rows` [A] (see
    `admit`), from slot `start` [A] on (below the prompt's length): the
    target attends to the slots before `start` in its cache and to the block causally;
    rows whose prompt ends in this block choose their first token and run; stop [A] (None:
    none): the slot each row's pass stops at, before its block's end (see `prompt_pass`).
    A dense cache is read by batch position: there rows[a] must be a (or >= B, no row), as
    `prefill_rest` passes them."""
    if not plan.prefill_chunk:
        raise ValueError("prefill in chunks needs Plan.prefill_chunk > 0")
    B, C = plan.batch, plan.prefill_chunk
    at = jnp.minimum(start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :], st.tokens.shape[1] - 1)
    tokens = jnp.take_along_axis(st.tokens[jnp.minimum(rows, B - 1)], at, axis=1)  # [A, C] (past the prompt: unused)
    live = (rows < B) & (st.reason[jnp.minimum(rows, B - 1)] == RUNNING)
    return prompt_pass(plan, tw, pw, st, rows, start, tokens, live, first=False, stop=stop)


def prefill_rest(plan: Plan, tw, pw, st: LoopState, rows) -> LoopState:
    """After `admit` of rows [A] (as `jspec.loop.programs.run` admits them: rows[a] = a, or
    B for no row), their prompts' later blocks, C = `plan.prefill_chunk` tokens a pass, in a
    loop whose trip count is the longest prompt's blocks: one program for every prompt
    length up to Tp, activations bounded by the block."""
    B, C = plan.batch, plan.prefill_chunk
    lens = st.request.prompt_len[jnp.minimum(rows, B - 1)]  # [A]
    admitted = rows < B
    blocks = (jnp.max(jnp.where(admitted, lens, 0)) + C - 1) // C

    def block(k, st):
        start = jnp.full(rows.shape, k * C, jnp.int32)
        return prefill(plan, tw, pw, st, jnp.where(admitted & (start < lens), rows, B), start)
    return jax.lax.fori_loop(1, blocks, block, st)


def prompt_pass(plan: Plan, tw, pw, st: LoopState, rows, start, tokens, live, first: bool, stop=None) -> LoopState:
    """One pass of admitted rows `rows` [A] over their prompt tokens [A, C] from slot
    `start` [A] (live [A]: rows with room). first (static): the prompts' first block (no
    prefix: prefill attention, recurrent states from zero). Rows whose prompt ends in the
    block get their first token (position = prompt length) and run; the others are parked.
    stop [A] (None: none): a row's pass ends at this slot where it lies inside the block
    before the prompt's end, the row parked there (its caches and states hold the prompt
    up to it: a hybrid's state at a page boundary, saved for prefix caching)."""
    B, V = plan.batch, plan.target.vocab_size
    A, C = tokens.shape

    def take(a):  # [B, ...] -> the rows' [A, ...] (padding entries: the last row's)
        return a[jnp.minimum(rows, B - 1)]

    def put(old, new):
        return old.at[rows].set(new.astype(old.dtype), mode="drop")

    req = jax.tree.map(take, st.request)
    lens = req.prompt_len  # [A]
    end = lens if stop is None else jnp.minimum(lens, stop)  # [A] where this pass stops
    count = jnp.clip(end - start, 0, C)  # this block's prompt tokens
    ends = live & (start + count >= lens)  # [A] the prompt ends in this block
    ar = jnp.arange(C, dtype=jnp.int32)[None, :]
    meta = plan.layout.meta(st.pages, positions=start[:, None] + ar, prefix_len=start,
                            local_mask=causal_mask(count, C), write_valid=(ar < count[:, None]) & live[:, None],
                            prefill=first, rows=rows)
    # The loop reserves room for a round's parked queries, not for a block's; the block is causal.
    meta = meta.replace(q_room=False, causal_block=True)
    # A prompt's blocks need not be row-invariant (plain and speculative programs share them):
    # its products stay XLA's, which tile a long block far better than the row kernels.
    hidden, aux, tcache = plan.family.forward(plan.target, tw, tokens, st.tcache, meta, plan.capture,
                                              tuning=plan.tuning.replace(row_invariant=False))
    last = jnp.take_along_axis(hidden, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = plan.family.logits(plan.target, tw, last, tuning=plan.tuning)[:, None]  # [A, 1, V]
    history = sampling.History(in_prompt=take(st.history.in_prompt), counts=take(st.history.counts))
    processed = bar_early_stops(logits, req, lens[:, None]) if plan.sampling else logits
    if st.grammar is not None:  # the first token as the row's constraint allows
        processed = gt.mask_logits(st.grammar.tables, take(st.grammar.state)[:, None], processed)
    first_token = sampling.choose(plan.sampling, processed, req.sampling, lens[:, None], history)[:, 0]  # position len
    following = jnp.take_along_axis(take(st.tokens), jnp.minimum(start + count, st.tokens.shape[1] - 1)[:, None],
                                    axis=1)[:, 0]  # the next prompt token of a parked row
    if plan.logprobs:
        lp = st.logprobs
        if plan.prompt_logprobs:  # each block token's logits score the prompt token after it
            after = jnp.concatenate([tokens[:, 1:], following[:, None]], axis=1)  # [A, C]
            valid = live[:, None] & (ar < count[:, None]) & (start[:, None] + ar + 1 < lens[:, None])
            lp = logprobs.record(lp, rows, start[:, None] + ar + 1, valid,
                                 prompt_logprobs(plan, tw, hidden, after))
        values = logprobs.of_tokens(logits[:, 0], first_token, plan.logprobs)  # the first token's, always
        lp = logprobs.record(lp, rows, lens[:, None], (live & ends)[:, None], jax.tree.map(lambda a: a[:, None],
                                                                                           values))
        st = st.replace(logprobs=lp)
    starting = row_mask(B, jnp.where(ends, rows, B))  # [B] rows that run from now
    parked = row_mask(B, jnp.where(live & ~ends, rows, B))
    st = st.replace(tcache=tcache, finished=(st.finished & ~starting) | parked)
    complete = None
    if st.grammar is not None:
        after = gt.next_state(st.grammar.tables, take(st.grammar.state), first_token)  # [A]
        complete = put(jnp.zeros((B,), bool), st.grammar.tables.terminal[after])[:, None]
        st = st.replace(grammar=st.grammar.replace(state=jnp.where(starting, put(st.grammar.state, after),
                                                                   st.grammar.state)))
    st = emit(st, put(jnp.zeros((B,), jnp.int32), first_token)[:, None], jnp.ones((B,), jnp.int32), starting,
              complete=complete)
    st = st.replace(L=jnp.where(starting, put(st.L, lens), st.L), root=jnp.where(starting, put(st.root, first_token),
                                                                                  st.root))
    if plan.proposer is not None:
        obs = Observation(rows=rows, start=start, tokens=tokens, count=count,
                          bonus=jnp.where(ends, first_token, following), L=start + count, hidden=hidden, aux=aux,
                          path=None, live=live & (~ends | ~take(st.finished)), sampling=req.sampling,
                          pages=st.pages, prefill=first)
        st = st.replace(proposal=plan.proposer.observe(plan, tw, pw, st.proposal, obs))
    return release_pages(plan, st, starting & st.finished)


def prompt_logprobs(plan: Plan, tw, hidden, after):
    """The log-probabilities (`logprobs.of_tokens`) of tokens `after` [A, C] at the
    positions whose final hidden states are `hidden` [A, C, D]: the logits of a few
    positions at a time, so that a block over a large vocabulary holds at most about 2**26
    of them."""
    A, C, _ = hidden.shape
    group = C
    while group > 1 and A * group * plan.target.vocab_size > 2 ** 26 and group % 2 == 0:
        group //= 2
    parts = []
    for g in range(0, C, group):
        logits = plan.family.logits(plan.target, tw, hidden[:, g:g + group], tuning=plan.tuning)  # [A, group, V]
        parts.append(logprobs.of_tokens(logits, after[:, g:g + group], plan.logprobs))
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=1), *parts)


def evict(plan: Plan, st: LoopState, rows) -> LoopState:
    """Frees rows `rows` [A] (indices >= B: none): their pages back to the pool, the rows
    finished and reset. Rows that finished already hold no pages; evicting them resets them."""
    mask = row_mask(plan.batch, rows)
    st = release_pages(plan, st, mask)
    zero = lambda a: jnp.where(mask, 0, a)  # noqa: E731
    return st.replace(finished=st.finished | mask, reason=zero(st.reason), L=zero(st.L),
                      generated=zero(st.generated), rounds=zero(st.rounds))
