"""Row-invariant RMSNorm (Pallas, Triton lowering; `Tuning.row_invariant`): each row's sum
of squares runs in one fixed order whatever the number of rows.

XLA's reduction of a [M, D] array picks its strategy by the shape: one row is reduced as
a whole vector, and a norm whose normed rows share a fusion with the sum (the deferred
norm of `models.layers.RMSNorm`) is tiled by the fusion's outputs; on an H100 both changed
the bits of a decode step against a verification. Here a program takes one row and walks
it in chunks of up to 4096 columns (one chunk for most models), each chunk's squares
summed by one fixed reduction and the chunks added in order.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.tiling import KERNEL_DTYPES


@dataclasses.dataclass(frozen=True)
class RowNormTiles:
    """Tiles of the row-invariant norm (`Tuning.row_norm`, `Tuning.row_invariant`): warps a row's program."""

    num_warps: int | None = None  # None: 16 for rows of at least wide_d columns, else 4
    wide_d: int = 4096  # on an H100, 16 warps were faster for the 8B shape's 4096 (docs/benchmarks.md)

    def warps_for(self, d: int) -> int:
        """Warps a program takes for rows of d columns."""
        if self.num_warps is not None:
            return self.num_warps
        return 16 if d >= self.wide_d else 4


def chunk_of(d: int) -> int:
    """Columns a step: the largest power of two up to 4096 dividing d (0: below 16)."""
    c = min(d & -d, 4096)
    return c if c >= 16 else 0


def supported(x, weight) -> bool:
    return (jnp.dtype(x.dtype) in map(jnp.dtype, KERNEL_DTYPES) and weight.shape == x.shape[-1:]
            and chunk_of(x.shape[-1]) > 0)


def _columns(c, chunk: int):
    """Chunk c's columns (c: a Python int, or a loop index)."""
    return pl.ds(c * chunk if isinstance(c, int) else pl.multiple_of(c * chunk, chunk), chunk)


def _kernel(x_ref, w_ref, o_ref, *, eps: float, chunk: int):
    """One row: x_ref, o_ref [1, D]; w_ref [D]."""
    D = x_ref.shape[1]
    n = D // chunk

    def row(c):  # columns [c * chunk, (c + 1) * chunk) of the row, float32
        return x_ref[:, _columns(c, chunk)].astype(jnp.float32)

    def squares(xv, acc):
        return acc + jnp.sum(xv * xv, axis=1)

    def normed(c, xv, r):
        cols = _columns(c, chunk)
        o_ref[:, cols] = w_ref[cols][None, :] * (xv * r).astype(o_ref.dtype)

    zero = jnp.zeros((1,), jnp.float32)
    if n == 1:  # the row held from its sum to its write
        xv = row(0)
        normed(0, xv, lax.rsqrt(squares(xv, zero) / D + eps)[:, None])
        return
    r = lax.rsqrt(lax.fori_loop(0, n, lambda c, acc: squares(row(c), acc), zero) / D + eps)[:, None]
    lax.fori_loop(0, n, lambda c, _: normed(c, row(c), r) or 0, 0)


def rms_norm(x, weight, eps: float, *, tiles: RowNormTiles | None = None, interpret: bool | None = None):
    """x [..., D] RMS-normed with weight [D] as `moe_experts.rms_norm` computes it (the
    factor in float32, the normed row rounded to x's dtype, then times the weight), each
    row's sum in a fixed order. -> x's shape and dtype. tiles: None, the defaults."""
    if not supported(x, weight):
        raise ValueError(f"row_norm.rms_norm needs D a multiple of 16 and weight [D], got x {x.shape}, "
                         f"weight {weight.shape}")
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    M = x2.shape[0]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=(tiles or RowNormTiles()).warps_for(D), num_stages=1)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), chunk=chunk_of(D)),
        grid=(M,),
        in_specs=[pl.BlockSpec((1, D), lambda m: (m, 0)), pl.BlockSpec((D,), lambda m: (0,))],
        out_specs=pl.BlockSpec((1, D), lambda m: (m, 0)),
        out_shape=jax.ShapeDtypeStruct((M, D), x.dtype),
        interpret=interpret, compiler_params=params, name="jspec_row_norm",
    )(x2, weight.astype(x.dtype))
    return out.reshape(x.shape)
