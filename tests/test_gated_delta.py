"""Gated DeltaNet references (`jspec.kernels.gated_delta.reference`): a sequence equals transformers'
recurrent and chunked delta rule and its causal convolution; over a tree, every node
equals decoding its root-to-node path as a sequence (outputs and the states after it)."""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jspec.kernels.gated_delta import reference as gd

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


# The references under jit in the path loops below: one program per path length, not one
# per operation and shape (most of those tests' time eagerly).
_delta_jit = jax.jit(gd.gated_delta_reference, static_argnames="node_states")
_conv_jit = jax.jit(gd.causal_conv_reference)


def _torch(*arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


@pytest.mark.parametrize("T", [1, 7])
def test_sequence_equals_transformers(T):
    rng = np.random.RandomState(T)
    q, k, v, g, beta, state = _inputs(rng, T)
    out, last = gd.gated_delta_reference(q, k, v, g, beta, state, node_states=False)
    _, states = gd.gated_delta_reference(q, k, v, g, beta, state)
    # transformers' two torch forms (functions, or callable modules without a __name__ from 5.25 on)
    for name, fn, kw in [("recurrent", hf.torch_recurrent_gated_delta_rule, {}),
                         ("chunk", hf.torch_chunk_gated_delta_rule, {"chunk_size": 4})]:
        want, want_state = fn(*_torch(q, k, v), g=torch.from_numpy(g), beta=torch.from_numpy(beta),
                              initial_state=torch.from_numpy(state), output_final_state=True,
                              use_qk_l2norm_in_kernel=True, **kw)
        np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)
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
            want, want_state = _delta_jit(q[sel], k[sel], v[sel], g[sel], beta[sel], state[b: b + 1],
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
            want, want_states = _conv_jit(x[b: b + 1, p], state[b: b + 1], w)
            np.testing.assert_allclose(np.asarray(out[b, t]), np.asarray(want[0, -1]), rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(node_states[b, t]), np.asarray(want_states[0, -1]))


# --------------------------------------------------------------------------- chunk forms and kernels
# The closed (WY) forms and the three kernel entry points (`gated_delta_kernels`), each with
# the Pallas kernel in interpret mode ("pallas") and its jnp reference ("reference"),
# against the sequential rule above. Dk = 8 and Dv = 6 are no powers of two: the kernels
# pad them; Dv = 32 with narrower tiles runs several programs per head.

import jax.numpy as jnp

from jspec.kernels import dispatch
from jspec.kernels.gated_delta import kernels as gk

BACKENDS = ["pallas", "reference"]


def _wide(rng, T, dk=16):
    """Inputs with Dk = dk and Dv = 32 (several Dv tiles at block_v 8 or 16)."""
    q, k = (rng.randn(B, T, Hk, dk).astype(np.float32) for _ in range(2))
    v = rng.randn(B, T, Hv, 32).astype(np.float32)
    _, _, _, g, beta, _ = _inputs(rng, T)
    return q, k, v, g, beta, (0.3 * rng.randn(B, Hv, dk, 32)).astype(np.float32)


def test_ancestor_matrix_is_each_path():
    rng = np.random.RandomState(3)
    parents = _random_parents(rng, 13)
    parents[1, 5] = -1  # a second root
    anc = np.asarray(gd.ancestor_matrix(parents))
    for b in range(B):
        for t in range(13):
            assert set(np.flatnonzero(anc[b, t])) == set(_path(parents[b], t))


def test_tree_chunk_reference_equals_the_rule():
    rng = np.random.RandomState(4)
    T = 11
    x = _inputs(rng, T)
    parents = np.stack([_random_parents(rng, T)[0], np.asarray(gd.chain_parents(1, T))[0]])  # a tree, a chain
    want, _ = gd.gated_delta_reference(*x, parents)
    np.testing.assert_allclose(np.asarray(gd.gated_delta_tree_chunk_reference(*x, parents)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)


def test_chunk_reference_equals_the_rule():
    """Chunks of 4 over 10 tokens (the last chunk partial), rows of 10 and 6 tokens: the
    padding leaves the state as the prompt left it, and its outputs read that state."""
    rng = np.random.RandomState(5)
    x = _inputs(rng, 10)
    lengths = np.array([10, 6], np.int32)
    out, last = gd.gated_delta_chunk_reference(*x, lengths, chunk=4)
    want, want_last = gd.gated_delta_steps_reference(*x, lengths)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), np.asarray(want_last), rtol=1e-5, atol=1e-5)
    _, short = gd.gated_delta_reference(*(a[1:, :6] for a in x[:5]), x[5][1:], node_states=False)
    np.testing.assert_allclose(np.asarray(last[1]), np.asarray(short[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_equals_every_path(backend):
    """Row 0 a random tree with two roots, row 1 a chain; each node as decoding its path."""
    rng = np.random.RandomState(6)
    T = 10
    x = _inputs(rng, T)
    parents = np.stack([_random_parents(rng, T)[0], np.asarray(gd.chain_parents(1, T))[0]])
    parents[0, 4] = -1
    want, _ = gd.gated_delta_reference(*x, parents)
    with dispatch.use_backend(backend):
        got = gk.gated_delta_verify(*(jnp.asarray(a) for a in x), jnp.asarray(parents))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_verify_kernel_tiles_both_forms():
    """The split form (the default: per-head prep, then o = P S0 + R per Dv tile) and the
    one-kernel form, over two Dv tiles."""
    rng = np.random.RandomState(7)
    x = _wide(rng, 7)
    parents = _random_parents(rng, 7)
    want, _ = gd.gated_delta_reference(*x, parents)
    for split in (True, False):
        got = gk.gated_delta_verify_kernel(*x, parents, interpret=True, verify_split=split, verify_block_v=16)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=f"split {split}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_counts(backend):
    """5 steps of which rows take 5 and 2; q None (a replay) gives the same state."""
    rng = np.random.RandomState(8)
    x = [jnp.asarray(a) for a in _inputs(rng, 5)]
    count = jnp.asarray([5, 2], jnp.int32)
    with dispatch.use_backend(backend):
        out, last = gk.gated_delta_step(*x, count)
        none, replay = gk.gated_delta_step(None, *x[1:], count)
    want, states = gd.gated_delta_reference(*x)
    assert none is None
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1, :2]), np.asarray(want[1, :2]), rtol=1e-5, atol=1e-5)
    for got in (last, replay):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(states[0, 4]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(states[1, 1]), rtol=1e-5, atol=1e-6)
    # the skipped steps read the state after the count
    q1 = gd.l2norm(jnp.repeat(x[0][1, 2:], Hv // Hk, axis=1)) * Dk ** -0.5  # [3, Hv, Dk]
    np.testing.assert_allclose(np.asarray(out[1, 2:]), np.einsum("thk,hkv->thv", q1, np.asarray(states[1, 1])),
                               rtol=1e-5, atol=1e-5)


def test_step_kernel_tiles_in_place():
    """Four Dv tiles a head; the state is updated in place when donated (no copy made)."""
    rng = np.random.RandomState(9)
    x = [jnp.asarray(a) for a in _wide(rng, 3)]
    want, want_last = gd.gated_delta_reference(*x, node_states=False)
    def step(*a):
        return gk.gated_delta_step_kernel(*a, interpret=True, step_block_v=8)

    calls = [e for e in jax.make_jaxpr(step)(*x).jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert [e.params["input_output_aliases"] for e in calls] == [((6, 1),)]  # the state in, the state out
    out, last = jax.jit(step, donate_argnums=5)(*x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), np.asarray(want_last), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_lengths(backend):
    """37 tokens in chunks of 32 (blocked solve: two diagonal blocks and a merge), rows of
    37 and 20 tokens: the state after each prompt, the padding changing nothing."""
    rng = np.random.RandomState(10)
    x = [jnp.asarray(a) for a in _inputs(rng, 37)]
    lengths = jnp.asarray([37, 20], jnp.int32)
    tiles = gk.GatedDeltaTiles(prefill_chunk=32)
    with dispatch.use_backend(backend):
        out, last = gk.gated_delta_prefill(*x, lengths, tiles=tiles)
    want, want_last = gd.gated_delta_steps_reference(*x, lengths)
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1, :20]), np.asarray(want[1, :20]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), np.asarray(want_last), rtol=1e-5, atol=1e-5)


def test_prefill_kernel_variants():
    """The scan form with chunks of 16 (one block) and W precomputed, over two Dv tiles,
    and chunks of 64 solved row by row (scan and split forms): the same as the rule."""
    rng = np.random.RandomState(11)
    x = [jnp.asarray(a) for a in _wide(rng, 21)]
    lengths = jnp.asarray([21, 9], jnp.int32)
    want, want_last = gd.gated_delta_steps_reference(*x, lengths)
    for kw in ({"prefill_chunk": 16, "prefill_w": True, "prefill_block_v": 16, "prefill_form": "scan"},
               {"prefill_blocked": False, "prefill_form": "scan"}, {"prefill_blocked": False}):
        out, last = gk.gated_delta_prefill_kernel(*x, lengths, interpret=True, **kw)
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5, err_msg=str(kw))
        np.testing.assert_allclose(np.asarray(last), np.asarray(want_last), rtol=1e-5, atol=1e-5, err_msg=str(kw))


def test_prefill_split_form():
    """The split form (FLA's: parallel prep of W, U and the decayed keys, a state kernel
    with two products a chunk, a parallel output kernel) over two Dv tiles in each kernel,
    chunks of 32 (two 16-row diagonal blocks and a merge; the last chunk partial), rows of
    37 and 20 tokens, two value heads per key head: the rule's outputs and states, and the
    scan form's. A wrong incoming state fails the same comparison; bfloat16 inputs take
    bfloat16 products and intermediates by default, within 2e-2 (relative), not 1e-5."""
    rng = np.random.RandomState(13)
    x = [jnp.asarray(a) for a in _wide(rng, 37)]
    lengths = jnp.asarray([37, 20], jnp.int32)
    want, want_last = gd.gated_delta_steps_reference(*x, lengths)
    split = gk.GatedDeltaTiles(prefill_form="split", prefill_chunk=32, prefill_block_v=16, prefill_out_block_v=16)
    with dispatch.use_backend("pallas"):
        run = jax.jit(lambda *a: gk.gated_delta_prefill(*a, tiles=split))
        out, last = run(*x, lengths)
        wrong, _ = run(*x[:5], x[5] + 0.01 * jnp.sign(x[5]), lengths)
    _, scan_last = gk.gated_delta_prefill_kernel(*x, lengths, interpret=True, prefill_chunk=32, prefill_form="scan")
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1, :20]), np.asarray(want[1, :20]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1, 20:]), np.asarray(want[1, 20:]), rtol=1e-5, atol=1e-5)  # padding
    np.testing.assert_allclose(np.asarray(last), np.asarray(want_last), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), np.asarray(scan_last), rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(np.asarray(wrong), np.asarray(want), rtol=1e-5, atol=1e-5)
    xb = [a.astype(jnp.bfloat16) for a in x[:3]] + x[3:]  # 16-bit q, k, v: FLA's numerics by default
    want, want_last = gd.gated_delta_steps_reference(*xb, lengths)
    out, last = gk.gated_delta_prefill_kernel(*xb, lengths, interpret=True)
    for got, ref in ((out[0], want[0]), (out[1, :20], want[1, :20]), (last, want_last)):
        err = np.linalg.norm(np.asarray(got) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
        assert 1e-5 < err < 2e-2, err  # rounded (bf16's error shows in interpret mode too), and close


def test_prefill_split_kd_transposed():
    """The split form's options: the prep as two kernels (`prefill_prep_split`: X written,
    then whole-chunk products), the keys stored transposed (`prefill_kd_transposed`: the
    state kernel's update a product of untransposed operands), the state kernel on each
    key head's normalised keys with u decayed (`prefill_raw_keys`, two value heads a key
    head here) and its stages given, the output kernel's loop over Dk = 32 in one block
    or two (`prefill_out_block_k`): the rule's outputs and states at float32; at bfloat16
    products and intermediates, the outputs written in bfloat16 (`out_dtype`), the
    one-kernel untransposed form's, rounded (1 ulp apart at most)."""
    rng = np.random.RandomState(14)
    x = [jnp.asarray(a) for a in _wide(rng, 37, dk=32)]
    lengths = jnp.asarray([37, 20], jnp.int32)
    want, want_last = gd.gated_delta_steps_reference(*x, lengths)
    kw = dict(interpret=True, prefill_form="split", prefill_chunk=32, prefill_block_v=16, prefill_out_block_v=16)
    for kd_t in (True, False):
        out, last = gk.gated_delta_prefill_kernel(*x, lengths, prefill_prep_split=True, prefill_raw_keys=True,
                                                  prefill_kd_transposed=kd_t, prefill_state_stages=3 if kd_t else 2,
                                                  prefill_out_block_k=16 if kd_t else None, **kw)
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out[1, :20]), np.asarray(want[1, :20]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(last), np.asarray(want_last), rtol=1e-5, atol=1e-5)
    bf = dict(kw, prefill_precision="bf16", prefill_split_dtype="bfloat16")
    out_t, last_t = gk.gated_delta_prefill_kernel(*x, lengths, prefill_kd_transposed=True, out_dtype=jnp.bfloat16,
                                                  prefill_prep_split=True, prefill_raw_keys=False, **bf)
    out_r, last_r = gk.gated_delta_prefill_kernel(*x, lengths, prefill_kd_transposed=False, prefill_prep_split=False,
                                                  **bf)
    assert out_t.dtype == jnp.bfloat16 and out_r.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out_t[0], np.float32), np.asarray(out_r[0].astype(jnp.bfloat16), np.float32),
                               rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(last_t), np.asarray(last_r), rtol=1e-6, atol=1e-6)


def test_entry_points_reject_bad_inputs():
    rng = np.random.RandomState(12)
    x = [jnp.asarray(a) for a in _inputs(rng, 4)]
    q, k, v, g, beta, state = x
    with pytest.raises(ValueError, match="Hv a multiple"):
        gk.gated_delta_step(q, k, v[:, :, :3], g[..., :3], beta[..., :3], state[:, :3])
    with pytest.raises(ValueError, match="state must be"):
        gk.gated_delta_prefill(q, k, v, g, beta, state[:, :, :4])
    with pytest.raises(TypeError, match="state must be float32"):
        gk.gated_delta_step(q, k, v, g, beta, state.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="parents"):
        gk.gated_delta_verify(q, k, v, g, beta, state, jnp.zeros((B, 3), jnp.int32))
    with pytest.raises(ValueError, match="q must be"):
        gk.gated_delta_verify(None, k, v, g, beta, state, jnp.zeros((B, 4), jnp.int32))
    with pytest.raises(ValueError, match="count"):
        gk.gated_delta_step(q, k, v, g, beta, state, jnp.zeros((B, 1), jnp.int32))
    with pytest.raises(ValueError, match="prefill_form"):
        gk.gated_delta_prefill_kernel(q, k, v, g, beta, state, prefill_form="chunked")
    with pytest.raises(ValueError, match="prefill_split_dtype"):
        gk.gated_delta_prefill_kernel(q, k, v, g, beta, state, prefill_form="split", prefill_split_dtype="float16")
    with pytest.raises(ValueError, match="precision"):
        gk.gated_delta_prefill_kernel(q, k, v, g, beta, state, prefill_precision="fp8")
