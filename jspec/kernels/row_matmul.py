"""Row-invariant products: x [M, K] @ w [K, N] where each row's result is the same bits
whatever the other rows and however many there are.

XLA's GPU products choose their algorithm (tiles, split-K, a matrix-vector reduction for
one row) by the shape, so a row's sum runs in another order in a 1-row decode step than
in a 5-row verification and near-ties flip. This kernel fixes the order: rows go in
blocks of `block_m` (16), each program owns a block of rows, `block_n` columns and one
of `num_splits` K ranges, and walks that range in `block_k` chunks with one
matrix-multiply-accumulate a chunk; the splits' float32 partials are then added in split
order. Tiles and splits depend on (K, N) only, never on M, and a matrix-multiply
instruction computes each row of its tile from that row alone.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.tiling import KERNEL_DTYPES

BLOCK_M = 16


def splits_for(k: int, n: int, block_n: int, block_k: int, target_programs: int) -> int:
    """K splits for a [k, n] weight: enough programs a row block to fill the GPU (a
    function of the weight's shape only)."""
    chunks = k // block_k
    return max(1, min(chunks, -(-target_programs // (n // block_n))))


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, chunks_per_split: int):
    s = pl.program_id(2)

    def step(c, acc):
        k0 = pl.multiple_of(c * block_k, block_k)
        xv = x_ref[:, pl.ds(k0, block_k)]
        wv = w_ref[pl.ds(k0, block_k), :]
        return acc + jnp.dot(xv, wv, preferred_element_type=jnp.float32)

    lo = s * chunks_per_split
    acc = lax.fori_loop(lo, lo + chunks_per_split, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc


def supported(x, w, block_n: int = 128, block_k: int = 64) -> bool:
    return (w.ndim == 2 and x.shape[-1] == w.shape[0] and jnp.dtype(w.dtype) in map(jnp.dtype, KERNEL_DTYPES)
            and w.shape[1] % block_n == 0 and w.shape[0] % block_k == 0)


def row_matmul(x, w, *, block_n: int = 128, block_k: int = 64, num_splits: int | None = None,
               target_programs: int = 264, num_warps: int = 4, num_stages: int = 3, block_m: int = BLOCK_M,
               interpret: bool | None = None):
    """x [..., K] @ w [K, N] -> [..., N] float32, row-invariant (see the module)."""
    if not supported(x, w, block_n, block_k):
        raise ValueError(f"row_matmul needs w [K, N] with K % {block_k} == 0 and N % {block_n} == 0, "
                         f"got x {x.shape}, w {w.shape}")
    K, N = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(w.dtype)
    M = x2.shape[0]
    Mp = -(-M // block_m) * block_m
    if Mp != M:
        x2 = jnp.pad(x2, ((0, Mp - M), (0, 0)))
    S = num_splits or splits_for(K, N, block_n, block_k, target_programs)
    chunks = K // block_k
    if chunks % S:
        S = max(d for d in range(1, S + 1) if chunks % d == 0)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    part = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, chunks_per_split=chunks // S),
        grid=(Mp // block_m, N // block_n, S),
        in_specs=[pl.BlockSpec((block_m, K), lambda m, n, s: (m, 0)),
                  pl.BlockSpec((K, block_n), lambda m, n, s: (0, n))],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda m, n, s: (s, m, n)),
        out_shape=jax.ShapeDtypeStruct((S, Mp, N), jnp.float32),
        interpret=interpret, compiler_params=params, name="jspec_row_matmul",
    )(x2, w)
    y = part[0]
    for i in range(1, S):  # split order, elementwise: the same sum for every row
        y = y + part[i]
    return y[:M].reshape(lead + (N,))
