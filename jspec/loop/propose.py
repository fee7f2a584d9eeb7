"""The draft phase: S draft steps propose a chain (K = 1) or an EAGLE-2 tree (K > 1).

The first level of a round (the root's K children) was computed by the previous round's
draft-extend (`first_level`); each further step runs the draft over the K newest nodes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import sampling
from jspec.loop.plan import Plan
from jspec.loop.tree import chain_tree, select_tree, vocab_top_k


def first_level(plan: Plan, dw, logits_d, sp: sampling.SamplingParams, position):
    """Draft logits [B,Vd] at the newest slot -> the root's children: target ids [B,K],
    draft probabilities [B,K] (a tree's scores), and with sampled drafts the draft's
    processed log-probabilities over the target vocabulary [B,V] (else [B,0]). A chain
    takes the argmax, or with sampled drafts a draw for the token at `position` [B]."""
    d = plan.draft
    B = logits_d.shape[0]
    if plan.sample_drafts:
        tok, logq = draw_draft(plan, dw, logits_d[:, None], sp, position[:, None])
        return tok, jnp.ones((B, 1), jnp.float32), logq[:, 0]
    none = jnp.zeros((B, 0), jnp.float32)
    if plan.K == 1:
        tok = d.to_target_ids(dw, jnp.argmax(logits_d, axis=-1).astype(jnp.int32))
        return tok[:, None], jnp.ones_like(tok, jnp.float32)[:, None], none
    vals, idx = vocab_top_k(logits_d, plan.K)
    probs = jnp.exp(vals - jax.nn.logsumexp(logits_d, axis=-1, keepdims=True))
    return d.to_target_ids(dw, idx.astype(jnp.int32)), probs, none


def draw_draft(plan: Plan, dw, logits_d, sp: sampling.SamplingParams, positions):
    """Sampled drafts: draft logits [B,M,Vd] -> target ids [B,M] drawn from the draft's
    processed distribution q (its argmax for greedy rows; no penalties: q may be any
    distribution) and log q over the target vocabulary [B,M,V] (-inf off the draft's)."""
    d = plan.draft
    tok, logq_d = sampling.choose_with_log_probs(logits_d, sp, positions, sampling.DRAFT)
    V, Vd = plan.target.vocab_size, logits_d.shape[-1]
    ids = d.to_target_ids(dw, jnp.arange(Vd, dtype=jnp.int32))
    logq = jnp.full(logits_d.shape[:2] + (V,), -jnp.inf, jnp.float32).at[..., ids].set(logq_d)
    return d.to_target_ids(dw, tok), logq


def _draft_step(plan: Plan, tw, dw, pages, dcache, tokens, hidden, positions, prefix_len, local_mask, live):
    """One draft forward over the K newest nodes: tokens [B,K], the draft's own hidden
    [B,K,Dd] as features -> (logits [B,K,Vd], hidden [B,K,Dd], draft cache)."""
    B, K = positions.shape
    Tl = local_mask.shape[-1]
    # Tree levels fill K slots each, level l at position prefix_len + l - 1.
    local_positions = None if Tl == K else prefix_len[:, None] + jnp.arange(Tl, dtype=jnp.int32)[None] // K
    meta = plan.layout.meta(pages, positions=positions, prefix_len=prefix_len, local_mask=local_mask,
                            local_positions=local_positions,
                            write_valid=jnp.broadcast_to(live[:, None], positions.shape))
    d = plan.draft
    h, dcache = d.forward(plan.target, tw, dw, tokens, hidden, dcache, meta, False)
    return d.logits(plan.target, tw, dw, h), h, dcache


def propose_chain(plan: Plan, tw, dw, pages, dcache, first_tokens, first_logq, draft_hidden, L, root, live,
                  sp: sampling.SamplingParams):
    """root [B], first_tokens [B,1], draft_hidden [B,Dd], L [B] -> (draft cache, chain Tree
    of S+1 nodes, the draft's log q [B,S,V] of each drafted token's draw, or None unless
    drafts are sampled; first_logq [B,V] is the first's)."""
    tok, h = first_tokens[:, 0], draft_hidden
    out, logqs = [root, tok], [first_logq]
    one = jnp.ones((root.shape[0], 1, 1), bool)
    for j in range(1, plan.S):
        pos = L + plan.lag + j - 1
        logits_d, hs, dcache = _draft_step(plan, tw, dw, pages, dcache, tok[:, None], h[:, None], pos[:, None],
                                           pos, one, live)
        if plan.sample_drafts:  # the token at sequence position L + j + 1
            t, logq = draw_draft(plan, dw, logits_d, sp, (L + j + 1)[:, None])
            tok = t[:, 0]
            logqs.append(logq[:, 0])
        else:
            tok = plan.draft.to_target_ids(dw, jnp.argmax(logits_d[:, 0], axis=-1).astype(jnp.int32))
        h = hs[:, 0]
        out.append(tok)
    logq = jnp.stack(logqs, axis=1) if plan.sample_drafts else None
    return dcache, chain_tree(jnp.stack(out, axis=1).astype(jnp.int32)), logq


def propose_tree(plan: Plan, tw, dw, pages, dcache, first_tokens, first_probs, draft_hidden, L, root, live):
    """EAGLE-2 dynamic tree: expand the K best nodes of each level by cumulative score;
    keep the best N-1 candidates -> (draft cache, Tree of N nodes)."""
    B, K, S = root.shape[0], plan.K, plan.S
    base = L + plan.lag  # first draft slot of this round
    sel_tok, sel_score, sel_h = first_tokens, first_probs, draft_hidden[:, None].repeat(K, axis=1)
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
        logits_d, hs, dcache = _draft_step(plan, tw, dw, pages, dcache, sel_tok, sel_h, pos, base, local, live)
        vals, idx = vocab_top_k(logits_d, K)  # [B,K,K]
        probs = jnp.exp(vals - jax.nn.logsumexp(logits_d, axis=-1, keepdims=True))
        score = (sel_score[:, :, None] * probs).reshape(B, K * K)
        tok = plan.draft.to_target_ids(dw, idx.astype(jnp.int32)).reshape(B, K * K)
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
