"""N-gram drafts (prompt lookup): the row's own tokens propose what follows, on device,
with no weights.

For each row, the suffix of its sequence (prompt and generated tokens up to the root) is
looked up among its earlier tokens: an earlier occurrence of the last n tokens, for n
from `max_n` down to `min_n`, proposes the tokens that followed it. Candidates are
ranked by their match length n, then by recency (the later occurrence first):

- a chain (topk = 1) drafts the S tokens after the best candidate;
- a tree (topk = K > 1) takes the K best candidates (distinct positions) and merges
  their continuations into a trie: the best candidate's whole continuation first, then
  each next candidate's tokens from where it leaves the ones before, until the tree
  holds N nodes. A token two candidates share is one node.

A continuation that runs into the suffix itself repeats the matched period (the match
ending p tokens before the root proposes the last p tokens again, cyclically), as if the
drafted tokens were part of the history. A row with no match (a short history, nothing
repeated) proposes no node: its round verifies the root alone among placeholders that
are never accepted, and emits the target's own token. Verification is target-only, so
greedy output equals plain greedy output and sampled output has the target's
distribution whatever the lookup proposes.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jspec.config import SpecConfig
from jspec.loop.proposers.base import Proposer
from jspec.loop.tree import Tree, ancestors, chain_tree

MAX_N = 64  # the longest n-gram a lookup compares (each n is one pass over the row)


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"NgramDraft.{name} must be an int >= 1, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class NgramDraft(Proposer):
    """Prompt-lookup drafts: match the last n tokens (n = max_n .. min_n) of each row's
    sequence against its earlier tokens and propose what followed (see the module
    docstring). `jspec.load(target_dir, draft="ngram")` uses the defaults."""

    kind: ClassVar[str] = "ngram"
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self):
        _positive_int("min_n", self.min_n)
        _positive_int("max_n", self.max_n)
        if self.min_n > self.max_n:
            raise ValueError(f"NgramDraft: min_n ({self.min_n}) must be at most max_n ({self.max_n})")
        if self.max_n > MAX_N:
            raise ValueError(f"NgramDraft.max_n must be at most {MAX_N}, got {self.max_n}")

    def default_spec(self) -> SpecConfig:
        return SpecConfig(num_steps=5, topk=1, num_draft_tokens=6)

    def check_spec(self, spec: SpecConfig) -> None:
        if spec.sample_drafts:
            raise ValueError("SpecConfig.sample_drafts needs a draft model's distribution; n-gram drafts have none "
                             "(they are verified target-only, which samples exactly the target's distribution)")
        most = spec.topk * spec.num_steps
        if spec.num_draft_tokens - 1 > most:
            raise ValueError(f"SpecConfig.num_draft_tokens={spec.num_draft_tokens}: an n-gram tree of topk={spec.topk} "
                             f"candidates of num_steps={spec.num_steps} tokens has at most {most} nodes besides the "
                             f"root; num_draft_tokens must be at most {most + 1}")

    def propose(self, plan, tw, pw, state, st, active):
        return state, ngram_tree(st.tokens, st.L, self.min_n, self.max_n, plan.S, plan.K, plan.N), None


def best_matches(tokens, L, min_n: int, max_n: int, count: int):
    """tokens [B,W] (row b's sequence in tokens[b, :L+1], its root at L), L [B] -> (ends
    [B,count]: the last index j < L of each of the `count` best earlier occurrences of
    the row's suffix, found [B,count]). An occurrence of length n has tokens[j-i] ==
    tokens[L-i] for i < n, n >= min_n (at most max_n compared); the best have the largest
    n, then the largest j."""
    B, W = tokens.shape
    back = L[:, None] - jnp.arange(max_n, dtype=jnp.int32)[None, :]  # [B, max_n]
    suffix = jnp.where(back >= 0, jnp.take_along_axis(tokens, jnp.maximum(back, 0), axis=1), -1)  # -1: no token
    run = jnp.ones((B, W), bool)
    length = jnp.zeros((B, W), jnp.int32)  # [B, W] how many of the suffix's tokens end at j
    for i in range(max_n):
        shifted = jnp.pad(tokens[:, : W - i], ((0, 0), (i, 0)), constant_values=-2) if i else tokens  # tokens[j - i]
        run = run & (shifted == suffix[:, i:i + 1])
        length = length + run.astype(jnp.int32)
    j = jnp.arange(W, dtype=jnp.int32)[None, :]
    score = jnp.where((j < L[:, None]) & (length >= min_n), length * W + j, -1)
    if count == 1:
        best = jnp.max(score, axis=1, keepdims=True)
    else:
        best, _ = jax.lax.top_k(score, count)
    return best % W, best >= 0


def continuations(tokens, L, ends, steps: int):
    """The `steps` tokens after each match end j (ends [B,M]) -> [B,M,steps]: tokens[j+1+d],
    repeating the period p = L - j where the continuation reaches past the root."""
    period = jnp.maximum(L[:, None] - ends, 1)[:, :, None]  # [B,M,1]
    d = jnp.arange(steps, dtype=jnp.int32)[None, None, :]
    idx = jnp.minimum(ends[:, :, None] + 1 + d % period, tokens.shape[1] - 1)  # (no match: any index)
    B, M, _ = idx.shape
    return jnp.take_along_axis(tokens, idx.reshape(B, M * steps), axis=1).reshape(B, M, steps)


def ngram_tree(tokens, L, min_n: int, max_n: int, steps: int, topk: int, num_nodes: int) -> Tree:
    """The drafts of every row as a Tree of num_nodes nodes (see the module docstring)."""
    ends, found = best_matches(tokens, L, min_n, max_n, topk)
    root = jnp.take_along_axis(tokens, L[:, None], axis=1)  # [B,1]
    cont = continuations(tokens, L, ends, steps)  # [B,K,S]
    if topk == 1:
        valid = jnp.concatenate([jnp.ones_like(found), jnp.broadcast_to(found, cont[:, 0].shape)], axis=1)
        return chain_tree(jnp.concatenate([root, cont[:, 0]], axis=1), valid)
    return _trie(root[:, 0], cont, found, num_nodes, steps)


def _trie(root, cont, found, num_nodes: int, steps: int) -> Tree:
    """Candidates' continuations cont [B,K,S] (found [B,K]) merged into a Tree: node (m, d)
    is candidate m's token at depth d + 1 unless an earlier candidate has the same tokens
    up to d (then it is that one's node); nodes are numbered in (m, d) order, which puts
    every parent first, and the first num_nodes - 1 are kept."""
    B, K, S = cont.shape
    same = (cont[:, :, None, :] == cont[:, None, :, :]) & found[:, None, :, None]  # [B,m,m',S]
    prefix = jnp.cumprod(same.astype(jnp.int32), axis=3).astype(bool)  # equal up to d
    owner = jnp.argmax(prefix, axis=2)  # [B,K,S] the first candidate with the same prefix
    exists = found[:, :, None] & (owner == jnp.arange(K)[None, :, None])
    flat = exists.reshape(B, K * S)
    rank = jnp.cumsum(flat.astype(jnp.int32), axis=1) - 1  # [B, K*S]
    keep = flat & (rank < num_nodes - 1)
    node = jnp.where(keep, rank + 1, num_nodes).reshape(B, K, S)  # node index; num_nodes: dropped
    # parent of (m, d): the node of (owner[m, d-1], d-1), the root for d = 0
    up_owner = owner[:, :, :-1]  # [B,K,S-1]
    up_node = jnp.take_along_axis(node[:, :, :-1], up_owner, axis=1)  # node of (owner, d-1) at [B,m,d-1]
    parent = jnp.concatenate([jnp.zeros((B, K, 1), jnp.int32), up_node], axis=2)
    b = jnp.arange(B)[:, None]
    dest = node.reshape(B, K * S)
    tokens = jnp.zeros((B, num_nodes), jnp.int32).at[:, 0].set(root)
    tokens = tokens.at[b, dest].set(cont.reshape(B, K * S), mode="drop")
    parents = jnp.zeros((B, num_nodes), jnp.int32).at[:, 0].set(-1)
    parents = parents.at[b, dest].set(parent.reshape(B, K * S), mode="drop")
    valid = jnp.zeros((B, num_nodes), bool).at[:, 0].set(True).at[b, dest].set(True, mode="drop")
    depth, anc = ancestors(parents, steps)
    return Tree(tokens=tokens, parents=parents, depth=depth, anc=anc, valid=valid)
