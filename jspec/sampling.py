"""Token choice from the target's (or the draft's) logits: greedy or sampled, with penalties,
temperature, top-k, top-p and min-p, per request.

Every parameter is an array [B] (`SamplingParams`), so new values never recompile. A row
with temperature 0 is greedy: the argmax of its penalised logits.

Processing, in this order, at a position whose context holds the prompt P and the tokens
G generated before it (the same at every position a loop verifies, drafts included):
  1. repetition penalty r (1: off), on tokens in P or G: z / r where z > 0, else z * r;
  2. frequency f and presence pr (0: off), on generated tokens: z - f*count_G - pr*[count_G > 0];
  3. temperature T: x = z / T;
  4. top-k k (0: off): keep x >= the k-th largest x;
  5. top-p p (1: off): over the top-k-kept distribution, keep the smallest set of largest
     entries whose mass reaches p (an entry is kept iff the mass strictly above it < p);
  6. min-p m (0: off): keep x >= max(x) + log(m);
and the token is drawn from softmax(x) over what is kept. Ties at a threshold are kept.

Top-k and top-p find their thresholds without sorting: an exact 16-ary search over the 32
bits of the values' order-preserving integer keys, 8 passes over the row that each read
only the logits and weigh 16 thresholds at once (a full-row top-k or sort would cost far
more at 128k entries); each search runs only when some row asks for it.

Randomness is keyed by (seed, position, stream): the noise for the token at sequence
position t of a request comes from fold_in(fold_in(key(seed), t), stream) alone, so a
request's output does not depend on its batch mates or its row, and every stream (the
target's choice, the draft's samples, the acceptance uniforms) is independent of the
others. A choice is a Gumbel-max draw, argmax(x + g): the target's choice at position t
uses the same noise in plain decoding and in every speculative round, which makes
target-only verification emit exactly the tokens plain sampling emits for the same seed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

TARGET, DRAFT, ACCEPT = 0, 1, 2  # noise streams
_PROBES = 16  # candidate thresholds per search pass (4 bits)


@struct.dataclass
class SamplingParams:
    """Per-request sampling values, each [B]; the neutral value turns a step off."""

    temperature: jax.Array  # float32 (0: greedy)
    top_k: jax.Array  # int32 (0: off)
    top_p: jax.Array  # float32 (1: off)
    min_p: jax.Array  # float32 (0: off)
    repetition_penalty: jax.Array  # float32 (1: off)
    presence_penalty: jax.Array  # float32 (0: off)
    frequency_penalty: jax.Array  # float32 (0: off)
    seed: jax.Array  # int32


@struct.dataclass
class History:
    """What the penalties read: per request, the prompt's tokens and the generated counts."""

    in_prompt: jax.Array  # [B, V] bool
    counts: jax.Array  # [B, V] int32 times each token was generated


def init_history(prompt, prompt_len, V: int) -> History:
    """prompt [B,Tp] (right-padded), prompt_len [B] -> History with no generated tokens."""
    B, T = prompt.shape
    valid = jnp.arange(T)[None, :] < prompt_len[:, None]
    in_prompt = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], jnp.where(valid, prompt, V)].set(
        True, mode="drop")
    return History(in_prompt=in_prompt, counts=jnp.zeros((B, V), jnp.int32))


def record(hist: History, tokens, valid) -> History:
    """Counts tokens [B,E] where valid [B,E] as generated."""
    V = hist.counts.shape[1]
    rows = jnp.arange(tokens.shape[0])[:, None]
    return hist.replace(counts=hist.counts.at[rows, jnp.where(valid, tokens, V)].add(1, mode="drop"))


# --------------------------------------------------------------------------- penalties

def any_processing(sp: SamplingParams, penalties: bool = True):
    """Does some row sample (or, with penalties, have one)? Else the argmax of the raw
    logits is every row's choice: the loop branches on this once per choice, so greedy
    batches skip everything else."""
    some = jnp.any(sp.temperature > 0)
    if penalties:
        some |= jnp.any((sp.repetition_penalty != 1) | (sp.presence_penalty != 0) | (sp.frequency_penalty != 0))
    return some


def _penalise(z, count, seen, r, pres, freq):
    """The penalties on logits z given count (generated) and seen (prompt or generated);
    r, pres, freq broadcast against z."""
    z = jnp.where(seen, jnp.where(z > 0, z / r, z * r), z)
    return z - freq * count.astype(z.dtype) - pres * (count > 0).astype(z.dtype)


def penalise(logits, sp: SamplingParams, hist: History, tokens=None, anc=None):
    """logits [B,N,V] at the N nodes of a tree -> penalised logits. The context of node i
    is the history plus the nodes on its path below the root (anc [B,N,N], tokens [B,N];
    None: no nodes beyond the history)."""
    B, N, V = logits.shape
    col = lambda a: a[:, None, None]
    out = _penalise(logits, hist.counts[:, None, :], (hist.in_prompt | (hist.counts > 0))[:, None, :],
                    col(sp.repetition_penalty), col(sp.presence_penalty), col(sp.frequency_penalty))
    if tokens is None or N == 1:
        return out
    # Node i's path adds its tokens t_j (j an ancestor-or-self of i, not the root): their
    # entries of row i are recomputed from the raw logits with the path's counts.
    on_path = anc & (jnp.arange(N) > 0)[None, None, :]  # [B,N(i),N(j)]
    same = tokens[:, :, None] == tokens[:, None, :]  # [B,N(j),N(k)]
    extra = jnp.einsum("bik,bjk->bij", on_path.astype(jnp.int32), same.astype(jnp.int32))  # [B,i,j]
    count = jnp.take_along_axis(hist.counts, tokens, axis=1)[:, None, :] + extra  # [B,i,j]
    raw = jnp.take_along_axis(logits, jnp.broadcast_to(tokens[:, None, :], (B, N, N)), axis=2)  # z[b,i,t_j]
    fixed = _penalise(raw, count, count > 0, col(sp.repetition_penalty), col(sp.presence_penalty),
                      col(sp.frequency_penalty))
    bi = (jnp.arange(B)[:, None, None], jnp.arange(N)[None, :, None])
    dest = jnp.where(on_path, tokens[:, None, :], V)
    return out.at[bi[0], bi[1], dest].set(fixed, mode="drop")


# --------------------------------------------------------------------------- filters

def _order_keys(x):
    """float32 -> uint32 keys with the same order (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_order_key(k):
    """Inverse of `_order_keys`."""
    bits = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_value_reaching(x, weigh, target):
    """x [R,V], weigh(x) -> weights [R,V] (computed inside each pass: only x is read),
    target [R] -> the largest value t with sum(weigh(x) where x >= t) >= target (the
    search's invariant: the lowest key reaches it). Eight passes, each weighing 16
    candidates for the next 4 bits of t's order key."""
    found = jnp.zeros(x.shape[:1], jnp.uint32)
    digits = jnp.arange(_PROBES, dtype=jnp.uint32)
    for shift in range(28, -1, -4):
        probes = found[:, None] | (digits[None, :] << shift)  # [R,16]
        keys, w = _order_keys(x), weigh(x)
        mass = jnp.sum(jnp.where(keys[:, :, None] >= probes[:, None, :], w[:, :, None], 0), axis=1)
        reach = jnp.sum((mass >= target[:, None]).astype(jnp.int32), axis=1)  # reaching probes: a prefix
        found = found | (jnp.maximum(reach - 1, 0).astype(jnp.uint32) << shift)
    # Key 0 lies below every value: only a target that rounding put out of reach ends there.
    return jnp.where(found == 0, -jnp.inf, _from_order_key(found))


def filter_logits(x, top_k, top_p, min_p):
    """Scaled logits x [R,V] -> x with what top-k, top-p and min-p drop at -inf (rows [R]
    of parameters; the neutral values keep everything). Each threshold search runs only
    when some row asks for it."""
    V = x.shape[-1]

    def by_top_k(x):
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V).astype(jnp.float32)
        t = _largest_value_reaching(x, jnp.ones_like, k)
        return jnp.where((top_k[:, None] > 0) & (x < t[:, None]), -jnp.inf, x)

    def by_top_p(x):
        top = jnp.max(x, axis=-1, keepdims=True)
        weigh = lambda v: jnp.exp(v - top)
        t = _largest_value_reaching(x, weigh, top_p * jnp.sum(weigh(x), axis=-1))
        return jnp.where((top_p[:, None] < 1) & (x < t[:, None]), -jnp.inf, x)

    x = jax.lax.cond(jnp.any(top_k > 0), by_top_k, lambda x: x, x)
    x = jax.lax.cond(jnp.any(top_p < 1), by_top_p, lambda x: x, x)
    floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]  # log(0) = -inf: off
    return jnp.where(x >= floor, x, -jnp.inf)


def processed(logits, sp: SamplingParams):
    """Penalised logits [B,N,V] -> the filtered, temperature-scaled logits of sampled rows
    (log-probabilities up to a constant; greedy rows are left as they are)."""
    B, N, V = logits.shape
    t = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
    rep = lambda a: jnp.repeat(a, N)
    x = filter_logits((logits / t[:, None, None]).reshape(B * N, V), rep(sp.top_k), rep(sp.top_p), rep(sp.min_p))
    return x.reshape(B, N, V)


# --------------------------------------------------------------------------- noise

def keys(seed, positions, stream: int):
    """seed [B], positions [B,N] -> PRNG keys [B,N] for that stream."""
    def one(s, pos):
        base = jax.random.PRNGKey(s)
        return jax.vmap(lambda p: jax.random.fold_in(jax.random.fold_in(base, p), stream))(pos)
    return jax.vmap(one)(seed, positions)


def gumbel(seed, positions, stream: int, V: int):
    """Gumbel noise [B,N,V] (finite: never -inf, so a lone kept token always wins)."""
    k = keys(seed, positions, stream)
    return jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32)))(k)


def uniform(seed, positions, stream: int):
    """Uniforms [B,N] in [0, 1)."""
    k = keys(seed, positions, stream)
    return jax.vmap(jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32)))(k)


# --------------------------------------------------------------------------- choice

def choose(logits, sp: SamplingParams, positions, hist: History, tokens=None, anc=None):
    """The target's choice at every node: logits [B,N,V] -> [B,N] int32, after the
    penalties for each node's context (`penalise`): the argmax for greedy rows, a draw from
    the processed distribution (the target's noise for `positions` [B,N]) for sampled rows."""
    def processed_choice(_):
        z = penalise(logits, sp, hist, tokens, anc)
        x = processed(z, sp) + gumbel(sp.seed, positions, TARGET, logits.shape[-1])
        drawn = jnp.argmax(x, axis=-1).astype(jnp.int32)
        return jnp.where(sp.temperature[:, None] > 0, drawn, jnp.argmax(z, axis=-1).astype(jnp.int32))

    return jax.lax.cond(any_processing(sp), processed_choice,
                        lambda _: jnp.argmax(logits, axis=-1).astype(jnp.int32), None)


def log_probs(logits, sp: SamplingParams):
    """Penalised logits [B,N,V] -> log-probabilities of the processed distributions [B,N,V]
    (sampled rows; -inf where filtered out)."""
    return jax.nn.log_softmax(processed(logits, sp), axis=-1)


def choose_with_log_probs(logits, sp: SamplingParams, positions, stream: int):
    """`choose` without penalties, also returning the processed log-probabilities [B,N,V]
    the draws came from (zeros when no row samples: then nothing reads them)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        logp = log_probs(logits, sp)
        drawn = jnp.argmax(logp + gumbel(sp.seed, positions, stream, logits.shape[-1]), axis=-1).astype(jnp.int32)
        return jnp.where(sp.temperature[:, None] > 0, drawn, greedy), logp

    return jax.lax.cond(any_processing(sp, penalties=False), draw,
                        lambda _: (greedy, jnp.zeros(logits.shape, jnp.float32)),
                        None)


def draw_from(logp, seed, positions, stream: int = TARGET):
    """A Gumbel-max draw [B] from log-probabilities logp [B,V] (unnormalised is fine)."""
    g = gumbel(seed, positions[:, None], stream, logp.shape[-1])[:, 0]
    return jnp.argmax(logp + g, axis=-1).astype(jnp.int32)
