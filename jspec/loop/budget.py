"""Confidence-budgeted verification (`SpecConfig.verify_lengths`): a round drafts its whole
chain of S, then verifies only its first l drafts, l chosen on device from the drafts'
estimated survival (`Tree.survival`) and the relative cost of a round at each length.

Row r's survival s_r[j] is the proposer's estimate that its drafts 1..j are all accepted
(the cumulative product of the draft's probability of each drafted token, each raised to
`SpecConfig.survival_power`: a calibration of the drafter's confidence), so verifying
its first l drafts is expected to commit E_r(l) = 1 + s_r[1] + ... + s_r[l] tokens. A
round verifies the l, among the SpecConfig's choices (verify_lengths, then S), with the
most expected tokens over the batch's active rows per unit of cost:
sum_r E_r(l) / cost(l), one l for the batch (the verification is one static-shape pass),
cost(l) read from the SpecConfig's costs at the round's number of active rows.
A row that does not speculate commits one token whatever l is. Every length verifies
exactly, so the choice moves only the work a round does, never the output.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import SpecConfig
from jspec.loop.tree import Tree, chain_tree


def chain_survival(draft_logp, power: float = 1.0):
    """draft_logp [B,S]: the draft's log-probability of each drafted token -> survival
    [B,S+1] of the chain's nodes (the root's 1), each probability raised to `power`
    (`SpecConfig.survival_power`) first."""
    B = draft_logp.shape[0]
    logs = jnp.cumsum(draft_logp.astype(jnp.float32) * power, axis=1)
    return jnp.concatenate([jnp.ones((B, 1), jnp.float32), jnp.exp(logs)], axis=1)


def expected_tokens(survival, active, drafting, choices: tuple[int, ...]):
    """survival [B,S+1] (`Tree.survival` of a chain), active [B] rows in the round, drafting
    [B] those whose drafts may be accepted -> [C] the tokens the active rows are expected
    to commit when a round verifies each of `choices` drafts."""
    kept = jnp.where(drafting[:, None], survival[:, 1:], 0.0)  # [B,S]
    per_length = jnp.cumsum(jnp.sum(kept, axis=0))  # [S]: sum over rows of s_r[1..l]
    rows = jnp.sum(active.astype(jnp.float32))
    return rows + per_length[np.asarray(choices) - 1]  # host-ok: static choices


def costs_at(rows, spec: SpecConfig):
    """The round costs [C] of `spec.verify_choices` with `rows` (a traced count) running:
    `spec.cost_table` interpolated linearly between its row counts, clamped at the ends."""
    counts, table = spec.cost_table
    table = np.asarray(table, np.float32)  # host-ok: the SpecConfig's constants, [R, C]
    if len(counts) == 1:
        return jnp.asarray(table[0])  # host-ok: a constant
    xp = np.asarray(counts, np.float32)  # host-ok: the SpecConfig's constants
    return jax.vmap(lambda column: jnp.interp(rows, xp, column), in_axes=1)(table)


def choose(survival, active, drafting, spec: SpecConfig):
    """The index, into `spec.verify_choices`, of the length a round verifies (the module
    docstring) -> int32 []. Ties go to the shorter length."""
    costs = costs_at(jnp.sum(active.astype(jnp.float32)), spec)
    rates = expected_tokens(survival, active, drafting, spec.verify_choices) / costs
    return jnp.argmax(rates).astype(jnp.int32)


def truncated(tree: Tree, logq, length: int):
    """A chain's first `length` drafts under its root -> (Tree of length + 1 nodes, log q
    [B,length,V] of sampled drafts or None)."""
    n = length + 1
    states = None if tree.states is None else tree.states[:, :n]
    survival = None if tree.survival is None else tree.survival[:, :n]
    return (chain_tree(tree.tokens[:, :n], tree.valid[:, :n], states, survival),
            None if logq is None else logq[:, :length])
