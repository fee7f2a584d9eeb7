"""The fused residual-add + RMSNorm kernel equals its reference (interpret mode on CPU),
and a whole model forward through the Pallas kernels equals the reference path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.kernels import rmsnorm
from conftest import PROMPTS


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 128), (7, 256)])
def test_add_rms_norm_kernel_equals_reference(shape, dtype, tol):
    k = jax.random.split(jax.random.key(sum(shape)), 3)
    x = (jax.random.normal(k[0], shape) * 3).astype(dtype)
    d = jax.random.normal(k[1], shape).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(k[2], shape[-1:])).astype(dtype)
    y, s = rmsnorm.add_rms_norm_pallas(x, d, w, 1e-5, interpret=True)
    y_ref, s_ref = rmsnorm.add_rms_norm_reference(x, d, w, 1e-5)
    assert y.dtype == dtype and s.dtype == dtype and y.shape == shape
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), atol=tol, rtol=tol)


def test_add_rms_norm_checks_and_fallback():
    x = jnp.ones((2, 96))
    with pytest.raises(ValueError, match="power-of-two"):
        rmsnorm.add_rms_norm_pallas(x, x, jnp.ones(96), 1e-6, interpret=True)
    y, s = rmsnorm.add_rms_norm(x, x, jnp.ones(96), 1e-6)  # not a power of two: the reference
    np.testing.assert_allclose(np.asarray(s), 2.0)


def test_model_through_pallas_kernels_equals_reference(target, monkeypatch):
    """Greedy generation with every kernel forced to Pallas (interpret) equals the
    reference path token for token (float32)."""
    ref = jspec.generate(target, PROMPTS[:2], max_new_tokens=5, stop_token_ids=[])
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    from jspec import api
    from jspec.kernels import decode_attention
    calls = []
    for mod, name in [(rmsnorm, "add_rms_norm_pallas"), (decode_attention, "paged_decode_attention")]:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    api._COMPILED.clear()
    jax.clear_caches()  # JSPEC_KERNELS is read when a function is traced
    got = jspec.generate(target, PROMPTS[:2], max_new_tokens=5, stop_token_ids=[])
    api._COMPILED.clear()
    assert got.tokens == ref.tokens
    assert {"add_rms_norm_pallas", "paged_decode_attention"} <= set(calls)
    monkeypatch.setenv("JSPEC_KERNELS", "reference")
    lg_ref = np.asarray(jspec.logits(target, PROMPTS[0]))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    jax.clear_caches()
    np.testing.assert_allclose(np.asarray(jspec.logits(target, PROMPTS[0])), lg_ref, atol=1e-5)
    jax.clear_caches()
