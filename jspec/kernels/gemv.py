"""Pallas (Triton) matrix-vector product with the residual add and the next RMSNorm's
inputs fused into its epilogue, for one-token decoding.

    x_new = residual + W a            (the residual stream after a projection)
    y     = gain * x_new              (the next RMSNorm's gain, applied)
    ss    = sum(x_new ** 2) in parts  (for the next RMSNorm's factor)

XLA runs the projection as a split-K matrix product and then two more kernels: one adds
the split partials to the residual, one computes the gain product and the sum of squares.
This kernel does all of it in one launch: grid (N // BN,), each program owns BN output
rows, walks K in blocks of BK (the weight block [BN, BK] times the activations, summed at
the end) and writes its rows of x_new and y and its partial sum of squares. The caller
finishes the norm with `rms_factor(ss, ...)`: r = rsqrt(sum(ss) / N + eps), applied after
the next projection (see `jspec.models.llama.RMSNorm`, deferred=True).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK_N = 32
BLOCK_K = 256
SS_LANES = 16  # a program's partial sum of squares is stored as a row of 16 equal values


def _gemv_kernel(a_ref, w_ref, res_ref, g_ref, x_ref, y_ref, ss_ref, *, block_n: int,
                 block_k: int, num_k: int):
    """One program: output rows [i*BN, (i+1)*BN).

    a_ref [K] and w_ref [N, K]: whole arrays. res_ref, g_ref, x_ref, y_ref: [BN] blocks.
    ss_ref [SS_LANES]: this program's partial sum of squares.
    """
    n0 = pl.program_id(0) * block_n

    def body(k, acc):  # acc [BN, BK] float32: products summed over the K blocks
        w = w_ref[pl.ds(n0, block_n), pl.ds(k * block_k, block_k)].astype(jnp.float32)
        a = a_ref[pl.ds(k * block_k, block_k)].astype(jnp.float32)
        return acc + w * a[None, :]

    acc = lax.fori_loop(0, num_k, body, jnp.zeros((block_n, block_k), jnp.float32))
    x = (res_ref[...].astype(jnp.float32) + jnp.sum(acc, axis=1)).astype(x_ref.dtype)  # [BN]
    x_ref[...] = x
    y_ref[...] = (g_ref[...] * x).astype(y_ref.dtype)
    xf = x.astype(jnp.float32)
    ss_ref[...] = jnp.full((SS_LANES,), jnp.sum(xf * xf), jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "interpret", "num_warps",
                                              "num_stages"))
def _gemv_call(a, w, residual, gain, *, block_n: int, block_k: int, interpret: bool,
               num_warps: int, num_stages: int):
    N, K = w.shape
    G = N // block_n
    kernel = functools.partial(_gemv_kernel, block_n=block_n, block_k=block_k,
                               num_k=K // block_k)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    rows = pl.BlockSpec((block_n,), lambda i: (i,))
    whole = pl.BlockSpec()
    x, y, ss = pl.pallas_call(
        kernel,
        grid=(G,),
        in_specs=[whole, whole, rows, rows],
        out_specs=[rows, rows, pl.BlockSpec((None, SS_LANES), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((N,), residual.dtype),
                   jax.ShapeDtypeStruct((N,), residual.dtype),
                   jax.ShapeDtypeStruct((G, SS_LANES), jnp.float32)],
        interpret=interpret,
        compiler_params=params,
        name="jspec_residual_gemv",
    )(a, w, residual, gain)
    return x, y, ss[:, 0]


def _check_args(a, w, residual, gain, block_n: int, block_k: int) -> None:
    if w.ndim != 2:
        raise ValueError(f"w must be [N, K], got shape {w.shape}")
    N, K = w.shape
    if a.shape != (K,):
        raise ValueError(f"a must be [K] = [{K}], got shape {a.shape}")
    for name, arr in (("residual", residual), ("gain", gain)):
        if arr.shape != (N,):
            raise ValueError(f"{name} must be [N] = [{N}], got shape {arr.shape}")
    for name, arr in (("a", a), ("w", w), ("residual", residual), ("gain", gain)):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {arr.dtype}")
    for name, b, dim in (("block_n", block_n, N), ("block_k", block_k, K)):
        if b < 1 or b & (b - 1) or dim % b:
            raise ValueError(f"{name} {b} must be a power of two dividing {dim}")


def is_supported(a, w, residual, gain, *, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> bool:
    try:
        _check_args(a, w, residual, gain, block_n, block_k)
    except (TypeError, ValueError):
        return False
    return True


def residual_gemv(a, w, residual, gain, *, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                  interpret: bool | None = None, num_warps: int = 4, num_stages: int = 3):
    """a [K], w [N, K] (Hugging Face's [out, in]), residual [N], gain [N] ->
    (x_new [N], gain * x_new [N], partial sums of x_new**2 [N // block_n] float32).
    x_new and the product are in residual's dtype; the product accumulates in float32."""
    _check_args(a, w, residual, gain, block_n, block_k)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _gemv_call(a, w, residual, gain, block_n=block_n, block_k=block_k,
                      interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def residual_gemv_reference(a, w, residual, gain, *, block_n: int = BLOCK_N):
    """The pure-jnp reference of `residual_gemv` (same outputs)."""
    y = jnp.einsum("nk,k->n", w.astype(jnp.float32), a.astype(jnp.float32))
    x = (residual.astype(jnp.float32) + y).astype(residual.dtype)
    xf = x.astype(jnp.float32)
    ss = jnp.sum((xf * xf).reshape(-1, block_n), axis=1)
    return x, (gain * x).astype(residual.dtype), ss


def rms_factor(ss, size: int, eps: float):
    """Partial sums of squares [..., G] of a vector of `size` values -> rsqrt(mean + eps)."""
    return lax.rsqrt(jnp.sum(ss, axis=-1) / size + eps)
