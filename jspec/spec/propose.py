"""The draft phase: S draft steps propose a chain (K = 1) or an EAGLE-2 tree (K > 1).

The first level of a round (the root's K children) was computed by the previous round's
draft-extend (`first_level`); each further step runs the draft over the K newest nodes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.spec.plan import Plan
from jspec.spec.tree import chain_tree, select_tree, vocab_top_k


def first_level(plan: Plan, dw, logits_d):
    """Draft logits [B,Vd] at the newest slot -> the root's children: target ids [B,K]
    and draft probabilities [B,K] (a chain takes the argmax and needs no probabilities)."""
    d = plan.draft
    if plan.K == 1:
        tok = d.to_target_ids(dw, jnp.argmax(logits_d, axis=-1).astype(jnp.int32))
        return tok[:, None], jnp.ones_like(tok, jnp.float32)[:, None]
    vals, idx = vocab_top_k(logits_d, plan.K)
    probs = jnp.exp(vals - jax.nn.logsumexp(logits_d, axis=-1, keepdims=True))
    return d.to_target_ids(dw, idx.astype(jnp.int32)), probs


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


def propose_chain(plan: Plan, tw, dw, pages, dcache, first_tokens, draft_hidden, L, root, live):
    """root [B], first_tokens [B,1], draft_hidden [B,Dd], L [B] -> (draft cache, chain Tree
    of S+1 nodes)."""
    tok, h = first_tokens[:, 0], draft_hidden
    out = [root, tok]
    one = jnp.ones((root.shape[0], 1, 1), bool)
    for j in range(1, plan.S):
        pos = L + plan.lag + j - 1
        logits_d, hs, dcache = _draft_step(plan, tw, dw, pages, dcache, tok[:, None], h[:, None], pos[:, None],
                                           pos, one, live)
        tok = plan.draft.to_target_ids(dw, jnp.argmax(logits_d[:, 0], axis=-1).astype(jnp.int32))
        h = hs[:, 0]
        out.append(tok)
    return dcache, chain_tree(jnp.stack(out, axis=1).astype(jnp.int32))


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
