"""Gated DeltaNet (Qwen3-Next, Qwen3.5 linear-attention layers): pure-jnp references of
the causal depthwise convolution and the gated delta rule, over a sequence (prefill) or
over the N nodes of a verified tree, where each node continues from its parent's state.

Per linear layer and request the recurrent part of the cache is two states:
- conv: the last C - 1 inputs of the depthwise causal convolution [C - 1, Ch] (Ch = 2 Hk Dk
  + Hv Dv channels: query, key and value before the convolution), oldest first;
- ssm: the delta rule's matrix per value head [Hv, Dk, Dv], float32.

Over a tree (`parents` [B, T]: each node's parent node, -1 for a node that continues the
committed sequence, the root) node t sees the inputs and the state of its own ancestors
only, so that every root-to-node path computes exactly what decoding that path token by
token computes. The per-node states these functions return let a commit keep the state
after the last accepted node: no replay.

Math (transformers' `torch_recurrent_gated_delta_rule`, with its L2-normalised q and k):
    S_t = exp(g_t) S_parent + k_t (beta_t (v_t - S_parent_decayed^T k_t))^T
    o_t = S_t^T (q_t / sqrt(Dk))
where S_parent_decayed = exp(g_t) S_parent; value head h reads key head h // (Hv / Hk).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (as transformers and FLA)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def chain_parents(batch: int, T: int):
    """The parents of a sequence of T tokens: t - 1 (the first continues the state) -> [B, T]."""
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :] - 1, (batch, T))


def _path_inputs(x, state, parents, steps: int):
    """For each node, the inputs 1..steps positions before it along its path -> [B, T,
    steps, Ch] (index j - 1: j before; past the root, from `state` [B, C - 1, Ch])."""
    B, T, _ = x.shape
    Cm1 = state.shape[1]
    node = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
    past = jnp.zeros((B, T), jnp.int32)  # steps taken past the root (1: the input just before it)
    out = []
    for _ in range(steps):
        parent = jnp.take_along_axis(parents, jnp.maximum(node, 0), axis=1)
        node = jnp.where(node >= 0, parent, -1)
        past = jnp.where(node >= 0, past, past + 1)
        from_tree = jnp.take_along_axis(x, jnp.maximum(node, 0)[..., None], axis=1)  # [B, T, Ch]
        from_state = jnp.take_along_axis(state, jnp.clip(Cm1 - past, 0, Cm1 - 1)[..., None], axis=1)
        out.append(jnp.where((node >= 0)[..., None], from_tree, from_state))
    return jnp.stack(out, axis=2)


def causal_conv_reference(x, state, weight, parents=None):
    """The depthwise causal convolution (no bias, as in both families) with SiLU over T inputs.

    x [B, T, Ch] (the layer's projected q, k, v), state [B, C - 1, Ch] (the inputs before
    the first node, oldest first), weight [Ch, C] (transformers' conv1d weight without its
    middle axis), parents [B, T] or None (a sequence) -> (out [B, T, Ch] in x's dtype,
    node_states [B, T, C - 1, Ch]: the conv state after each node, its window's last
    C - 1 inputs)."""
    x, state, weight = jnp.asarray(x), jnp.asarray(state), jnp.asarray(weight)
    B, T, _ = x.shape
    C = weight.shape[1]
    parents = chain_parents(B, T) if parents is None else jnp.asarray(parents, jnp.int32)
    prev = _path_inputs(x, state.astype(x.dtype), parents, C - 1)  # [B, T, C-1, Ch], j - 1 = j before
    window = jnp.concatenate([prev[:, :, ::-1], x[:, :, None]], axis=2)  # [B, T, C, Ch], oldest first
    w = weight.astype(jnp.float32).T  # [C, Ch]
    y = jnp.einsum("btcd,cd->btd", window.astype(jnp.float32), w)
    return jax.nn.silu(y).astype(x.dtype), window[:, :, 1:]


def gated_delta_reference(q, k, v, g, beta, state, parents=None, *, node_states: bool = True):
    """The gated delta rule over T nodes, one at a time.

    q, k [B, T, Hk, Dk] (not yet normalised), v [B, T, Hv, Dv], g [B, T, Hv] (log decay,
    <= 0), beta [B, T, Hv], state [B, Hv, Dk, Dv] float32 (the state before the first
    node), parents [B, T] or None (a sequence) -> (out [B, T, Hv, Dv] float32, states):
    states [B, T, Hv, Dk, Dv] after each node when `node_states`, else the state after
    the last node [B, Hv, Dk, Dv] (a sequence only: what a prefill keeps)."""
    q, k, v, g, beta, state = (jnp.asarray(a) for a in (q, k, v, g, beta, state))
    B, T, Hk, Dk = k.shape
    Hv = v.shape[2]
    rep = Hv // Hk
    qn = jnp.repeat(l2norm(q), rep, axis=2) * Dk ** -0.5  # [B, T, Hv, Dk]
    kn = jnp.repeat(l2norm(k), rep, axis=2)
    v, g, beta = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
    state = state.astype(jnp.float32)

    def update(s, t):
        """s [B, Hv, Dk, Dv]: the state before node t -> (the state after it, its output)."""
        s = s * jnp.exp(g[:, t])[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, kn[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t][..., None]
        s = s + kn[:, t][..., None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, qn[:, t])

    if not node_states:
        if parents is not None:
            raise ValueError("node_states=False runs a sequence: parents must be None")
        last, out = jax.lax.scan(update, state, jnp.arange(T))
        return jnp.moveaxis(out, 0, 1), last

    parents = chain_parents(B, T) if parents is None else jnp.asarray(parents, jnp.int32)
    # states[:, 0] is the incoming state, states[:, t + 1] the state after node t.
    states = jnp.zeros((B, T + 1) + state.shape[1:], jnp.float32).at[:, 0].set(state)

    def tree_step(states, t):
        s = jnp.take_along_axis(states, (parents[:, t] + 1)[:, None, None, None, None], axis=1)[:, 0]
        s, o = update(s, t)
        return states.at[:, t + 1].set(s), o

    states, out = jax.lax.scan(tree_step, states, jnp.arange(T))
    return jnp.moveaxis(out, 0, 1), states[:, 1:]


# --------------------------------------------------------------------------- chunk (WY) forms
#
# The same rule in closed form over a set of nodes (flash-linear-attention's chunked form,
# generalised from a chain to a tree). Along node t's path, with G_t the sum of g over its
# ancestors and itself (the cumulative log decay from the incoming state S0):
#     S_t = exp(G_t) S0 + sum_{a in anc(t)} exp(G_t - G_a) k_a u_a^T
#     u_a = beta_a (v_a - exp(G_a) S0^T k_a - sum_{b strict anc(a)} exp(G_a - G_b) (k_a . k_b) u_b)
#     o_t = exp(G_t) S0^T q_t + sum_{a in anc(t)} exp(G_t - G_a) (q_t . k_a) u_a
# (anc(t): t and its ancestors). So u solves (I + L) u = beta (v - exp(G) (K S0)) with
# L[t, a] = beta_t exp(G_t - G_a) (k_t . k_a) for a strict ancestor a of t, zero elsewhere:
# unit lower triangular since parents come before their children. u_a depends on a's
# ancestors only, so one solve serves every path of the tree; a chain is the lower-triangular
# case, and a prefill applies it chunk by chunk, carrying S from one chunk to the next.

_HI = jax.lax.Precision.HIGHEST  # float32 products on a GPU too (XLA would take TF32 there)


def _per_value_head(q, k, v, g, beta, state):
    """The rule's inputs in float32, q and k L2-normalised (q times Dk^-0.5) and repeated
    over the value heads -> (qn, kn [B, T, Hv, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv],
    state [B, Hv, Dk, Dv]); q None -> qn None."""
    k, v = jnp.asarray(k), jnp.asarray(v)
    Dk, rep = k.shape[-1], v.shape[2] // k.shape[2]
    qn = None if q is None else jnp.repeat(l2norm(jnp.asarray(q)), rep, axis=2) * Dk ** -0.5
    kn = jnp.repeat(l2norm(k), rep, axis=2)
    f32 = (jnp.asarray(a, jnp.float32) for a in (v, g, beta, state))
    return (qn, kn, *f32)


def ancestor_matrix(parents):
    """parents [B, T] (each node's parent node, -1: none; parents[t] < t) -> [B, T, T] bool:
    [b, t, a] is True where a is t or one of t's ancestors. Pointer doubling: after round r
    each row holds the ancestors less than 2^r steps up, so ceil(log2 T) rounds of gathers."""
    parents = jnp.asarray(parents, jnp.int32)
    B, T = parents.shape
    node = jnp.arange(T, dtype=jnp.int32)
    anc = jnp.broadcast_to(node[:, None] == node[None, :], (B, T, T))
    jump = parents  # [B, T]: the ancestor 2^r steps up, -1 past the root
    for _ in range((T - 1).bit_length()):
        up = jax.vmap(lambda a, j: a[j])(anc, jnp.maximum(jump, 0))  # [B, T, T]: rows of the jump targets
        anc = anc | (up & (jump >= 0)[..., None])
        jump = jnp.where(jump >= 0, jnp.take_along_axis(jump, jnp.maximum(jump, 0), axis=1), -1)
    return anc


def gated_delta_tree_chunk_reference(q, k, v, g, beta, state, parents=None):
    """The gated delta rule over T nodes (a tree, or a sequence when parents is None) in its
    closed (WY) form: one triangular solve instead of T sequential steps, and no per-node
    states. Same arguments and outputs as `gated_delta_reference`'s first result:
    -> out [B, T, Hv, Dv] float32."""
    qn, kn, v, g, beta, state = _per_value_head(q, k, v, g, beta, state)
    B, T = g.shape[:2]
    parents = chain_parents(B, T) if parents is None else jnp.asarray(parents, jnp.int32)
    anc = ancestor_matrix(parents)[:, None]  # [B, 1, T, T]
    G = jnp.einsum("bta,bah->bht", anc[:, 0].astype(jnp.float32), g, precision=_HI)  # [B, Hv, T]
    decay = jnp.where(anc, jnp.exp(jnp.minimum(G[..., :, None] - G[..., None, :], 0.0)), 0.0)  # [B, Hv, T, T]
    strict = anc & ~jnp.eye(T, dtype=bool)
    beta = jnp.moveaxis(beta, 1, 2)  # [B, Hv, T]
    kk = jnp.einsum("bthd,bahd->bhta", kn, kn, precision=_HI)
    L = jnp.where(strict, beta[..., None] * kk * decay, 0.0)  # [B, Hv, T, T], strictly lower
    eG = jnp.exp(G)[..., None]
    ks = jnp.einsum("bthd,bhdv->bhtv", kn, state, precision=_HI)
    rhs = beta[..., None] * (jnp.moveaxis(v, 1, 2) - eG * ks)  # [B, Hv, T, Dv]
    u = jax.scipy.linalg.solve_triangular(L, rhs, lower=True, unit_diagonal=True)
    qk = jnp.einsum("bthd,bahd->bhta", qn, kn, precision=_HI)
    out = eG * jnp.einsum("bthd,bhdv->bhtv", qn, state, precision=_HI) + \
        jnp.einsum("bhta,bhav->bhtv", qk * decay, u, precision=_HI)
    return jnp.moveaxis(out, 1, 2)


def valid_tokens(T: int, lengths, batch: int):
    """[B, T] bool: token t of row b is one of its first lengths[b] (lengths None: all)."""
    if lengths is None:
        return jnp.ones((batch, T), bool)
    return jnp.arange(T, dtype=jnp.int32)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]


def masked_steps(g, beta, valid):
    """g, beta [B, T, Hv] with the steps where valid [B, T] is False made no-ops (g = 0:
    no decay, beta = 0: no write): the state passes them unchanged."""
    return jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)


def gated_delta_steps_reference(q, k, v, g, beta, state, count=None):
    """The rule over T steps, of which only the first count[b] change row b's state (the
    later ones are no-ops: their outputs read the state after count[b] steps). q may be
    None (a replay that keeps only the state). q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g,
    beta [B, T, Hv], state [B, Hv, Dk, Dv], count [B] int or None (T) -> (out [B, T, Hv,
    Dv] float32 or None, the state after count[b] steps [B, Hv, Dk, Dv] float32)."""
    g, beta = jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32)
    if count is not None:
        g, beta = masked_steps(g, beta, valid_tokens(g.shape[1], count, g.shape[0]))
    out, last = gated_delta_reference(k if q is None else q, k, v, g, beta, state, node_states=False)
    return (None if q is None else out), last


def gated_delta_chunk_reference(q, k, v, g, beta, state, lengths=None, *, chunk: int = 64):
    """The rule over a right-padded sequence in chunks of `chunk` tokens (the chunked WY form
    of flash-linear-attention's chunk_gated_delta_rule, in float32): within a chunk a
    triangular solve, between chunks the state. q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g,
    beta [B, T, Hv], state [B, Hv, Dk, Dv], lengths [B] int or None (T): tokens t >=
    lengths[b] leave the state unchanged (their outputs read the state after the prompt)
    -> (out [B, T, Hv, Dv] float32, the state after lengths[b] tokens [B, Hv, Dk, Dv])."""
    qn, kn, v, g, beta, state = _per_value_head(q, k, v, g, beta, state)
    B, T, Hv, _ = kn.shape
    Dv = v.shape[-1]
    valid = valid_tokens(T, lengths, B)
    g, beta = masked_steps(g, beta, valid)
    kn = jnp.where(valid[..., None, None], kn, 0.0)
    v = jnp.where(valid[..., None, None], v, 0.0)
    NT = -(-T // chunk)
    pad = NT * chunk - T  # padded tokens are no-ops (zero g, beta, k, v)

    def chunks(x):  # [B, T, Hv, ...] -> [NT, B, Hv, BT, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((B, NT, chunk) + x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    qc, kc, vc, gc, bc = map(chunks, (qn, kn, v, g, beta))  # [NT, B, Hv, BT(, D)]
    G = jnp.cumsum(gc, axis=-1)  # [NT, B, Hv, BT]: log decay from the chunk's start
    r = jnp.arange(chunk)
    decay = jnp.where(r[:, None] >= r[None, :], jnp.exp(jnp.minimum(G[..., :, None] - G[..., None, :], 0.0)), 0.0)
    kk = jnp.einsum("...td,...ad->...ta", kc, kc, precision=_HI)
    L = jnp.where(r[:, None] > r[None, :], bc[..., None] * kk * decay, 0.0)  # [NT, B, Hv, BT, BT]
    eG = jnp.exp(G)[..., None]
    # w = (I + L)^-1 beta exp(G) k and u0 = (I + L)^-1 beta v: then u = u0 - w S0 per chunk.
    w, u0 = (jax.scipy.linalg.solve_triangular(L, bc[..., None] * x, lower=True, unit_diagonal=True)
             for x in (eG * kc, vc))
    aqk = jnp.einsum("...td,...ad->...ta", qc, kc, precision=_HI) * decay
    g_last = G[..., -1]  # [NT, B, Hv]
    k_end = kc * jnp.exp(g_last[..., None] - G)[..., None]  # k decayed to the chunk's end

    def step(s, c):
        """s [B, Hv, Dk, Dv]: the state before chunk c -> (the state after it, its outputs)."""
        u = u0[c] - jnp.einsum("bhtd,bhdv->bhtv", w[c], s, precision=_HI)
        o = eG[c] * jnp.einsum("bhtd,bhdv->bhtv", qc[c], s, precision=_HI) + \
            jnp.einsum("bhta,bhav->bhtv", aqk[c], u, precision=_HI)
        s = jnp.exp(g_last[c])[..., None, None] * s + jnp.einsum("bhtd,bhtv->bhdv", k_end[c], u, precision=_HI)
        return s, o

    last, out = jax.lax.scan(step, state, jnp.arange(NT))  # out [NT, B, Hv, BT, Dv]
    out = jnp.moveaxis(out, 3, 2).transpose(1, 0, 2, 3, 4).reshape(B, NT * chunk, Hv, Dv)
    return out[:, :T], last
