"""Token choice from the target's (or the draft's) logits: greedy or sampled, with penalties,
temperature, top-k, top-p and min-p, per request.

Every parameter is an array [B] (`SamplingParams`), so new values never recompile. A row
with temperature 0 is greedy: the argmax of its penalised logits.

Processing, in this order, at a position whose context holds the prompt P and the tokens
G generated before it (the same at every position a loop verifies, drafts included):
  0. min_tokens (a request value beside its stop ids, applied by the loop with
     `bar_tokens`): while fewer than min_tokens tokens were generated, the stop ids are
     at -inf;
  1. repetition penalty r (1: off), on tokens in P or G: z / r where z > 0, else z * r;
  2. frequency f and presence pr (0: off), on generated tokens: z - f*count_G - pr*[count_G > 0];
  3. temperature T: x = z / T;
  4. top-k k (0: off): keep x >= the k-th largest x;
  5. top-p p (1: off): over the top-k-kept distribution, keep the smallest set of largest
     entries whose mass reaches p (an entry is kept iff the mass strictly above it < p);
  6. min-p m (0: off): keep x >= max(x) + log(m);
and the token is drawn from softmax(x) over what is kept. Ties at a threshold are kept.

Top-k and top-p find their thresholds without sorting: an exact 16-ary search over the 32
bits of the values' order-preserving integer keys, 8 passes that each weigh 16 thresholds
at once (a full-row top-k or sort would cost far more at 128k entries); each search runs
only when some row asks for it. When every filtering row has 0 < top-k <= 64 (the common
case), the searches read candidates, not the row: the row is cut into groups of 128, and
the 64 groups with the largest maxima hold every value above the 64th largest maximum m
(a group whose maximum is below m holds nothing above 64 larger values), and the top-k
threshold is >= m. So a pass for the group maxima, a gather of 8192 values and a pass or
two summing masses replace 16 passes over 128k. Rows with top-p alone use the candidates
too when the values >= m reach p of the row's mass; a row that is not covered is searched
whole (and only then do whole rows get searched). Which way a row takes depends on that
row alone.

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
import numpy as np
from flax import struct

TARGET, DRAFT, ACCEPT = 0, 1, 2  # noise streams
_PROBES = 16  # candidate thresholds per search pass (4 bits)
_TOP_K_CAP = 64  # top-k at or below this searches candidates only
_GROUP = 128  # values per group when picking candidates


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


NEUTRAL = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
               frequency_penalty=0.0, seed=0)  # each field's value that turns its step off


def neutral(batch: int) -> SamplingParams:
    """[batch] rows of neutral values (greedy, no filters, no penalties, seed 0)."""
    return SamplingParams(**{k: jnp.full((batch,), v, jnp.int32 if isinstance(v, int) else jnp.float32)
                             for k, v in NEUTRAL.items()})


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

def any_processing(sp: SamplingParams) -> bool:
    """Does some row sample or carry a penalty (host-side, on numpy values)? Else the argmax
    of the raw logits is every row's choice, and the program leaves the sampling steps out
    (`Plan.sampling`): a branch inside the loop would cost a device-to-host wait per round."""
    return bool(np.any(np.asarray(sp.temperature) > 0) or np.any(np.asarray(sp.repetition_penalty) != 1)
                or np.any(np.asarray(sp.presence_penalty) != 0) or np.any(np.asarray(sp.frequency_penalty) != 0))


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


def bar_tokens(logits, ids, where):
    """logits [B,N,V] with the ids [B,K] of each row (-1: none) at -inf at the nodes where
    `where` [B,N]."""
    B, N, V = logits.shape
    dest = jnp.where(where[:, :, None] & (ids[:, None, :] >= 0), ids[:, None, :], V)  # [B,N,K]
    return logits.at[jnp.arange(B)[:, None, None], jnp.arange(N)[None, :, None], dest].set(-jnp.inf, mode="drop")


# --------------------------------------------------------------------------- filters

def order_keys(x):
    """float32 -> uint32 keys with the same order (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def from_order_key(k):
    """Inverse of `order_keys`."""
    bits = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def largest_value_reaching(x, weigh, target, unroll: bool | None = None):
    """x [R,V], weigh(x) -> weights [R,V] (computed inside each pass: only x is read),
    target [R] -> the largest value t with sum(weigh(x) where x >= t) >= target (the
    search's invariant: the lowest key reaches it). Eight passes, each weighing 16
    candidates for the next 4 bits of t's order key; unrolled (unroll None: on a GPU, where
    a loop would read its predicate on the host each pass) or as a loop (elsewhere: one
    pass to compile instead of eight, about a fifth of a sampled loop's compile on the CPU)."""
    digits = jnp.arange(_PROBES, dtype=jnp.uint32)

    def search_pass(i, found):  # pass i fixes bits 28 - 4i .. 31 - 4i of the key
        shift = jnp.uint32(28) - jnp.uint32(4) * jnp.asarray(i, jnp.uint32)
        probes = found[:, None] | (digits[None, :] << shift)  # [R,16]
        keys, w = order_keys(x), weigh(x)
        mass = jnp.sum(jnp.where(keys[:, :, None] >= probes[:, None, :], w[:, :, None], 0), axis=1)
        reach = jnp.sum((mass >= target[:, None]).astype(jnp.int32), axis=1)  # reaching probes: a prefix
        return found | (jnp.maximum(reach - 1, 0).astype(jnp.uint32) << shift)

    if unroll is None:
        unroll = jax.default_backend() == "gpu"
    found = jnp.zeros(x.shape[:1], jnp.uint32)
    if unroll:
        for i in range(32 // 4):
            found = search_pass(i, found)
    else:
        found = jax.lax.fori_loop(0, 32 // 4, search_pass, found)
    # Key 0 lies below every value: only a target that rounding put out of reach ends there.
    return jnp.where(found == 0, -jnp.inf, from_order_key(found))


def candidates(x, cap: int, group: int):
    """x [R,V] -> (c [R, cap*group]: the values of the cap groups of `group` consecutive
    entries with the largest maxima, lowest [R]: the smallest of those maxima). Every value
    above lowest is in c (ties with it may lie outside), and c holds >= cap values >= lowest."""
    R, V = x.shape
    G = -(-V // group)
    xg = jnp.pad(x, ((0, 0), (0, G * group - V)), constant_values=-jnp.inf).reshape(R, G, group)
    maxima, best = jax.lax.top_k(jnp.max(xg, axis=-1), cap)  # [R,cap]
    return jnp.take_along_axis(xg, best[:, :, None], axis=1).reshape(R, cap * group), maxima[:, -1]


def _mass_from(x, t, top):
    """sum(exp(x - top) where x >= t) per row: x [R,V], t [R], top [R]."""
    return jnp.sum(jnp.where(x >= t[:, None], jnp.exp(x - top[:, None]), 0), axis=-1)


def _top_k_threshold(c, top_k):
    """The k-th largest of c [R,C] (-inf where top_k is 0)."""
    k = jnp.where(top_k > 0, jnp.minimum(top_k, c.shape[-1]), c.shape[-1]).astype(jnp.float32)
    return jnp.where(top_k > 0, largest_value_reaching(c, jnp.ones_like, k), -jnp.inf)


def _top_p_threshold(c, top_p, t_k, top, mass):
    """The lowest value top-p keeps of the top-k-kept distribution (values >= t_k), whose
    whole mass sum(exp(x - top)) is `mass` [R], searched over c [R,C]; t_k where top_p is 1."""
    c = jnp.where(c >= t_k[:, None], c, -jnp.inf)
    t_p = largest_value_reaching(c, lambda v: jnp.exp(v - top[:, None]), top_p * mass)
    return jnp.where(top_p < 1, jnp.maximum(t_p, t_k), t_k)


def _row_thresholds(x, top_k, top_p):
    """x [R,V] -> [R] the lowest value top-k and then top-p keep (-inf: everything),
    searching whole rows; each search runs only when some row asks for it."""
    top = jnp.max(x, axis=-1)
    t_k = jax.lax.cond(jnp.any(top_k > 0), lambda: _top_k_threshold(x, top_k), lambda: jnp.full_like(top, -jnp.inf))
    return jax.lax.cond(jnp.any(top_p < 1), lambda: _top_p_threshold(x, top_p, t_k, top, _mass_from(x, t_k, top)),
                        lambda: t_k)


def _thresholds(x, top_k, top_p, cap: int, group: int):
    """`_row_thresholds`, searching candidates instead for the rows they cover: rows with
    0 < top-k <= cap, and rows with top-p alone whose values >= lowest reach p of the mass
    (then the top-p threshold is >= lowest, and above lowest c holds every value). The
    masses are summed over whole rows (single passes), the searches over c; whole rows are
    searched only when some row is not covered, and only its result is taken from them."""
    if cap * group >= x.shape[-1]:
        return _row_thresholds(x, top_k, top_p)
    c, lowest = candidates(x, cap, group)
    top = jnp.max(c, axis=-1)  # the row's max
    reach = _mass_from(x, lowest, top) >= top_p * _mass_from(x, jnp.full_like(top, -jnp.inf), top)
    covered = jnp.where(top_k > 0, top_k <= cap, (top_p >= 1) | reach)

    def from_candidates():
        t_k = _top_k_threshold(c, top_k)  # >= lowest: c holds >= cap values >= lowest
        t_p = _top_p_threshold(c, top_p, t_k, top, _mass_from(x, t_k, top))
        return jnp.where(top_p < 1, jnp.maximum(t_p, lowest), t_k)  # ties with lowest outside c

    rows = jax.lax.cond(jnp.all(covered), lambda: jnp.full_like(top, -jnp.inf),
                        lambda: _row_thresholds(x, top_k, top_p))
    return jnp.where(covered, from_candidates(), rows)


def filter_logits(x, top_k, top_p, min_p, cap: int = _TOP_K_CAP, group: int = _GROUP):
    """Scaled logits x [R,V] -> x with what top-k, top-p and min-p drop at -inf (rows [R]
    of parameters; the neutral values keep everything). The threshold searches run only
    when some row asks for one, over candidates where they cover the batch (`_thresholds`)."""
    t = jax.lax.cond(jnp.any(top_k > 0) | jnp.any(top_p < 1), lambda x: _thresholds(x, top_k, top_p, cap, group),
                     lambda x: jnp.full(x.shape[:1], -jnp.inf), x)
    floor = jnp.max(x, axis=-1) + jnp.log(min_p)  # log(0) = -inf: off; top-k and top-p keep the max
    return jnp.where(x >= jnp.maximum(t, floor)[:, None], x, -jnp.inf)


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

def choose(samples: bool, logits, sp: SamplingParams, positions, hist: History, tokens=None, anc=None):
    """The target's choice at every node: logits [B,N,V] -> [B,N] int32, after the
    penalties for each node's context (`penalise`): the argmax for greedy rows, a draw from
    the processed distribution (the target's noise for `positions` [B,N]) for sampled rows.
    samples (static, `Plan.sampling`) False: no row samples or has penalties: the argmax."""
    if not samples:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = penalise(logits, sp, hist, tokens, anc)
    drawn = jnp.argmax(processed(z, sp) + gumbel(sp.seed, positions, TARGET, logits.shape[-1]), axis=-1)
    return jnp.where(sp.temperature[:, None] > 0, drawn, jnp.argmax(z, axis=-1)).astype(jnp.int32)


def log_probs(logits, sp: SamplingParams):
    """Penalised logits [B,N,V] -> log-probabilities of the processed distributions [B,N,V]
    (sampled rows; -inf where filtered out)."""
    return jax.nn.log_softmax(processed(logits, sp), axis=-1)


def choose_with_log_probs(logits, sp: SamplingParams, positions, stream: int):
    """`choose` without penalties, also returning the processed log-probabilities [B,N,V]
    the draws came from (greedy rows take the argmax; nothing reads their log q)."""
    logp = log_probs(logits, sp)
    drawn = jnp.argmax(logp + gumbel(sp.seed, positions, stream, logits.shape[-1]), axis=-1)
    return jnp.where(sp.temperature[:, None] > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32), logp


def draw_from(logp, seed, positions, stream: int = TARGET):
    """A Gumbel-max draw [B] from log-probabilities logp [B,V] (unnormalised is fine)."""
    g = gumbel(seed, positions[:, None], stream, logp.shape[-1])[:, 0]
    return jnp.argmax(logp + g, axis=-1).astype(jnp.int32)
