"""Few-row float32 products on the CPU: `matmul.cc` through the JAX FFI.

XLA's CPU dot handles a one-row product as a matrix-vector product that streams the weight,
but every product of 2 or more rows goes to a general GEMM that first copies the whole
weight; a 5-token verification then costs 2-3 plain steps although both only read the
weights. `matmul(x, w)` computes a few rows (up to `Tuning.cpu_matmul_max_rows`, 32; above,
in prefill, XLA's GEMM is the faster one) in loops that read the weight once
(docs/benchmarks.md, "The first run"), and each row's result is bit for bit independent
of the other rows.

The library is compiled on first use on this machine (`c++ -O3 -march=native` against
jaxlib's FFI headers, a few seconds) and cached under `$JSPEC_CACHE_DIR` or
`~/.cache/jspec`. Where it cannot be built (no compiler, no AVX2/FMA) or is turned off
(`JSPEC_CPU_MATMUL=0`), `use_native` is False and the callers keep XLA's dot.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from jspec import sharding
from jspec.kernels import dispatch

_SOURCE = Path(__file__).with_name("matmul.cc")
MAX_ROWS = 32  # `Tuning.cpu_matmul_max_rows`' default: above (prefill) XLA's GEMM is the faster one
_TARGETS = {"nn": ("jspec_matmul_nn", "JspecMatmulNN"), "nt": ("jspec_matmul_nt", "JspecMatmulNT")}
_log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    base = os.environ.get("JSPEC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jspec")
    return Path(base)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_library() -> Path | None:
    """The compiled library for this source, jaxlib and CPU (built if missing), or None."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None or platform.machine().lower() not in ("x86_64", "amd64") or not _SOURCE.is_file():
        return None
    include = jax.ffi.include_dir()
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), jax.__version__.encode(), include.encode(),
                                     _cpu_flags().encode(), cxx.encode()])).hexdigest()[:16]
    lib = _cache_dir() / f"cpu_matmul-{key}.so"
    if lib.exists():
        return lib
    cmd = [cxx, "-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC",
           "-w", "-I", include, str(_SOURCE), "-o"]
    tmp = None
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        done = subprocess.run(cmd + [tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            _log.info("jspec: CPU products not built (%s): %s", " ".join(cmd), done.stderr[-2000:])
            return None
        os.replace(tmp, lib)  # atomic: concurrent builders agree
        return lib
    except (OSError, subprocess.SubprocessError) as e:  # no compiler, a cache directory not writable
        _log.info("jspec: CPU products not built: %s", e)
        return None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def available() -> bool:
    """Whether the library is built and its FFI targets registered (once per process)."""
    if os.environ.get("JSPEC_CPU_MATMUL", "1").strip() == "0":
        return False
    path = build_library()
    if path is None:
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        for name, symbol in _TARGETS.values():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, AttributeError) as e:  # a damaged cached library
        _log.info("jspec: CPU products not loaded from %s: %s", path, e)
        return False
    return True


def use_native(x: jax.Array, w: jax.Array, max_rows: int | None = None) -> bool:
    """Whether `matmul(x, w)` runs the native loops here: float32, at most max_rows rows
    (None: `Tuning.cpu_matmul_max_rows`' default), the CPU backend with kernels on "auto",
    no mesh (XLA cannot split a custom call)."""
    max_rows = MAX_ROWS if max_rows is None else max_rows
    rows = x.size // max(x.shape[-1], 1)
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2 and 0 < rows <= max_rows
            and dispatch.backend() == "auto" and jax.default_backend() == "cpu"
            and not sharding.tp_size() and available())


def _call(kind: str, x, w):
    n = w.shape[0] if kind == "nt" else w.shape[1]
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32)
    return jax.ffi.ffi_call(_TARGETS[kind][0], out, vmap_method="sequential")(x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(kind: str, x, w):
    return _call(kind, x, w)


def _matmul_fwd(kind, x, w):
    return _call(kind, x, w), (x, w)


def _matmul_bwd(kind, res, g):
    """Gradients through XLA's products: g [..., N]; w [K, N] (nn) or [N, K] (nt)."""
    x, w = res
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])  # [R, N], [R, K]
    if kind == "nt":
        return g @ w, g2.T @ x2
    return g @ w.T, x2.T @ g2


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] (or w [N, K] transposed) -> float32 [..., N]; call only where
    `use_native(x, w)` holds."""
    return _matmul("nt" if transpose_w else "nn", x, w)
