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
    B, T, Ch = x.shape
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
