"""Token choice from logits: greedy, or sampling with per-request temperature/top-k/top-p.

Sampling parameters are arrays [B] so changing their values never recompiles. A row with
temperature 0 is greedy (argmax, as transformers). Each row draws from its own key, derived
from its seed and a counter, so a request's output does not depend on its batch mates.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seeds, counter):
    """seeds [B] int32, counter int -> [B] PRNG keys (fold_in of the seed's key)."""
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.PRNGKey(s), counter))(seeds)


def filter_logits(logits, temperature, top_k, top_p):
    """Scaled log-probabilities [B,V] with everything outside top-k / top-p at -inf.

    top_k [B] int (0: off), top_p [B] float (1.0: off); temperature [B] > 0.
    """
    V = logits.shape[-1]
    x = logits / jnp.maximum(temperature, 1e-6)[:, None]
    srt = -jnp.sort(-x, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)  # [B,1]
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    keep_sorted = before < top_p[:, None]
    n_keep = jnp.maximum(keep_sorted.sum(-1), 1)
    pth = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(x >= threshold, x, -jnp.inf)


def sample(logits, temperature, top_k, top_p, seeds, counter):
    """logits [B,V] float32 -> token ids [B] int32 (greedy where temperature == 0).

    Row b draws with the key `row_keys(seeds, counter)[b]`, derived only when some row
    samples: an all-greedy step runs the argmax alone."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        keys = row_keys(seeds, counter)
        x = filter_logits(logits, temperature, top_k, top_p)
        drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, x).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
