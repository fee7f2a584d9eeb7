"""The accept phase: the longest draft path the target agrees with, plus the bonus token.

Target-only verification (`accept_chain`, `accept_tree`): given the target's choice [B,N]
at every node (its argmax after that node for greedy rows, one draw from its processed
distribution for sampled rows), a node is correct when its token equals its parent's
choice and its parent is correct. The deepest correct node ends the accepted path; the
target's choice there is the bonus token. Every correct node lies on the one sequence of
the target's own choices, so what is emitted is exactly that sequence.

Sampled drafts (`accept_sampled_chain`): the draft token drawn from q at node i is kept
with probability min(1, p/q); at the first rejection the correction is drawn from
max(0, p - q) normalised; after a fully accepted chain the bonus is drawn from p.

Each returns accept_len [B] (nodes committed: root + accepted drafts), path [B,S+1] (node
indices, valid up to accept_len) and bonus [B].
"""
from __future__ import annotations

import jax.numpy as jnp

from jspec import sampling
from jspec.loop.tree import Tree


def accept_chain(tokens, choice, valid):
    """tokens/choice/valid [B,N] of a chain -> (accept_len, path, bonus); no gathers over nodes."""
    B, N = tokens.shape
    ok = (tokens[:, 1:] == choice[:, :-1]) & valid[:, 1:]  # [B,S]
    m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # accepted drafts
    bonus = jnp.take_along_axis(choice, m[:, None], axis=1)[:, 0]
    path = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[None], (B, N))
    return (m + 1).astype(jnp.int32), path, bonus


def accept_tree(tree: Tree, choice, max_depth: int):
    """Tree acceptance, vectorised over nodes (S rounds of parent lookups)."""
    B, N = tree.tokens.shape
    p = jnp.maximum(tree.parents, 0)
    is_root = tree.parents < 0
    ok_self = is_root | ((tree.tokens == jnp.take_along_axis(choice, p, axis=1)) & tree.valid)
    correct = ok_self
    for _ in range(max_depth):
        correct = ok_self & (is_root | jnp.take_along_axis(correct, p, axis=1))
    best = jnp.argmax(jnp.where(correct, tree.depth, -1), axis=1)  # [B]
    accept_len = jnp.take_along_axis(tree.depth, best[:, None], axis=1)[:, 0] + 1
    on_path = jnp.take_along_axis(tree.anc, best[:, None, None], axis=1)[:, 0]  # [B,N]
    rank = jnp.cumsum(on_path, axis=1) - 1  # nodes on the path, in index (= depth) order
    S1 = max_depth + 1
    path = jnp.zeros((B, S1), jnp.int32)
    dest = jnp.where(on_path, rank, S1)
    path = path.at[jnp.arange(B)[:, None], dest].set(jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N)),
                                                     mode="drop")
    bonus = jnp.take_along_axis(choice, best[:, None], axis=1)[:, 0]
    return accept_len.astype(jnp.int32), path, bonus


def accept_sampled_chain(tokens, logits, logq, sp: sampling.SamplingParams, hist: sampling.History, anc, L, valid):
    """A chain with sampled drafts. tokens [B,N]; logits [B,N,V] the target's; logq
    [B,S,V] the draft's log q of each drafted token's draw; hist, anc [B,N,N] the
    penalties' context; L [B] (the root's position). Greedy rows are verified target-only
    against the argmax of their penalised logits."""
    B, N = tokens.shape
    S = N - 1
    path = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[None], (B, N))
    z = sampling.penalise(logits, sp, hist, tokens, anc)
    greedy_len, _, greedy_bonus = accept_chain(tokens, jnp.argmax(z, axis=-1).astype(jnp.int32), valid)
    logp = sampling.log_probs(z, sp)  # [B,N,V]
    drafted = tokens[:, 1:, None]
    lp = jnp.take_along_axis(logp[:, :S], drafted, axis=2)[..., 0]  # [B,S] p_i(d_i+1)
    lq = jnp.take_along_axis(logq, drafted, axis=2)[..., 0]
    u = sampling.uniform(sp.seed, L[:, None] + 1 + jnp.arange(S)[None], sampling.ACCEPT)
    keep = (u * jnp.exp(lq) < jnp.exp(lp)) & valid[:, 1:]  # p = 0: never kept; u in [0, 1)
    m = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)  # [B] accepted drafts
    p_m = jnp.exp(jnp.take_along_axis(logp, m[:, None, None], axis=1)[:, 0])  # [B,V]
    logq_end = jnp.concatenate([logq, jnp.full((B, 1, logq.shape[2]), -jnp.inf, logq.dtype)], axis=1)
    q_m = jnp.exp(jnp.take_along_axis(logq_end, m[:, None, None], axis=1)[:, 0])  # 0 past the chain
    resid = jnp.maximum(p_m - q_m, 0)
    # p == q leaves no residual (a rejection there has probability 0): draw from p then.
    resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p_m)
    bonus = sampling.draw_from(jnp.log(resid), sp.seed, L + m + 1)
    on = sp.temperature > 0
    return jnp.where(on, m + 1, greedy_len).astype(jnp.int32), path, jnp.where(on, bonus, greedy_bonus)
