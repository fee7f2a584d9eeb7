"""Residual add fused with RMSNorm: (x + delta, rms_norm(x + delta) * weight).

A decoder layer adds each block's output to the residual stream and normalises the sum for
the next block. XLA runs that as three small kernels (add, reduce, scale); at batch 1 an 8B
model pays for 64 of those triples per token. This kernel does one pass per row.

Numerics follow transformers: the sum is rounded to the input dtype, then normalised in
float32, cast back, and multiplied by the weight in the input dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jspec.kernels import dispatch


def rms_norm_reference(x, weight, eps: float):
    """x [..., D] -> weight * normalised x (float32 statistics), in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def add_rms_norm_reference(x, delta, weight, eps: float):
    """-> (normed, summed) with summed = x + delta in x's dtype."""
    s = (x + delta).astype(x.dtype)
    return rms_norm_reference(s, weight, eps), s


def _kernel(x_ref, d_ref, w_ref, y_ref, s_ref, *, eps: float):
    s = (x_ref[...] + d_ref[...]).astype(s_ref.dtype)  # [1, D]
    s_ref[...] = s
    sf = s.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(sf * sf, axis=-1, keepdims=True) + eps)
    y_ref[...] = (w_ref[...] * (sf * inv).astype(s.dtype)).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _call(x2, d2, w, *, eps: float, interpret: bool):
    N, D = x2.shape
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=4 if D <= 4096 else 8, num_stages=1)
    row = pl.BlockSpec((1, D), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(N,),
        in_specs=[row, row, pl.BlockSpec((1, D), lambda i: (0, 0))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((N, D), x2.dtype), jax.ShapeDtypeStruct((N, D), x2.dtype)],
        interpret=interpret,
        compiler_params=params,
        name="jspec_add_rms_norm",
    )(x2, d2, w.reshape(1, D))


def supported(x, delta, weight) -> bool:
    D = x.shape[-1]
    return (x.shape == delta.shape and weight.shape == (D,) and x.dtype == delta.dtype == weight.dtype
            and D >= 16 and D & (D - 1) == 0 and jnp.dtype(x.dtype) in (jnp.dtype(jnp.float32),
                                                                         jnp.dtype(jnp.bfloat16),
                                                                         jnp.dtype(jnp.float16)))


def add_rms_norm_pallas(x, delta, weight, eps: float, *, interpret: bool | None = None):
    """The Pallas kernel: x, delta [..., D] (D a power of two), weight [D]."""
    if not supported(x, delta, weight):
        raise ValueError(f"add_rms_norm_pallas needs equal shapes/dtypes and a power-of-two width, got "
                         f"x {x.shape} {x.dtype}, delta {delta.shape} {delta.dtype}, weight {weight.shape} "
                         f"{weight.dtype}")
    shape = x.shape
    D = shape[-1]
    y, s = _call(x.reshape(-1, D), delta.reshape(-1, D), weight, eps=float(eps),
                 interpret=dispatch.interpret() if interpret is None else interpret)
    return y.reshape(shape), s.reshape(shape)


def add_rms_norm(x, delta, weight, eps: float):
    """Dispatch: -> (rms_norm(x + delta) * weight, x + delta). Shapes the kernel does not
    take (a width that is not a power of two) use the reference."""
    if supported(x, delta, weight) and dispatch.want_pallas(True):
        return add_rms_norm_pallas(x, delta, weight, eps)
    return add_rms_norm_reference(x, delta, weight, eps)
