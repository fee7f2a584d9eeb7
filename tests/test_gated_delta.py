"""Gated DeltaNet references (`jspec.kernels.gated_delta`): a sequence equals transformers'
recurrent and chunked delta rule and its causal convolution; over a tree, every node
equals decoding its root-to-node path as a sequence (outputs and the states after it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jspec.kernels import gated_delta as gd

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

B, Hk, Hv, Dk, Dv, C = 2, 2, 4, 8, 6, 4  # two value heads per key head


def _inputs(rng, T):
    q = rng.randn(B, T, Hk, Dk).astype(np.float32)
    k = rng.randn(B, T, Hk, Dk).astype(np.float32)
    v = rng.randn(B, T, Hv, Dv).astype(np.float32)
    g = -np.log1p(np.exp(rng.randn(B, T, Hv))).astype(np.float32)  # log decay < 0
    beta = (1 / (1 + np.exp(-rng.randn(B, T, Hv)))).astype(np.float32)
    state = (0.3 * rng.randn(B, Hv, Dk, Dv)).astype(np.float32)
    return q, k, v, g, beta, state


def _torch(*arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


@pytest.mark.parametrize("T", [1, 7])
def test_sequence_equals_transformers(T):
    rng = np.random.RandomState(T)
    q, k, v, g, beta, state = _inputs(rng, T)
    out, last = gd.gated_delta_reference(q, k, v, g, beta, state, node_states=False)
    _, states = gd.gated_delta_reference(q, k, v, g, beta, state)
    for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        kw = {"chunk_size": 4} if fn is hf.torch_chunk_gated_delta_rule else {}
        want, want_state = fn(*_torch(q, k, v), g=torch.from_numpy(g), beta=torch.from_numpy(beta),
                              initial_state=torch.from_numpy(state), output_final_state=True,
                              use_qk_l2norm_in_kernel=True, **kw)
        np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-5, atol=1e-5, err_msg=fn.__name__)
        np.testing.assert_allclose(np.asarray(last), want_state.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(states[:, -1]), np.asarray(last))


def _random_parents(rng, T):
    """A tree of T nodes per row: node 0 the root (parent -1), node t's parent < t."""
    return np.stack([np.array([-1] + [rng.randint(0, t) for t in range(1, T)], np.int32) for _ in range(B)])


def _path(parents_row, t):
    path = []
    while t >= 0:
        path.append(t)
        t = parents_row[t]
    return path[::-1]


def test_tree_nodes_equal_their_paths():
    rng = np.random.RandomState(0)
    T = 9
    q, k, v, g, beta, state = _inputs(rng, T)
    parents = _random_parents(rng, T)
    out, states = gd.gated_delta_reference(q, k, v, g, beta, state, parents)
    assert len({len(_path(parents[0], t)) for t in range(T)}) >= 3  # several depths
    for b in range(B):
        for t in range(T):
            p = _path(parents[b], t)
            sel = (slice(b, b + 1), p)
            want, want_state = gd.gated_delta_reference(q[sel], k[sel], v[sel], g[sel], beta[sel], state[b: b + 1],
                                                        node_states=False)
            np.testing.assert_allclose(np.asarray(out[b, t]), np.asarray(want[0, -1]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.asarray(states[b, t]), np.asarray(want_state[0]), rtol=1e-5, atol=1e-6)


def test_conv_sequence_equals_transformers():
    rng = np.random.RandomState(1)
    T, Ch = 6, 10
    x = rng.randn(B, T, Ch).astype(np.float32)
    w = rng.randn(Ch, C).astype(np.float32)
    # A prefill: nothing before the first token.
    out, node_states = gd.causal_conv_reference(x, np.zeros((B, C - 1, Ch), np.float32), w)
    want = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), None, "silu")
    np.testing.assert_allclose(np.asarray(out), want.transpose(1, 2).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(node_states[:, -1]), x[:, -(C - 1):])
    # Decoding after a state: transformers' state holds C inputs, of which the last C - 1 count.
    hf_state = rng.randn(B, Ch, C).astype(np.float32)
    state = hf_state[:, :, 1:].transpose(0, 2, 1)
    out, node_states = gd.causal_conv_reference(x[:, :3], state, w)
    conv_state = torch.from_numpy(hf_state.copy())
    want = hf.causal_conv1d_update(torch.from_numpy(x[:, :3]).transpose(1, 2).contiguous(), conv_state,
                                   torch.from_numpy(w), None, "silu")
    np.testing.assert_allclose(np.asarray(out), want.transpose(1, 2).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(node_states[:, -1]), conv_state.numpy()[:, :, 1:].transpose(0, 2, 1))


def test_conv_tree_nodes_equal_their_paths():
    rng = np.random.RandomState(2)
    T, Ch = 8, 5
    x = rng.randn(B, T, Ch).astype(np.float32)
    w = rng.randn(Ch, C).astype(np.float32)
    state = rng.randn(B, C - 1, Ch).astype(np.float32)
    parents = _random_parents(rng, T)
    out, node_states = gd.causal_conv_reference(x, state, w, parents)
    for b in range(B):
        for t in range(T):
            p = _path(parents[b], t)
            want, want_states = gd.causal_conv_reference(x[b: b + 1, p], state[b: b + 1], w)
            np.testing.assert_allclose(np.asarray(out[b, t]), np.asarray(want[0, -1]), rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(node_states[b, t]), np.asarray(want_states[0, -1]))
