"""The target's log-probabilities of the tokens a loop emits (and of prompt tokens), kept
in the loop state (`jspec.loop.state.TokenLogprobs`) when `Plan.logprobs` > 0.

They are the log-softmax of the target's raw logits at each position (vLLM's default:
before penalties, temperature and filters), taken from the pass that chose the token: a
round's verification (at the nodes of the accepted path) or a prompt pass. No forward runs
for them, and under speculation they equal `jspec.logits` of the sequence up to rounding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.loop.state import TokenLogprobs
from jspec.loop.tree import vocab_top_k


def of_tokens(logits, tokens, k: int):
    """logits [..., V] (the position before each token), tokens [...] -> (log p of each token
    [...], the k most likely ids [..., k] and their log p [..., k], most likely first)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top, ids = vocab_top_k(lp, k)
    return chosen, ids.astype(jnp.int32), top


def record(lp: TokenLogprobs, rows, positions, valid, values) -> TokenLogprobs:
    """Writes values = (chosen [R, E], ids [R, E, k], top [R, E, k]) at buffer positions
    [R, E] of rows [R] (an index past the batch: none) where valid [R, E]."""
    chosen, ids, top = values
    pos = jnp.where(valid, positions, lp.chosen.shape[1])
    at = (rows[:, None], pos)
    return TokenLogprobs(chosen=lp.chosen.at[at].set(chosen, mode="drop"),
                         top_ids=lp.top_ids.at[at].set(ids, mode="drop"),
                         top=lp.top.at[at].set(top, mode="drop"))
