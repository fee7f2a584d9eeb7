"""The engine through its Pallas kernels (interpret mode on CPU) equals the reference path."""
from __future__ import annotations

import jax
import numpy as np

import jspec
from conftest import PROMPTS


def test_model_through_pallas_kernels_equals_reference(target, monkeypatch):
    """Greedy generation with every kernel forced to Pallas (interpret) equals the
    reference path token for token (float32)."""
    ref = jspec.generate(target, PROMPTS[:2], max_new_tokens=5, stop_token_ids=[])
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    from jspec import api
    from jspec.kernels import decode_attention
    calls = []
    real = decode_attention.paged_decode_attention
    monkeypatch.setattr(decode_attention, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    api._COMPILED.clear()
    jax.clear_caches()  # JSPEC_KERNELS is read when a function is traced
    got = jspec.generate(target, PROMPTS[:2], max_new_tokens=5, stop_token_ids=[])
    api._COMPILED.clear()
    assert got.tokens == ref.tokens
    assert calls
    monkeypatch.setenv("JSPEC_KERNELS", "reference")
    lg_ref = np.asarray(jspec.logits(target, PROMPTS[0]))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    jax.clear_caches()
    np.testing.assert_allclose(np.asarray(jspec.logits(target, PROMPTS[0])), lg_ref, atol=1e-5)
    jax.clear_caches()
