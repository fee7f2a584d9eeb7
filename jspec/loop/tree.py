"""Draft trees as static-shape arrays.

A tree of N nodes (node 0 = the root, the last committed-but-unverified token) is
  tokens [B,N]   token ids (target vocabulary)
  parents [B,N]  parent node index (-1 for the root); parents precede children
  depth [B,N]    0 for the root
  anc [B,N,N]    anc[b, i, j]: node j is node i or one of its ancestors
  valid [B,N]    the node was proposed (the root always is); a node that was not is a
                 placeholder under the root that acceptance never takes
  states [B,N]   (optional) each node's constraint state, the state after its token (the
                 root's: its row's), where the proposer followed the constraint along its
                 drafts; None: acceptance computes them (`constraints.tables.node_states`)
  survival [B,N] (optional) the proposer's estimate of each node's chance of acceptance
                 (its path's drafts all accepted; the root's 1), for confidence-budgeted
                 verification (`jspec.loop.budget`); None: the proposer makes none
A chain is the tree 0 <- 1 <- ... <- S; its structure is a constant.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.util import cdiv


@struct.dataclass
class Tree:
    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    anc: jax.Array
    valid: jax.Array
    states: jax.Array | None = None
    survival: jax.Array | None = None


@functools.lru_cache(maxsize=None)
def chain_structure(num_nodes: int):
    """Constant parents, depth and ancestor mask of a chain of `num_nodes` (numpy)."""
    parents = np.arange(num_nodes, dtype=np.int32) - 1
    depth = np.arange(num_nodes, dtype=np.int32)
    anc = np.tril(np.ones((num_nodes, num_nodes), bool))
    return parents, depth, anc


def chain_tree(tokens, valid=None, states=None, survival=None) -> Tree:
    """tokens [B,N] of a chain; valid [B,N] (None: every node proposed); states [B,N]:
    each node's constraint state, if the proposer has them; survival [B,N]: `Tree`'s."""
    B, N = tokens.shape
    parents, depth, anc = chain_structure(N)
    bc = lambda a: jnp.broadcast_to(jnp.asarray(a), (B,) + a.shape)  # host-ok: a numpy constant, traced in
    valid = bc(np.ones((N,), bool)) if valid is None else valid
    return Tree(tokens=tokens, parents=bc(parents), depth=bc(depth), anc=bc(anc), valid=valid, states=states,
                survival=survival)


def ancestors(parents, max_depth: int):
    """parents [B,N] (topologically ordered) -> (depth [B,N], anc [B,N,N])."""
    B, N = parents.shape
    eye = jnp.eye(N, dtype=bool)[None]
    p = jnp.maximum(parents, 0)
    is_root = parents < 0
    depth = jnp.zeros((B, N), jnp.int32)
    anc = jnp.broadcast_to(eye, (B, N, N))
    for _ in range(max_depth):
        depth = jnp.where(is_root, 0, jnp.take_along_axis(depth, p, axis=1) + 1)
        parent_anc = jnp.take_along_axis(anc, p[:, :, None], axis=1)
        anc = eye | jnp.where(is_root[:, :, None], False, parent_anc)
    return depth, anc


def vocab_top_k(x, k: int, chunk: int = 512):
    """`lax.top_k` over a wide last axis (a vocabulary), in two stages: the top k of each
    chunk of `chunk` entries, then the top k of those. Same values as `lax.top_k`, and the
    same indices wherever the values are distinct. XLA's GPU top-k gives each row one
    thread block, so the few rows of a draft step (K of them) over 32k-128k entries took
    ~55 us a call on the H200; chunks give it enough rows to fill the GPU. Below 8 chunks
    it is plain `lax.top_k` (rows are short; the split was not measured to pay there)."""
    V = x.shape[-1]
    if V < 8 * chunk or k > chunk:
        return jax.lax.top_k(x, k)
    C = cdiv(V, chunk)
    lead = x.shape[:-1]
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, C * chunk - V)], constant_values=-jnp.inf)
    v1, i1 = jax.lax.top_k(xp.reshape(lead + (C, chunk)), k)  # [..., C, k]
    i1 = i1 + (jnp.arange(C, dtype=i1.dtype) * chunk)[:, None]
    v2, j = jax.lax.top_k(v1.reshape(lead + (C * k,)), k)
    return v2, jnp.take_along_axis(i1.reshape(lead + (C * k,)), j, axis=-1)


def select_tree(root, cand_tokens, cand_scores, cand_parents, num_nodes: int, max_depth: int) -> Tree:
    """Keeps the best num_nodes-1 candidates by cumulative score under the root.

    root [B]; cand_tokens/cand_scores/cand_parents [B,M]: candidates in level order, each
    parent a candidate index (-1: the root). A child never outscores its parent, so the
    kept set is closed under parents; keeping index order keeps parents first.
    """
    B, M = cand_tokens.shape
    _, top = jax.lax.top_k(cand_scores, num_nodes - 1)
    top = jnp.sort(top, axis=-1)  # [B, N-1], level order
    tokens = jnp.take_along_axis(cand_tokens, top, axis=1)
    pc = jnp.take_along_axis(cand_parents, top, axis=1)  # parent candidate ids
    match = pc[:, :, None] == top[:, None, :]  # [B, N-1, N-1]
    parent_node = jnp.where(pc < 0, 0, jnp.argmax(match, axis=-1) + 1)
    parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parent_node.astype(jnp.int32)], axis=1)
    depth, anc = ancestors(parents, max_depth)
    return Tree(tokens=jnp.concatenate([root[:, None], tokens], axis=1).astype(jnp.int32),
                parents=parents, depth=depth, anc=anc, valid=jnp.ones((B, num_nodes), bool))
