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

from jspec.config import DEFAULT_TUNING, Tuning

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


def compiler_options(family_options: dict | None = None, tuning: Tuning | None = None) -> dict[str, bool | int | str]:
    """The XLA options the loop's programs are compiled with: on a GPU backend the target
    family's (`TargetFamily.gpu_xla_options`; left out where `tuning.family_xla_options`
    is False) updated with `tuning.xla_options` (None: the default tuning), none elsewhere.
    `tuning.row_invariant` adds xla_allow_excess_precision=False: XLA may otherwise keep a
    bf16 rounding in float32 where its fusion, which follows the shapes, lets it.
    Returns a new dict."""
    if jax.default_backend() != "gpu":
        return {}
    tuning = DEFAULT_TUNING if tuning is None else tuning
    base = dict(family_options or {}) if tuning.family_xla_options else {}
    if tuning.row_invariant:
        base["xla_allow_excess_precision"] = False
    return base | dict(tuning.xla_options)
