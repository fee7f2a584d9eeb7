"""The accept phase, greedy: the longest draft path the target agrees with, plus the bonus token.

Given the target's choice `a` [B,N] at every node (its argmax after that node), a node is
correct when its token equals its parent's choice and its parent is correct. The deepest
correct node ends the accepted path; the target's choice there is the bonus token.
Returns accept_len [B] (nodes committed: root + accepted drafts), path [B,S+1] (node
indices, valid up to accept_len) and bonus [B].
"""
from __future__ import annotations

import jax.numpy as jnp

from jspec.spec.tree import Tree


def accept_chain(tokens, choice):
    """tokens/choice [B,N] of a chain -> (accept_len, path, bonus); no gathers over nodes."""
    B, N = tokens.shape
    ok = tokens[:, 1:] == choice[:, :-1]  # [B,S]
    m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # accepted drafts
    bonus = jnp.take_along_axis(choice, m[:, None], axis=1)[:, 0]
    path = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[None], (B, N))
    return (m + 1).astype(jnp.int32), path, bonus


def accept_tree(tree: Tree, choice, max_depth: int):
    """Tree acceptance, vectorised over nodes (S rounds of parent lookups)."""
    B, N = tree.tokens.shape
    p = jnp.maximum(tree.parents, 0)
    is_root = tree.parents < 0
    ok_self = is_root | (tree.tokens == jnp.take_along_axis(choice, p, axis=1))
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
