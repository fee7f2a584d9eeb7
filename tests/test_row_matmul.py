"""The row-invariant product and norm (`jspec.kernels.row.matmul`, `row_norm`, interpret
mode on the CPU): rows equal x @ w (the XLA norm), and each row is the same bits whatever
rows share the call (1 row, a verification's few, a batch's many; row blocks of 16 or 64)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels.row.matmul import RowMatmulTiles
from jspec.kernels.moe import experts as moe_experts
from jspec.kernels.row import norm as row_norm
from jspec.kernels.row.matmul import (
    block_n_for,
    layout_for,
    row_matmul,
    splits_for,
    supported,
)


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
    wide_tiles = RowMatmulTiles(wide_n=128, wide_block_n=128, one_wave=2)  # 3 tiles of 128 columns: two splits
    rows = [np.asarray(row_matmul(x[:m], w, tiles=wide_tiles, interpret=True)) for m in (40, 1, 5)]
    np.testing.assert_allclose(rows[0], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    for r in rows[1:]:
        np.testing.assert_array_equal(r, rows[0][:len(r)])
    lead = np.asarray(row_matmul(x.reshape(4, 10, K), w, num_splits=2, interpret=True))
    np.testing.assert_array_equal(lead.reshape(40, N), full)


def test_splits_follow_the_weight_only_and_bad_shapes_are_refused():
    assert splits_for(4096, 6144, 128, 64, 264) == 6
    assert splits_for(4096, 128256, 128, 64, 264) == 1
    assert splits_for(128, 128, 128, 64, 264) == 2  # never more splits than K chunks
    t = RowMatmulTiles()
    # splits: the most up to splits_for's that divide the K chunks (64 and 171)
    assert layout_for(4096, 6144, t) == (128, 4) and layout_for(10944, 2048, t) == (128, 9)
    assert layout_for(4096, 28672, t) == (256, 1)  # wide: 112 tiles fit one wave
    assert layout_for(4096, 128256, t) == (256, 2) and layout_for(2048, 21888, t) == (128, 2)  # 21888: not 256s
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

