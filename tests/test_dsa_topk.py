"""The DSA top-k selection kernels (interpret mode) against their reference, bit for bit.

Few shapes (each one compile): most tests share `_small` ([2, 4, 200] scores, k = 24, a
block of 64 slots in chunks of 16: S is no multiple of the block and the last block's
last chunks lie past the end)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels import dispatch
from jspec.kernels.dsa import topk as dt

SHAPE, K = (2, 4, 200), 24
_small = jax.jit(functools.partial(dt.topk_slots, interpret=True, chunk=16, block=64), static_argnums=1)


def _check(x, k=K, kernel=_small):
    x = jnp.asarray(x, jnp.float32)
    got, ref = kernel(x, k), dt.topk_slots_reference(x, k)
    assert got.shape == x.shape[:-1] + (k,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    return np.asarray(ref).reshape(-1, k)


def _random(seed):
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def test_random_scores():
    x = _random(0) * 10  # negative and positive
    x[1, 3, :5] = [np.inf, 3e38, -3e38, 1e-45, -1e-45]  # +inf is a score; extremes and denormals
    ref = _check(x)
    assert (ref >= 0).all() and (np.diff(ref, axis=1) > 0).all()  # k distinct slots, ascending
    assert ref[7, 0] == 0  # +inf is selected


def test_ties_inside_a_run():
    x = np.round(_random(1) * 3)  # ~10 distinct values: the k-th score is one of ~30 equal ones
    ref = _check(x)
    flat = x.reshape(-1, SHAPE[-1])
    split = 0
    for row, sel in zip(flat, ref):
        kth = row[sel].min()
        split += (row == kth).sum() > (row[sel] == kth).sum()  # the boundary falls inside a run
        taken = np.flatnonzero(row == kth)[:(row[sel] == kth).sum()]
        np.testing.assert_array_equal(sel[row[sel] == kth], taken)  # the lowest equal slots
    assert split >= 6


def test_negative_infinity():
    x = _random(2)
    flat = x.reshape(-1, SHAPE[-1])
    flat[0, :] = -np.inf  # nothing visible
    flat[1, 10:] = -np.inf  # 10 < k visible
    flat[2, ::8] = -np.inf  # most visible
    keep = np.random.default_rng(3).choice(SHAPE[-1], K, replace=False)
    flat[3, :] = -np.inf
    flat[3, keep] = -5.0  # exactly k visible, all tied
    flat[4, 150:] = -np.inf  # visible only in the first blocks
    flat[5, :190] = -np.inf  # visible only in the last (ragged) block
    ref = _check(x)
    assert (ref[0] == -1).all()
    np.testing.assert_array_equal(ref[1], np.r_[np.arange(10), np.full(K - 10, -1)])
    np.testing.assert_array_equal(ref[3], np.sort(keep))
    np.testing.assert_array_equal(ref[5], np.r_[np.arange(190, 200), np.full(K - 10, -1)])


def test_signed_zeros():
    """lax.top_k orders floats totally: 0.0 ranks above -0.0 (not a tie); the kernel too."""
    x = np.full(SHAPE, -np.inf, np.float32)
    flat = x.reshape(-1, SHAPE[-1])
    rng = np.random.default_rng(4)
    zeros = rng.choice(SHAPE[-1], 40, replace=False)
    flat[0, zeros] = np.where(np.arange(40) % 3 == 0, 0.0, -0.0)  # 14 of 0.0, 26 of -0.0: k falls in the -0.0s
    flat[1] = np.where(rng.random(SHAPE[-1]) < 0.5, -0.0, 0.0) * (rng.random(SHAPE[-1]) < 0.5)
    flat[1, :20] = -1.0
    flat[2:] = _random(5).reshape(-1, SHAPE[-1])[2:] * (rng.random((6, SHAPE[-1])) < 0.5)  # zeros of both signs
    ref = _check(x)
    pos = np.sort(zeros[np.arange(40) % 3 == 0])
    neg = np.sort(zeros[np.arange(40) % 3 != 0])
    np.testing.assert_array_equal(ref[0], np.sort(np.r_[pos, neg[:K - len(pos)]]))
    np.testing.assert_array_equal(np.asarray(dt.topk_slots_reference(jnp.array([[-0.0, 0.0, -0.0, 0.0]]), 2)),
                                  [[1, 3]])


def test_nan_never_selected():
    x = _random(6)
    x[0, 0, ::3] = np.nan
    got = np.asarray(_small(jnp.asarray(x), K))
    assert not np.isin(np.arange(0, SHAPE[-1], 3), got[0, 0]).any() and (got[0, 0] >= 0).all()
    np.testing.assert_array_equal(got[1:], np.asarray(dt.topk_slots_reference(jnp.asarray(x), K))[1:])


def test_tiles_blocks_of_several_chunks():
    """tiles_for's own block (several chunks a program), ragged, k of the order of S."""
    x = np.round(np.random.default_rng(7).standard_normal((3, 1000)).astype(np.float32) * 20)
    x[2, 500:] = -np.inf
    assert dt.tiles_for(3, 1000, chunk=32, min_programs=8) == (256, 32)
    kernel = jax.jit(functools.partial(dt.topk_slots, interpret=True, chunk=32, min_programs=8), static_argnums=1)
    _check(x, 600, kernel)


def test_short_rows_and_k_above_s():
    """S < 16 (padded) and k > S: every visible slot, then -1."""
    x = np.random.default_rng(8).standard_normal((2, 10)).astype(np.float32)
    x[1, 3] = -np.inf
    ref = _check(x, 12, jax.jit(functools.partial(dt.topk_slots, interpret=True), static_argnums=1))
    np.testing.assert_array_equal(ref[1], np.r_[[0, 1, 2], np.arange(4, 10), [-1, -1, -1]])


def _highest_slot_ties(scores, k):
    """A wrong selection: ties at the k-th score to the highest slots."""
    S = scores.shape[-1]
    best, top = jax.lax.top_k(scores[..., ::-1], k)
    return jnp.sort(jnp.where(best > -jnp.inf, S - 1 - top, S), axis=-1).astype(jnp.int32)


def test_a_wrong_kernel_is_caught():
    """The comparison above fails for a selection that breaks ties the other way, or keeps
    lax.top_k's order (by score) instead of the slots': the tie case tells them apart."""
    x = jnp.asarray(np.round(_random(1) * 3))
    ref = dt.topk_slots_reference(x, K)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(np.asarray(_highest_slot_ties(x, K)), np.asarray(ref))
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(np.asarray(jax.lax.top_k(x, K)[1]), np.asarray(ref))
    distinct = jnp.asarray(_random(0))  # without ties the tie rule does not matter
    np.testing.assert_array_equal(np.asarray(_highest_slot_ties(distinct, K)),
                                  np.asarray(dt.topk_slots_reference(distinct, K)))


def test_dispatch():
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 10)).astype(np.float32))
    with dispatch.use_backend("reference"):
        assert not dt.uses_kernel(x, 12)
    with dispatch.use_backend("pallas"):
        assert dt.uses_kernel(x, 12)
        got = jax.jit(lambda s: dt.select(s, 12))(x)
    with dispatch.use_backend("auto"):
        assert dt.uses_kernel(x, 12) == (jax.default_backend() == "gpu")
        assert not dt.is_supported(x.astype(jnp.bfloat16), 12) and not dt.is_supported(x, 0)
    assert dt.pays(32, 65600) and dt.pays(128, 4160) and not dt.pays(128, 16448)  # where it measured faster
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dt.topk_slots_reference(x, 12)))
    with pytest.raises(ValueError):
        dt.topk_slots(x, 4, chunk=24)
