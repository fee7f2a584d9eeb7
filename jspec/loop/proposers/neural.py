"""The neural proposer: a draft model (`jspec.drafts`: EAGLE, EAGLE-3, standalone, MTP)
drafts a chain (K = 1) or an EAGLE-2 tree (K > 1) in S steps.

When tokens are committed the draft runs over them (draft-extend, `observe`: reading the
target's features along them) and keeps its hidden state at the newest slot; a round's
first level (the root's K children) is that hidden through the draft's head, made when
the round drafts (`propose`), so the state is the same whatever SpecConfig the next round
drafts with (a serving engine's tiers share it). Each further step runs the draft over
the K newest nodes. The loop sees only the `Proposer` protocol; what is EAGLE's recipe
lives here.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jspec import sampling
from jspec.cache.layout import causal_mask
from jspec.config import SpecConfig
from jspec.constraints import tables as gt
from jspec.drafts.base import Draft
from jspec.loop.proposers.base import Observation, Proposer
from jspec.loop.tree import chain_tree, select_tree, vocab_top_k


@struct.dataclass
class NeuralState:
    """The draft's side of every row (the same for every SpecConfig)."""

    cache: object  # the draft's cache (its kind's), its slots beside the target's
    hidden: jax.Array  # [B, Dd] the draft's hidden at the newest committed slot (its head gives the first level)


def put_rows(old, new, rows):
    """`old` [B, ...] with rows `rows` [A] set to `new` [A, ...] (rows past B: dropped);
    rows None: `new` whole."""
    return new if rows is None else old.at[rows].set(new.astype(old.dtype), mode="drop")


@dataclasses.dataclass(frozen=True)
class NeuralProposer(Proposer):
    """A draft model behind the proposer protocol; `draft` is its kind (which holds its config)."""

    draft: Draft

    def target_layers(self):
        return self.draft.target_layers

    def check_spec(self, spec: SpecConfig) -> None:
        Vd = self.draft.vocab_size
        if spec.topk > Vd:  # top-k of Vd draft logits
            raise ValueError(f"SpecConfig.topk={spec.topk} exceeds the draft's vocabulary of {Vd} tokens; "
                             f"topk must be at most {Vd}")

    def slack(self, spec: SpecConfig, paged: bool) -> int:
        # draft-extend writes S+1+lag slots from L; tree drafting the K slots of level j at
        # L + lag + (j-1)K, j < S; each asks its cache kind's room past it.
        S, K = (spec.num_steps, spec.topk) if spec is not None else (0, 1)  # None: a plain tier, observing
        lag = self.draft.lag
        extra = lambda T: self.draft.cache_kind().extra_slots(T, paged)  # noqa: E731
        return max(S + 1 + lag + extra(S + 1 + lag), lag + (S - 1) * K + extra(K))

    def cache_reads_next_token(self) -> bool:
        return self.draft.lag == 0  # an EAGLE-style head (a standalone draft's slot i holds token i)

    def init(self, plan, batch: int) -> NeuralState:
        return NeuralState(cache=self.draft.cache_kind().init(plan.layout, batch),
                           hidden=jnp.zeros((batch, self.draft.hidden_size), jnp.dtype(plan.target.dtype)))

    # ------------------------------------------------------------------ propose

    def propose(self, plan, tw, dw, state: NeuralState, st, active):
        first = self.first_level(plan, tw, dw, state, st)
        if plan.K == 1:
            return self._chain(plan, tw, dw, state, st, active, first)
        return self._tree(plan, tw, dw, state, st, active, first)

    def first_level(self, plan, tw, dw, state: NeuralState, st):
        """The root's children under `plan`'s SpecConfig: the kept hidden through the
        draft's head -> (target ids [B,K], draft probabilities [B,K] (a tree's scores), the
        draft's log q [B,V] of a sampled draw (else [B,0])). The root is at L: the first
        draft is the token at L + 1. Rows under a constraint draft only what their state
        allows (`allowed`)."""
        mask = None if st.grammar is None else self.allowed(plan, dw, st, st.grammar.state[:, None])[:, 0]
        return self._first_level(plan, tw, dw, state.hidden, st.request.sampling, st.L + 1, mask)

    def allowed(self, plan, dw, st, q):
        """The draft-vocabulary tokens constraint states q [B,M] allow -> bool [B,M,Vd]
        (the target's allowed tokens at the draft's ids)."""
        ids = self.draft.to_target_ids(dw, jnp.arange(self.draft.vocab_size, dtype=jnp.int32))
        return gt.allowed_mask(st.grammar.tables, q, plan.target.vocab_size)[..., ids]

    def _step(self, plan, tw, dw, pages, cache, tokens, hidden, positions, prefix_len, local_mask, live):
        """One draft forward over the K newest nodes: tokens [B,K], the draft's own hidden
        [B,K,Dd] as features -> (logits [B,K,Vd], hidden [B,K,Dd], draft cache)."""
        B, K = positions.shape
        Tl = local_mask.shape[-1]
        # Tree levels fill K slots each, level l at position prefix_len + l - 1.
        local_positions = None if Tl == K else prefix_len[:, None] + jnp.arange(Tl, dtype=jnp.int32)[None] // K
        meta = plan.layout.meta(pages, positions=positions, prefix_len=prefix_len, local_mask=local_mask,
                                local_positions=local_positions,
                                write_valid=jnp.broadcast_to(live[:, None], positions.shape))
        d = self.draft
        h, cache = d.forward(plan.target, tw, dw, tokens, hidden, cache, meta, False, tuning=plan.tuning)
        return d.logits(plan.target, tw, dw, h, tuning=plan.tuning), h, cache

    def _chain(self, plan, tw, dw, state: NeuralState, st, active, first):
        """A chain of S+1 nodes, and with sampled drafts the draft's log q [B,S,V] of each
        drafted token's draw (the first level's is the first's)."""
        L, root, sp = st.L, st.root, st.request.sampling
        first_tokens, _, first_logq = first
        tok, h, cache = first_tokens[:, 0], state.hidden, state.cache
        out, logqs = [root, tok], [first_logq]
        one = jnp.ones((root.shape[0], 1, 1), bool)
        q = None if st.grammar is None else gt.next_state(st.grammar.tables, st.grammar.state, tok)
        qs = [] if q is None else [st.grammar.state, q]  # each node's state: acceptance reuses them
        for j in range(1, plan.S):
            pos = L + self.draft.lag + j - 1
            logits_d, hs, cache = self._step(plan, tw, dw, st.pages, cache, tok[:, None], h[:, None], pos[:, None],
                                             pos, one, active)
            if q is not None:  # the constraint's state along the chain
                logits_d = jnp.where(self.allowed(plan, dw, st, q[:, None]), logits_d, -jnp.inf)
            if plan.sample_drafts:  # the token at sequence position L + j + 1
                t, logq = self._draw(plan, dw, logits_d, sp, (L + j + 1)[:, None])
                tok = t[:, 0]
                logqs.append(logq[:, 0])
            else:
                tok = self.draft.to_target_ids(dw, jnp.argmax(logits_d[:, 0], axis=-1).astype(jnp.int32))
            if q is not None:
                q = gt.next_state(st.grammar.tables, q, tok)
                qs.append(q)
            h = hs[:, 0]
            out.append(tok)
        logq = jnp.stack(logqs, axis=1) if plan.sample_drafts else None
        states = jnp.stack(qs, axis=1) if qs else None
        return state.replace(cache=cache), chain_tree(jnp.stack(out, axis=1).astype(jnp.int32), states=states), logq

    def _tree(self, plan, tw, dw, state: NeuralState, st, active, first):
        """EAGLE-2 dynamic tree: expand the K best nodes of each level by cumulative score;
        keep the best N-1 candidates."""
        L, root = st.L, st.root
        B, K, S = root.shape[0], plan.K, plan.S
        base = L + self.draft.lag  # first draft slot of this round
        cache = state.cache
        sel_tok, sel_score, _ = first
        grammar = st.grammar
        sel_q = None if grammar is None else gt.next_state(grammar.tables, grammar.state[:, None], sel_tok)  # [B,K]
        sel_h = state.hidden[:, None].repeat(K, axis=1)
        sel_cand = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32)[None], (B, K))
        sel_anc = jnp.zeros((B, K, max(S - 1, 1) * K), bool)  # draft slots (from base) seen by each
        cand_tok, cand_score = [sel_tok], [sel_score]
        cand_par = [jnp.full((B, K), -1, jnp.int32)]
        for j in range(1, S):
            # Level-j nodes: draft slots base + (j-1)K + i, position base + j - 1.
            own = (j - 1) * K + jnp.arange(K)
            sel_anc = sel_anc.at[:, jnp.arange(K), own].set(True)
            local = sel_anc[:, :, : j * K]
            pos = jnp.broadcast_to((base + j - 1)[:, None], (B, K))
            logits_d, hs, cache = self._step(plan, tw, dw, st.pages, cache, sel_tok, sel_h, pos, base, local, active)
            if sel_q is not None:  # each expanded node's children as its constraint state allows
                logits_d = jnp.where(self.allowed(plan, dw, st, sel_q), logits_d, -jnp.inf)
            vals, idx = vocab_top_k(logits_d, K)  # [B,K,K]
            probs = jnp.exp(vals - jax.nn.logsumexp(logits_d, axis=-1, keepdims=True))
            score = (sel_score[:, :, None] * probs).reshape(B, K * K)
            tok = self.draft.to_target_ids(dw, idx.astype(jnp.int32)).reshape(B, K * K)
            offset = K + (j - 1) * K * K
            cand_tok.append(tok)
            cand_score.append(score)
            cand_par.append(jnp.repeat(sel_cand, K, axis=1))
            if j < S - 1:  # pick the K nodes to expand next
                sel_score, pick = jax.lax.top_k(score, K)
                parent = pick // K
                sel_tok = jnp.take_along_axis(tok, pick, axis=1)
                if sel_q is not None:
                    sel_q = gt.next_state(grammar.tables, jnp.take_along_axis(sel_q, parent, axis=1), sel_tok)
                sel_cand = offset + pick
                sel_h = jnp.take_along_axis(hs, parent[:, :, None], axis=1)
                sel_anc = jnp.take_along_axis(sel_anc, parent[:, :, None], axis=1)
        tree = select_tree(root, jnp.concatenate(cand_tok, 1), jnp.concatenate(cand_score, 1),
                           jnp.concatenate(cand_par, 1), plan.N, S)
        return state.replace(cache=cache), tree, None

    # ------------------------------------------------------------------ observe

    def observe(self, plan, tw, dw, state: NeuralState, obs: Observation):
        """Draft-extend: the committed tokens (and the bonus) through the draft, with the
        target's features along them; keeps the draft's hidden at the newest slot for live
        rows (the next round's first level comes from it)."""
        d = self.draft
        feats = d.target_features(obs.hidden, obs.aux)
        if feats is not None and obs.path is not None:
            feats = jnp.take_along_axis(feats, obs.path[:, :, None], axis=1)
        ext = _extend_tokens(obs.tokens, obs.count, obs.bonus, d.lag)  # [R, T]
        R, T = ext.shape
        if feats is not None and feats.shape[1] < T:
            feats = jnp.pad(feats, ((0, 0), (0, T - feats.shape[1]), (0, 0)))
        count = obs.count + d.lag
        valid = jnp.arange(T, dtype=jnp.int32)[None, :] < count[:, None]
        meta = plan.layout.meta(obs.pages, positions=obs.start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :],
                                prefix_len=obs.start, local_mask=causal_mask(count, T),
                                write_valid=valid & obs.live[:, None], prefill=obs.prefill, rows=obs.rows)
        hidden, cache = d.forward(plan.target, tw, dw, ext, feats, state.cache, meta, True, tuning=plan.tuning)
        last = jnp.take_along_axis(hidden, (count - 1)[:, None, None], axis=1)[:, 0]  # [R, Dd]
        keep, rows = obs.live[:, None], obs.rows
        last = last.astype(state.hidden.dtype)
        # rows that finished keep their old values (an admitted one: anything)
        hidden_kept = jnp.where(keep, last, state.hidden) if rows is None else put_rows(state.hidden, last, rows)
        return state.replace(cache=cache, hidden=hidden_kept)

    def _first_level(self, plan, tw, dw, last, sp: sampling.SamplingParams, position, mask=None):
        """The draft's hidden [R,Dd] at the newest slot -> the root's children: target ids
        [R,K], draft probabilities [R,K] (a tree's scores), and with sampled drafts the
        draft's processed log-probabilities over the target vocabulary [R,V] (else
        [R,0]). A chain takes the argmax, or with sampled drafts a draw for the token at
        `position` [R]. mask [R,Vd]: the draft tokens a constraint allows (None: all)."""
        d = self.draft
        logits_d = d.logits(plan.target, tw, dw, last, tuning=plan.tuning)
        if mask is not None:
            logits_d = jnp.where(mask, logits_d, -jnp.inf)
        R = logits_d.shape[0]
        if plan.sample_drafts:
            tok, logq = self._draw(plan, dw, logits_d[:, None], sp, position[:, None])
            return tok, jnp.ones((R, 1), jnp.float32), logq[:, 0]
        none = jnp.zeros((R, 0), jnp.float32)
        if plan.K == 1:
            tok = d.to_target_ids(dw, jnp.argmax(logits_d, axis=-1).astype(jnp.int32))
            return tok[:, None], jnp.ones_like(tok, jnp.float32)[:, None], none
        vals, idx = vocab_top_k(logits_d, plan.K)
        probs = jnp.exp(vals - jax.nn.logsumexp(logits_d, axis=-1, keepdims=True))
        return d.to_target_ids(dw, idx.astype(jnp.int32)), probs, none

    def _draw(self, plan, dw, logits_d, sp: sampling.SamplingParams, positions):
        """Sampled drafts: draft logits [R,M,Vd] -> target ids [R,M] drawn from the draft's
        processed distribution q (its argmax for greedy rows; no penalties: q may be any
        distribution) and log q over the target vocabulary [R,M,V] (-inf off the draft's)."""
        d = self.draft
        tok, logq_d = sampling.choose_with_log_probs(logits_d, sp, positions, sampling.DRAFT)
        V, Vd = plan.target.vocab_size, logits_d.shape[-1]
        ids = d.to_target_ids(dw, jnp.arange(Vd, dtype=jnp.int32))
        logq = jnp.full(logits_d.shape[:2] + (V,), -jnp.inf, jnp.float32).at[..., ids].set(logq_d)
        return d.to_target_ids(dw, tok), logq


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
