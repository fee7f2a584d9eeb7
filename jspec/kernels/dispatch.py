"""Which implementation a kernel call uses: the Pallas kernel or its jnp reference.

Read when a function is traced: the innermost `use_backend(...)` block, else the env var
JSPEC_KERNELS: "auto" (default: Pallas kernels on a GPU backend where they support the
shapes, the reference elsewhere), "pallas" (always; interpret mode off GPU) or "reference".
jax caches traces, so set the variable before the first call (or `jax.clear_caches()`).
"""
from __future__ import annotations

import contextlib
import os

import jax

MODES = ("auto", "pallas", "reference")
_FORCED: list[str] = []


@contextlib.contextmanager
def use_backend(mode: str):
    """Forces the backend for code traced inside the block, e.g. "reference" for training
    (the Pallas kernels have no gradients)."""
    if mode not in MODES:
        raise ValueError(f"kernel backend must be one of {MODES}, got {mode!r}")
    _FORCED.append(mode)
    try:
        yield
    finally:
        _FORCED.pop()


def backend() -> str:
    if _FORCED:
        return _FORCED[-1]
    mode = os.environ.get("JSPEC_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"JSPEC_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


def want_pallas(supported: bool) -> bool:
    """Whether to call the Pallas kernel; `supported`: the kernel takes these arguments."""
    mode = backend()
    return mode == "pallas" or (mode == "auto" and supported and jax.default_backend() == "gpu")
