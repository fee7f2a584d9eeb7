"""The whole generation as one jitted function: prefill, then a `lax.while_loop` of rounds.

A round (plain decoding is the round with no draft and N = 1):
  draft (chain or tree) -> verify the N nodes with the target -> accept -> commit
  (move the accepted path's KV into place, emit tokens, check stops) -> draft-extend.
Everything is static-shape and stays on device; per-request values (lengths, limits,
sampling parameters, seeds, stop ids) are arrays, so new values never recompile.

Per request b the loop keeps L[b]: slots 0..L-1 of the target cache hold committed tokens
and tokens[b, L] is the root, the newest token, not yet in the target cache.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from jspec import drafts, sampling
from jspec.cache import kv as kvc
from jspec.config import DraftConfig, ModelConfig, SpecConfig
from jspec.models import target as tgt
from jspec.spec import verify
from jspec.spec.tree import Tree, chain_tree, select_tree, vocab_top_k

RUNNING, STOP, LENGTH, CACHE_FULL = 0, 1, 2, 3
FINISH_REASONS = {RUNNING: None, STOP: "stop", LENGTH: "length", CACHE_FULL: "cache_full"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one compiled generation."""

    target: ModelConfig
    draft: DraftConfig | None
    spec: SpecConfig | None
    paged: bool
    page_size: int  # paged: tokens per page
    capacity: int  # slots per request (paged: a multiple of page_size)
    num_pages: int  # paged: pages in the pool
    batch: int
    prompt_len: int
    max_rounds: int
    num_stop: int

    @property
    def N(self) -> int:
        return self.spec.num_draft_tokens if self.spec else 1

    @property
    def S(self) -> int:
        return self.spec.num_steps if self.spec else 0

    @property
    def K(self) -> int:
        return self.spec.topk if self.spec else 1

    @property
    def lag(self) -> int:
        return self.draft.lag if self.draft else 0

    @property
    def slack(self) -> int:
        """Slots past L that one round may write (verify, draft tree, draft-extend); dense
        caches add the slots that park a forward's queries (`kvc.query_slots`)."""
        q = (lambda T: 0) if self.paged else self._query_slots
        if not self.spec:
            return 1 + q(1)
        return max(self.N + q(self.N), self.S + 1 + self.lag + q(self.S + 1 + self.lag),
                   self.lag + (self.S - 1) * self.K + q(self.K))

    def _query_slots(self, T: int) -> int:
        models = [self.target] + ([self.draft.model] if self.draft else [])
        return max(kvc.query_slots(T, m.num_heads, m.num_kv_heads) for m in models)

    @property
    def pages_per_seq(self) -> int:
        return self.capacity // self.page_size if self.paged else 0

    @property
    def buffer_len(self) -> int:
        return self.capacity + self.S + 2


@struct.dataclass
class LoopState:
    tokens: jax.Array  # [B, C] prompt + generated; tokens[b, L[b]] is the root
    root: jax.Array  # [B] the root, kept apart so a round needs no gather from tokens
    L: jax.Array  # [B] committed target slots
    generated: jax.Array  # [B] tokens emitted
    finished: jax.Array  # [B] bool
    reason: jax.Array  # [B] int32 (RUNNING, STOP, LENGTH, CACHE_FULL)
    tcache: kvc.KVCache
    dcache: kvc.KVCache | None
    pages: kvc.PageState | None
    root_tokens: jax.Array  # [B, K] the draft's first-level candidates (target ids)
    root_probs: jax.Array  # [B, K]
    root_hidden: jax.Array  # [B, Dd] the draft hidden that produced them
    rounds: jax.Array  # [B] verify rounds run
    hist: jax.Array  # [B, R] accept length per round ([B, 0] without a draft: always 1)
    step: jax.Array  # [] rounds of the loop


# --------------------------------------------------------------------------- helpers

def _meta(plan: Plan, cache, pages, **kw):
    return kvc.make_meta(cache, page_state=pages, page_size=plan.page_size if plan.paged else 0,
                         q_room=not plan.paged, **kw)


def _ensure_capacity(plan: Plan, inp, st: LoopState, need_len, active, max_new_pages: int):
    """Room for need_len [B] slots per active row; a row that does not fit ends as cache_full.

    Dense: a row fits when need_len <= its limit inp["cap"]. Paged, additionally: rows get
    pages in batch order; when the pool runs dry, the first row that cannot be served ends
    and returns its pages, and the rest are served again.
    """
    full = active & (need_len > inp["cap"])
    if plan.paged:
        max_new = min(plan.pages_per_seq, max_new_pages)
        pages = kvc.free_pages(st.pages, full)

        def attempt(c):
            pages, full, _ = c
            new, ok = kvc.alloc_pages(pages, need_len, active & ~full, plan.page_size, max_new)
            failed = ~ok
            first = jnp.argmax(failed)
            drop = failed.any() & (jnp.arange(failed.shape[0]) == first)
            pages = jax.tree.map(lambda a, b: jnp.where(failed.any(), a, b), kvc.free_pages(pages, drop), new)
            return pages, full | drop, failed.any()

        pages, full, _ = jax.lax.while_loop(lambda c: c[2], attempt, (pages, full, jnp.bool_(True)))
        st = st.replace(pages=pages)
    st = st.replace(finished=st.finished | full, reason=jnp.where(full, CACHE_FULL, st.reason))
    return st, active & ~full


def _first_level(plan: Plan, dw, logits_d):
    """Draft logits [B,Vd] at the newest slot -> first-level candidates: target ids [B,K]
    and probabilities [B,K] (a chain takes the argmax and needs no probabilities)."""
    if plan.K == 1:
        tok = drafts.to_target_ids(dw, jnp.argmax(logits_d, axis=-1).astype(jnp.int32))
        return tok[:, None], jnp.ones_like(tok, jnp.float32)[:, None]
    vals, idx = vocab_top_k(logits_d, plan.K)
    probs = jnp.exp(vals - jax.nn.logsumexp(logits_d, axis=-1, keepdims=True))
    return drafts.to_target_ids(dw, idx.astype(jnp.int32)), probs


def _insert_bonus(path_tokens, n_path, bonus, lag: int):
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


def _draft_extend(plan: Plan, dw, tw, st: LoopState, start, path_tokens, feats, n_path, bonus, live,
                  prefill: bool):
    """Feeds the newly committed tokens (and the bonus) to the draft; returns the next
    round's first-level candidates. start [B]: first slot; n_path [B] path tokens."""
    d = plan.draft
    ext = _insert_bonus(path_tokens, n_path, bonus, plan.lag)  # [B, T]
    B, T = ext.shape
    if feats is not None and feats.shape[1] < T:
        feats = jnp.pad(feats, ((0, 0), (0, T - feats.shape[1]), (0, 0)))
    count = n_path + plan.lag
    ar = jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = ar < count[:, None]
    meta = _meta(plan, st.dcache, st.pages, positions=start[:, None] + ar, prefix_len=start,
                 local_mask=jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :],
                 write_valid=valid & live[:, None], prefill=prefill)
    hidden, dcache = drafts.draft_forward(d, dw, tw, plan.target, ext, feats, st.dcache, meta, True)
    last = jnp.take_along_axis(hidden, (count - 1)[:, None, None], axis=1)[:, 0]  # [B, Dd]
    logits_d = drafts.draft_logits(d, dw, tw, plan.target, last)
    tokens, probs = _first_level(plan, dw, logits_d)
    keep = live[:, None]
    return st.replace(dcache=dcache, root_tokens=jnp.where(keep, tokens, st.root_tokens),
                      root_probs=jnp.where(keep, probs, st.root_probs),
                      root_hidden=jnp.where(keep, last.astype(st.root_hidden.dtype), st.root_hidden))


# --------------------------------------------------------------------------- drafting

def _draft_step(plan, dw, tw, st, dcache, tokens, hidden, positions, prefix_len, local_mask, live):
    """One draft forward over the K newest nodes -> (logits [B,K,Vd], hidden [B,K,Dd], cache)."""
    B, K = positions.shape
    Tl = local_mask.shape[-1]
    # Tree levels fill K slots each, level l at position prefix_len + l - 1.
    local_positions = None if Tl == K else prefix_len[:, None] + jnp.arange(Tl, dtype=jnp.int32)[None] // K
    meta = _meta(plan, dcache, st.pages, positions=positions, prefix_len=prefix_len, local_mask=local_mask,
                 local_positions=local_positions, write_valid=jnp.broadcast_to(live[:, None], positions.shape))
    feats = None if plan.draft.kind == "standalone" else hidden
    h, dcache = drafts.draft_forward(plan.draft, dw, tw, plan.target, tokens, feats, dcache, meta, False)
    return drafts.draft_logits(plan.draft, dw, tw, plan.target, h), h, dcache


def _propose_chain(plan: Plan, dw, tw, st: LoopState, root, live):
    tok, h = st.root_tokens[:, 0], st.root_hidden
    dcache = st.dcache
    out = [root, tok]
    one = jnp.ones((root.shape[0], 1, 1), bool)
    for j in range(1, plan.S):
        pos = st.L + plan.lag + j - 1
        logits_d, hs, dcache = _draft_step(plan, dw, tw, st, dcache, tok[:, None], h[:, None], pos[:, None],
                                           pos, one, live)
        tok = drafts.to_target_ids(dw, jnp.argmax(logits_d[:, 0], axis=-1).astype(jnp.int32))
        h = hs[:, 0]
        out.append(tok)
    return dcache, chain_tree(jnp.stack(out, axis=1).astype(jnp.int32))


def _propose_tree(plan: Plan, dw, tw, st: LoopState, root, live):
    """EAGLE-2 dynamic tree: expand the K best nodes of each level by cumulative score."""
    B, K, S = root.shape[0], plan.K, plan.S
    base = st.L + plan.lag  # first draft slot of this round
    sel_tok, sel_score, sel_h = st.root_tokens, st.root_probs, st.root_hidden[:, None].repeat(K, axis=1)
    sel_cand = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32)[None], (B, K))
    sel_anc = jnp.zeros((B, K, max(S - 1, 1) * K), bool)  # draft slots (from base) seen by each
    cand_tok, cand_score = [sel_tok], [sel_score]
    cand_par = [jnp.full((B, K), -1, jnp.int32)]
    dcache = st.dcache
    for j in range(1, S):
        # Level-j nodes: draft slots base + (j-1)K + i, position base + j - 1.
        own = (j - 1) * K + jnp.arange(K)
        sel_anc = sel_anc.at[:, jnp.arange(K), own].set(True)
        local = sel_anc[:, :, : j * K]
        pos = jnp.broadcast_to((base + j - 1)[:, None], (B, K))
        logits_d, hs, dcache = _draft_step(plan, dw, tw, st, dcache, sel_tok, sel_h, pos, base, local, live)
        vals, idx = vocab_top_k(logits_d, K)  # [B,K,K]
        probs = jnp.exp(vals - jax.nn.logsumexp(logits_d, axis=-1, keepdims=True))
        score = (sel_score[:, :, None] * probs).reshape(B, K * K)
        tok = drafts.to_target_ids(dw, idx.astype(jnp.int32)).reshape(B, K * K)
        offset = K + (j - 1) * K * K
        cand_tok.append(tok)
        cand_score.append(score)
        cand_par.append(jnp.repeat(sel_cand, K, axis=1))
        if j < S - 1:  # pick the K nodes to expand next
            sel_score, pick = jax.lax.top_k(score, K)
            parent = pick // K
            sel_tok = jnp.take_along_axis(tok, pick, axis=1)
            sel_cand = offset + pick
            sel_h = jnp.take_along_axis(hs, parent[:, :, None], axis=1)
            sel_anc = jnp.take_along_axis(sel_anc, parent[:, :, None], axis=1)
    tree = select_tree(root, jnp.concatenate(cand_tok, 1), jnp.concatenate(cand_score, 1),
                       jnp.concatenate(cand_par, 1), plan.N, S)
    return dcache, tree


# --------------------------------------------------------------------------- one round

def _round(plan: Plan, tw, dw, inp, st: LoopState) -> LoopState:
    B = plan.batch
    active = ~st.finished
    st, active = _ensure_capacity(plan, inp, st, st.L + plan.slack, active,
                                  -(-plan.slack // max(plan.page_size, 1)) + 1)
    root = st.root

    # Draft.
    if plan.draft is None:
        tree = chain_tree(root[:, None])
    elif plan.K == 1:
        dcache, tree = _propose_chain(plan, dw, tw, st, root, active)
        st = st.replace(dcache=dcache)
    else:
        dcache, tree = _propose_tree(plan, dw, tw, st, root, active)
        st = st.replace(dcache=dcache)

    # Verify: the target over the N nodes under the tree mask.
    N = plan.N
    meta = _meta(plan, st.tcache, st.pages, positions=st.L[:, None] + tree.depth, prefix_len=st.L,
                 local_mask=tree.anc, write_valid=jnp.broadcast_to(active[:, None], (B, N)))
    capture = drafts.target_capture(plan.draft) if plan.draft else ()
    hidden, aux, tcache = tgt.forward(tw, plan.target, tree.tokens, st.tcache, meta, capture)
    logits = tgt.logits(tw, plan.target, hidden)  # [B,N,V]

    # Accept.
    if plan.draft is None:
        bonus = sampling.sample(logits[:, 0], inp["temperature"], inp["top_k"], inp["top_p"], inp["seed"],
                                st.step + 1)
        accept_len = jnp.ones((B,), jnp.int32)
        path = jnp.zeros((B, 1), jnp.int32)
    else:
        choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if plan.K == 1:
            accept_len, path, bonus = verify.accept_chain(tree.tokens, choice)
        else:
            accept_len, path, bonus = verify.accept_tree(tree, choice, plan.S)
            tcache = _compact(plan, tcache, st, path, accept_len, active)
    st = st.replace(tcache=tcache)

    # Commit: emit the accepted drafts and the bonus, check stops and limits.
    S1 = path.shape[1]
    m = accept_len - 1
    chain = plan.K == 1  # the path is 0..S: no gathers along it
    path_tokens = tree.tokens if chain else jnp.take_along_axis(tree.tokens, path, axis=1)  # [B,S+1]
    nxt = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    j = jnp.arange(S1)[None, :]
    emitted = jnp.where(j == m[:, None], bonus[:, None], nxt)  # [B,S+1], valid j <= m
    st, n_emit = _emit(plan, inp, st, emitted, accept_len, active)
    newly_done = active & st.finished
    if plan.draft is not None:  # plain decoding accepts one token a round: no histogram to keep
        st = st.replace(hist=st.hist.at[jnp.arange(B), jnp.where(active, st.rounds, plan.max_rounds)].set(
            accept_len, mode="drop"))
    st = st.replace(L=jnp.where(active, st.L + accept_len, st.L), root=jnp.where(active, bonus, st.root),
                    rounds=st.rounds + active.astype(jnp.int32))

    # Draft-extend on the committed tokens, with the target's features along the path.
    if plan.draft is not None:
        live = active & ~st.finished
        feats = drafts.target_features(plan.draft, hidden, aux)
        if feats is not None and not chain:
            feats = jnp.take_along_axis(feats, path[:, :, None], axis=1)
        start = st.L - accept_len
        st = _draft_extend(plan, dw, tw, st, start, path_tokens, feats, accept_len, bonus, live, False)
    if plan.paged:
        st = st.replace(pages=kvc.free_pages(st.pages, newly_done))
    return st.replace(step=st.step + 1)


def _compact(plan: Plan, tcache, st: LoopState, path, accept_len, active):
    """Tree commit: the accepted path's KV moves from slots L+path[d] to L+d."""
    B, S1 = path.shape
    d = jnp.arange(S1, dtype=jnp.int32)[None, :]
    move = active[:, None] & (d < accept_len[:, None]) & (path != d)
    table = st.pages.page_table if plan.paged else None
    kw = dict(page_table=table, page_size=plan.page_size, num_pages=plan.num_pages) if plan.paged else \
        dict(batch_capacity=plan.capacity)
    src = kvc.slot_index(st.L[:, None] + path, move, **kw)
    dst = kvc.slot_index(st.L[:, None] + d, move, **kw)
    return kvc.move_slots(tcache, src, dst)


def _emit(plan: Plan, inp, st: LoopState, emitted, count, active):
    """Writes up to `count` [B] tokens after the root, stopping at a stop token or the
    request's max_new_tokens; marks finished rows. The stop ids and the E emitted slots
    are few and static: unrolled comparisons instead of reductions let XLA compute all
    of this in a few fused kernels."""
    B, E = emitted.shape
    stop_ids = inp["stop_ids"]
    j = jnp.arange(E)[None, :]
    is_stop = functools.reduce(jnp.logical_or, [emitted == stop_ids[k] for k in range(stop_ids.shape[0])])
    is_stop = is_stop & (j < count[:, None])  # [B, E]
    first_stop = jnp.full((B,), E, jnp.int32)
    for i in reversed(range(E)):
        first_stop = jnp.where(is_stop[:, i], i, first_stop)
    budget = inp["max_new"] - st.generated
    n = jnp.minimum(jnp.minimum(count, first_stop + 1), budget)
    n = jnp.where(active, n, 0)
    pos = jnp.where(j < n[:, None], st.L[:, None] + 1 + j, st.tokens.shape[1])
    tokens = st.tokens.at[jnp.arange(B)[:, None], pos].set(emitted, mode="drop")
    generated = st.generated + n
    hit_stop = active & (first_stop < n)
    at_len = active & (generated >= inp["max_new"])
    # max_new is cut to the cache's room when that is smaller (inp["room_bound"]).
    reason = jnp.where(hit_stop, STOP, jnp.where(at_len, jnp.where(inp["room_bound"], CACHE_FULL, LENGTH),
                                                 st.reason))
    return st.replace(tokens=tokens, generated=generated, finished=st.finished | hit_stop | at_len,
                      reason=reason), n


# --------------------------------------------------------------------------- prefill

def _prefill(plan: Plan, tw, dw, inp, st: LoopState) -> LoopState:
    B, T = plan.batch, plan.prompt_len
    lens = inp["prompt_len"]
    active = ~st.finished
    st, active = _ensure_capacity(plan, inp, st, lens + plan.slack, active, plan.pages_per_seq)
    prompt = inp["prompt"]
    ar = jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = ar < lens[:, None]
    meta = _meta(plan, st.tcache, st.pages, positions=jnp.broadcast_to(ar, (B, T)), prefix_len=jnp.zeros_like(lens),
                 local_mask=jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :],
                 write_valid=valid & active[:, None], prefill=True)
    capture = drafts.target_capture(plan.draft) if plan.draft else ()
    hidden, aux, tcache = tgt.forward(tw, plan.target, prompt, st.tcache, meta, capture)
    last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
    logits = tgt.logits(tw, plan.target, last)
    if plan.draft is None:
        first = sampling.sample(logits, inp["temperature"], inp["top_k"], inp["top_p"], inp["seed"], 0)
    else:  # speculative programs are greedy (api refuses a temperature): no sampling branch to compile
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = st.tokens.at[:, :T].set(prompt)
    st = st.replace(tcache=tcache, tokens=tokens, L=lens - 1)  # _emit writes after L
    st, _ = _emit(plan, inp, st, first[:, None], jnp.ones((B,), jnp.int32), active)
    st = st.replace(L=lens, root=first)
    if plan.draft is not None:
        feats = drafts.target_features(plan.draft, hidden, aux)
        st = _draft_extend(plan, dw, tw, st, jnp.zeros_like(lens), prompt, feats, lens, first,
                           active & ~st.finished, True)
    if plan.paged:
        st = st.replace(pages=kvc.free_pages(st.pages, active & st.finished))
    return st


# --------------------------------------------------------------------------- entry

def init_state(plan: Plan, inp) -> LoopState:
    B, c = plan.batch, plan.target
    if plan.paged:
        alloc = dict(num_pages=plan.num_pages, page_size=plan.page_size)
        pages = kvc.init_page_state(B, plan.pages_per_seq, plan.num_pages)
    else:
        alloc = dict(batch=B, max_len=plan.capacity)
        pages = None
    tcache = kvc.init_kv_cache(c.num_layers, c.num_kv_heads, c.head_dim, c.jnp_dtype, **alloc)
    dcache, Dd = None, 1
    if plan.draft is not None:
        m = plan.draft.model
        dcache = kvc.init_kv_cache(m.num_layers, m.num_kv_heads, m.head_dim, c.jnp_dtype, **alloc)
        Dd = m.hidden_size
    real = inp["real"]
    return LoopState(
        tokens=jnp.zeros((B, plan.buffer_len), jnp.int32), root=jnp.zeros((B,), jnp.int32),
        L=jnp.zeros((B,), jnp.int32),
        generated=jnp.zeros((B,), jnp.int32), finished=~real, reason=jnp.zeros((B,), jnp.int32),
        tcache=tcache, dcache=dcache, pages=pages,
        root_tokens=jnp.zeros((B, plan.K), jnp.int32), root_probs=jnp.zeros((B, plan.K), jnp.float32),
        root_hidden=jnp.zeros((B, Dd), c.jnp_dtype), rounds=jnp.zeros((B,), jnp.int32),
        hist=jnp.zeros((B, plan.max_rounds if plan.draft else 0), jnp.int32), step=jnp.int32(0))


def run(plan: Plan, tw, dw, inp) -> LoopState:
    """Prefill and the loop of rounds -> the final state. inp: prompt [B,Tp]; prompt_len,
    max_new, room_bound (max_new was cut to the cache's room), cap (slot limit), real,
    temperature, top_k, top_p, seed ([B] each); stop_ids [Ks]."""
    st = init_state(plan, inp)
    st = _prefill(plan, tw, dw, inp, st)
    return jax.lax.while_loop(lambda s: jnp.any(~s.finished) & (s.step < plan.max_rounds),
                              lambda s: _round(plan, tw, dw, inp, s), st)


def generate_fn(plan: Plan, tw, dw, inp):
    st = run(plan, tw, dw, inp)
    return dict(tokens=st.tokens, generated=st.generated, reason=st.reason, rounds=st.rounds, hist=st.hist)


generate_jit = jax.jit(generate_fn, static_argnums=0)
