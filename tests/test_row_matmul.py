"""The row-invariant product and norm (`jspec.kernels.row_matmul`, `row_norm`, interpret
mode on the CPU): rows equal x @ w (the XLA norm), and each row is the same bits whatever
rows share the call (1 row, a verification's few, a batch's many; row blocks of 16 or 64)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.config import RowMatmulTiles
from jspec.kernels import moe_experts, row_norm
from jspec.kernels.row_matmul import block_n_for, row_matmul, splits_for, supported


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_equal_the_product_and_do_not_depend_on_the_others(dtype):
    rng = np.random.default_rng(0)
    K, N = 256, 384
    x = jnp.asarray(rng.standard_normal((40, K)), dtype)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, dtype)
    full = np.asarray(row_matmul(x, w, num_splits=2, interpret=True))
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_allclose(full, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    for m in (1, 5, 17):
        np.testing.assert_array_equal(np.asarray(row_matmul(x[:m], w, num_splits=2, interpret=True)), full[:m])
    np.testing.assert_array_equal(np.asarray(row_matmul(x[3:4], w, num_splits=2, interpret=True)), full[3:4])
    wide = np.asarray(row_matmul(x, w, num_splits=2, block_m=64, interpret=True))
    np.testing.assert_array_equal(wide, full)
    lead = np.asarray(row_matmul(x.reshape(4, 10, K), w, num_splits=2, interpret=True))
    np.testing.assert_array_equal(lead.reshape(40, N), full)


def test_splits_follow_the_weight_only_and_bad_shapes_are_refused():
    assert splits_for(4096, 6144, 128, 64, 264) == 6
    assert splits_for(4096, 128256, 128, 64, 264) == 1
    assert splits_for(128, 128, 128, 64, 264) == 2  # never more splits than K chunks
    x, w = jnp.zeros((2, 100)), jnp.zeros((100, 128))
    assert not supported(x, w)
    with pytest.raises(ValueError, match="K a multiple of 64 and N of 16"):
        row_matmul(x, w)
    assert not supported(x[:, :64], jnp.zeros((64, 40)))  # N: a multiple of 16
    assert block_n_for(3648, RowMatmulTiles()) == 64 and block_n_for(4096, RowMatmulTiles()) == 128


def test_transposed_weight_gives_the_same_rows():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((20, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, jnp.bfloat16)  # [N, K]: a tied head
    full = np.asarray(row_matmul(x, w, transpose_w=True, num_splits=2, interpret=True))
    np.testing.assert_array_equal(full, np.asarray(row_matmul(x, w.T, num_splits=2, interpret=True)))
    np.testing.assert_array_equal(np.asarray(row_matmul(x[7:8], w, transpose_w=True, num_splits=2, interpret=True)),
                                  full[7:8])
    assert supported(x, w, transpose_w=True) and not supported(x, w)


def test_a_deferred_norm_gives_the_normed_product_and_stays_row_invariant():
    rng = np.random.default_rng(3)
    K, N = 256, 48  # N not a multiple of 128: 16-column programs
    x = jnp.asarray(rng.standard_normal((21, K)) * 2, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.bfloat16)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(K), jnp.bfloat16)
    parts, ss = row_matmul(x, w, norm_weight=g, sum_splits=False, num_splits=2, interpret=True)
    assert parts.shape == (2, 21, N) and ss.shape == (2, 21)
    y = np.asarray(parts.sum(0)) * np.asarray(jax.lax.rsqrt(ss.sum(0) / K + 1e-6))[:, None]
    want = np.asarray(moe_experts.rms_norm(x, g, 1e-6), np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())  # bf16 roundings apart
    for rows in (slice(0, 1), slice(4, 5), slice(2, 19)):
        p1, s1 = row_matmul(x[rows], w, norm_weight=g, sum_splits=False, num_splits=2, interpret=True)
        np.testing.assert_array_equal(np.asarray(p1), np.asarray(parts[:, rows]))
        np.testing.assert_array_equal(np.asarray(s1), np.asarray(ss[:, rows]))
    with pytest.raises(ValueError, match="deferred norm takes sum_splits=False"):
        row_matmul(x, w, norm_weight=g)


@pytest.mark.parametrize("D", [256, 96])
def test_row_norm_equals_the_xla_norm_and_its_rows_do_not_depend_on_the_others(D):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((37, D)) * 3, jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.bfloat16)
    full = np.asarray(row_norm.rms_norm(x, w, 1e-5, interpret=True), np.float32)
    want = np.asarray(moe_experts.rms_norm(x, w, 1e-5), np.float32)
    np.testing.assert_allclose(full, want, rtol=1e-2, atol=1e-2)  # one bf16 rounding apart at most
    assert np.mean(full == want) > 0.95
    for rows in (slice(0, 1), slice(3, 4), slice(5, 22)):
        np.testing.assert_array_equal(np.asarray(row_norm.rms_norm(x[rows], w, 1e-5, interpret=True), np.float32),
                                      full[rows])
    assert not row_norm.supported(x[:, :90], w[:90])
