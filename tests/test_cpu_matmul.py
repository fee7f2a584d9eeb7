"""The native few-row CPU products (`kernels/cpu/matmul.py`): values, row independence,
gradients, when they are used, and the fallback when they cannot be built."""
import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.tuning import Tuning
from jspec.kernels.cpu import matmul as cpu_matmul
from jspec.kernels.dispatch import use_backend
from jspec.models.layers import product

buildable = (shutil.which("c++") or shutil.which("g++")) and platform.machine().lower() in ("x86_64", "amd64") \
    and "avx2" in open("/proc/cpuinfo").read()
pytestmark = pytest.mark.skipif(not buildable, reason="needs a C++ compiler and an x86-64 CPU with AVX2")

SHAPES = [(320, 1728), (7, 5), (33, 17), (64, 8), (9, 24), (40, 300)]  # K, N: strips of 16, 8 and masked


@pytest.fixture(autouse=True)
def registered():
    """`matmul` calls the FFI targets that `available()` registers once per process: a test
    that calls it directly must not depend on another having run first in its worker."""
    cpu_matmul.available()


def test_builds_here():
    assert cpu_matmul.available()


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_values_and_row_independence(K, N, transpose_w):
    rng = np.random.default_rng(K * N)
    x = rng.standard_normal((13, K), np.float32)  # passes of 6, 6 and 1 rows
    w = rng.standard_normal((K, N), np.float32)
    wk = np.ascontiguousarray(w.T) if transpose_w else w
    f = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, transpose_w))
    y = np.asarray(f(x, wk))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    # A row's result does not depend on the rows beside it: bit for bit, one at a time and
    # in every batch size.
    for r in (1, 2, 5, 6, 7):
        part = np.asarray(f(x[:r], wk))
        assert np.array_equal(part, y[:r])
    one = np.concatenate([np.asarray(f(x[i:i + 1], wk)) for i in range(len(x))])
    assert np.array_equal(one, y)
    # Leading dimensions are rows.
    assert np.array_equal(np.asarray(f(x[:12].reshape(2, 6, K), wk)).reshape(12, N), y[:12])


def test_differs_from_a_wrong_product():
    """The value check above would catch a kernel that skips the last columns or rows."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 33), np.float32), rng.standard_normal((33, 17), np.float32)
    y = np.asarray(cpu_matmul.matmul(jnp.asarray(x), jnp.asarray(w)))
    assert not np.allclose(y, x[:, :32] @ w[:32], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("transpose_w", [False, True])
def test_gradients_equal_xla(transpose_w):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 3, 24), np.float32))
    w = jnp.asarray(rng.standard_normal((17, 24) if transpose_w else (24, 17), np.float32))

    def loss(mm):
        return lambda x, w: jnp.sum(jnp.sin(mm(x, w)))

    native = jax.grad(loss(lambda x, w: cpu_matmul.matmul(x, w, transpose_w)), argnums=(0, 1))(x, w)
    xla = jax.grad(loss(lambda x, w: x @ (w.T if transpose_w else w)), argnums=(0, 1))(x, w)
    for a, b in zip(native, xla):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_vmap():
    rng = np.random.default_rng(3)
    x, w = jnp.asarray(rng.standard_normal((4, 2, 16), np.float32)), jnp.asarray(rng.standard_normal((16, 9), np.float32))
    y = jax.vmap(lambda x: cpu_matmul.matmul(x, w))(x)
    np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)


def _uses_native(x, w, **kw) -> bool:
    hlo = jax.jit(lambda x, w: product(x, w, **kw)).lower(x, w).as_text()
    return "jspec_matmul" in hlo


def test_where_it_is_used(monkeypatch):
    x, w = jnp.ones((5, 16), jnp.float32), jnp.ones((16, 8), jnp.float32)
    assert _uses_native(x, w)
    assert _uses_native(x, w.T, transpose_w=True)
    assert _uses_native(jnp.ones((2, 16, 16)), w)  # 32 rows
    assert not _uses_native(jnp.ones((33, 16)), w)  # prefill: XLA's GEMM
    assert _uses_native(jnp.ones((33, 16)), w, tuning=Tuning(cpu_matmul_max_rows=64))  # a tuning's limit
    assert not _uses_native(x, w, tuning=Tuning(cpu_matmul_max_rows=4))
    assert not _uses_native(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    with use_backend("reference"):
        assert not _uses_native(x, w)
    mesh = jax.make_mesh((1,), ("tp",))
    with jax.set_mesh(mesh):
        assert not _uses_native(x, w)
    monkeypatch.setenv("JSPEC_CPU_MATMUL", "0")
    cpu_matmul.available.cache_clear()
    try:
        assert not _uses_native(x, w)
    finally:
        monkeypatch.undo()
        cpu_matmul.available.cache_clear()
    assert _uses_native(x, w)


def test_no_compiler_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("JSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_matmul.build_library() is None
    assert list(tmp_path.iterdir()) == []  # no partial library left behind


def test_unusable_cache_directory_falls_back(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("JSPEC_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    assert cpu_matmul.build_library() is None
