"""The block proposer: a block drafter (`jspec.drafts.dflash`) proposes a round's whole
chain or tree from one forward.

State: the draft's cache of context keys and values, one slot per committed token beside
the target's slots (the same pages). `observe` writes the committed tokens' context, which
depends only on the target's features at them: no draft attention runs there. `propose`
runs the block (the root at L and S mask tokens at L+1..L+S, attending to the context
[0, L) and to each other) and reads each block slot's distribution over the token at its
position:
- a chain (K = 1): each slot's argmax, or with sampled drafts a draw from each slot's own
  distribution (the slots do not see each other's drafts, so each draw's q is its slot's);
- a tree (K > 1): EAGLE-2's expansion with the slots' distributions as the levels: level j
  offers the K best tokens of slot j under each of the K best nodes of level j - 1
  (cumulative probability), and the best N - 1 nodes are kept.
Rows under a constraint draft only what their constraint state along the drafts allows.
The block's own keys and values land at L..L+S and are overwritten by the next `observe`
or never read (they lie past the committed prefix).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jspec import sampling
from jspec.config import SpecConfig
from jspec.constraints import tables as gt
from jspec.drafts.base import Draft
from jspec.loop import budget
from jspec.loop.proposers.base import Observation, Proposer
from jspec.loop.tree import chain_tree, select_tree, vocab_top_k


@struct.dataclass
class BlockState:
    cache: object  # the draft's cache (its kind's): context keys and values of committed slots


@dataclasses.dataclass(frozen=True)
class BlockProposer(Proposer):
    """A block drafter behind the proposer protocol; `draft` is its kind (`proposes_blocks`)."""

    draft: Draft

    def target_layers(self):
        return self.draft.target_layers

    def default_spec(self) -> SpecConfig:
        b = self.draft.block_size
        return SpecConfig(num_steps=b - 1, topk=1, num_draft_tokens=b)

    def check_spec(self, spec: SpecConfig) -> None:
        b = self.draft.block_size
        if spec.num_steps + 1 > b:
            raise ValueError(f"SpecConfig.num_steps={spec.num_steps} asks for a block of {spec.num_steps + 1} tokens "
                             f"(the root and {spec.num_steps} drafts); this DFlash draft's block_size is {b}: "
                             f"num_steps must be at most {b - 1}")
        if spec.topk > self.draft.vocab_size:
            raise ValueError(f"SpecConfig.topk={spec.topk} exceeds the vocabulary of {self.draft.vocab_size} tokens")

    def estimates_acceptance(self) -> bool:
        return True

    def slack(self, spec: SpecConfig, paged: bool) -> int:
        if spec is None:  # a plain tier: observe writes committed slots only
            return 0
        T = spec.num_steps + 1  # the block, from L
        return T + self.draft.cache_kind().extra_slots(T, paged)

    def init(self, plan, batch: int) -> BlockState:
        return BlockState(cache=self.draft.cache_kind().init(plan.layout, batch))

    # ------------------------------------------------------------------ propose

    def propose(self, plan, tw, dw, state: BlockState, st, active):
        logits, cache = self.block_logits(plan, tw, dw, state, st, active)
        state = state.replace(cache=cache)
        if plan.K == 1:
            return (state,) + self._chain(plan, st, logits)
        return state, self._tree(plan, st, logits), None

    def block_logits(self, plan, tw, dw, state: BlockState, st, active):
        """The block's forward -> (float32 logits [B,S,V] of the tokens at L+1..L+S, cache)."""
        d, S = self.draft, plan.S
        B, T = st.L.shape[0], S + 1
        tokens = jnp.concatenate([st.root[:, None], jnp.full((B, S), d.mask_token_id, jnp.int32)], axis=1)
        positions = st.L[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        meta = plan.layout.meta(st.pages, positions=positions, prefix_len=st.L, local_mask=jnp.ones((B, T, T), bool),
                                write_valid=jnp.broadcast_to(active[:, None], (B, T)))
        hidden, cache = d.block(plan.target, tw, dw, tokens, state.cache, meta, tuning=plan.tuning)
        return d.logits(plan.target, tw, dw, hidden[:, 1:], tuning=plan.tuning), cache

    def _chain(self, plan, st, logits):
        """A chain of S+1 nodes from the slots' logits [B,S,V], and with sampled drafts the
        log q [B,S,V] of each slot's draw."""
        L, S = st.L, plan.S
        if st.grammar is not None:  # slot by slot: the constraint's state follows the drafts
            toks, logqs, masked, q = [], [], [], st.grammar.state
            qs = [q]  # each node's state: acceptance reuses them
            for j in range(S):
                lj = gt.mask_logits(st.grammar.tables, q, logits[:, j])
                tok, logq = self._pick(plan, lj[:, None], st, (L + 1 + j)[:, None])
                toks.append(tok[:, 0])
                logqs.append(None if logq is None else logq[:, 0])
                masked.append(lj)
                q = gt.next_state(st.grammar.tables, q, tok[:, 0])
                qs.append(q)
            drafts = jnp.stack(toks, axis=1)
            states = jnp.stack(qs, axis=1)
            logq = jnp.stack(logqs, axis=1) if plan.sample_drafts else None
            logits = jnp.stack(masked, axis=1)
        else:
            drafts, logq = self._pick(plan, logits, st, L[:, None] + 1 + jnp.arange(S, dtype=jnp.int32)[None, :])
            states = None
        tokens = jnp.concatenate([st.root[:, None], drafts], axis=1).astype(jnp.int32)
        survival = None
        if plan.spec.verify_lengths:  # each draft's probability under the slot's distribution it came from
            logp = jax.nn.log_softmax(logits, axis=-1) if logq is None else logq
            survival = budget.chain_survival(jnp.take_along_axis(logp, drafts[:, :, None], axis=2)[:, :, 0],
                                             plan.spec.survival_power)
        return chain_tree(tokens, states=states, survival=survival), logq

    def _pick(self, plan, logits, st, positions):
        """logits [B,M,V] of tokens at positions [B,M] -> (tokens [B,M], log q [B,M,V] of
        sampled drafts, else None)."""
        if plan.sample_drafts:
            return sampling.choose_with_log_probs(logits, st.request.sampling, positions, sampling.DRAFT)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None

    def _tree(self, plan, st, logits):
        """EAGLE-2's dynamic tree over the slots' distributions (the module docstring)."""
        B, K, S = st.L.shape[0], plan.K, plan.S
        grammar = st.grammar
        logp = jax.nn.log_softmax(logits, axis=-1)  # [B,S,V]

        def children(j, q):
            """The K best tokens of slot j under each of the nodes in states q [B,M] (None:
            no constraint) -> (tokens [B,M,K], probabilities [B,M,K])."""
            if q is None:  # every node of the level has the same children
                vals, idx = vocab_top_k(logp[:, j][:, None], K)
                return jnp.broadcast_to(idx, (B, 1 if j == 0 else K, K)), jnp.exp(vals)
            masked = jnp.where(gt.allowed_mask(grammar.tables, q, logp.shape[-1]), logp[:, j][:, None], -jnp.inf)
            vals, idx = vocab_top_k(masked, K)
            return idx, jnp.exp(vals)

        root_q = None if grammar is None else grammar.state[:, None]
        tok, prob = children(0, root_q)
        sel_tok, sel_score = tok[:, 0].astype(jnp.int32), prob[:, 0] * jnp.ones((B, K))
        sel_q = None if grammar is None else gt.next_state(grammar.tables, jnp.broadcast_to(root_q, (B, K)), sel_tok)
        sel_cand = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32)[None], (B, K))
        cand_tok, cand_score, cand_par = [sel_tok], [sel_score], [jnp.full((B, K), -1, jnp.int32)]
        for j in range(1, S):
            tok, prob = children(j, sel_q)  # [B,K,K]
            score = (sel_score[:, :, None] * prob).reshape(B, K * K)
            tok = tok.reshape(B, K * K).astype(jnp.int32)
            cand_tok.append(tok)
            cand_score.append(score)
            cand_par.append(jnp.repeat(sel_cand, K, axis=1))
            if j < S - 1:  # the K nodes to expand next
                sel_score, pick = jax.lax.top_k(score, K)
                parent = pick // K
                sel_tok = jnp.take_along_axis(tok, pick, axis=1)
                if sel_q is not None:
                    sel_q = gt.next_state(grammar.tables, jnp.take_along_axis(sel_q, parent, axis=1), sel_tok)
                sel_cand = K + (j - 1) * K * K + pick
        return select_tree(st.root, jnp.concatenate(cand_tok, 1), jnp.concatenate(cand_score, 1),
                           jnp.concatenate(cand_par, 1), plan.N, S)

    # ------------------------------------------------------------------ observe

    def observe(self, plan, tw, dw, state: BlockState, obs: Observation):
        """The committed tokens' context keys and values, at slots start..start+count-1,
        from the target's features along them (the bonus, not yet through the target, has
        none: it is the next block's root)."""
        d = self.draft
        feats = d.target_features(obs.hidden, obs.aux)  # [R, T'', F]
        if obs.path is not None:
            feats = jnp.take_along_axis(feats, obs.path[:, :, None], axis=1)
        R, T = obs.tokens.shape
        feats = feats[:, :T] if feats.shape[1] >= T else jnp.pad(feats, ((0, 0), (0, T - feats.shape[1]), (0, 0)))
        ar = jnp.arange(T, dtype=jnp.int32)[None, :]
        valid = (ar < obs.count[:, None]) & obs.live[:, None]
        meta = plan.layout.meta(obs.pages, positions=obs.start[:, None] + ar, prefix_len=obs.start,
                                local_mask=jnp.ones((R, T, T), bool), write_valid=valid, prefill=obs.prefill,
                                rows=obs.rows)
        return state.replace(cache=d.context(plan.target, tw, dw, feats, state.cache, meta, tuning=plan.tuning))
