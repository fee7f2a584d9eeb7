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

from jspec.config import RowMatmulTiles
from jspec.kernels.tiling import KERNEL_DTYPES, in_order_sum

BLOCK_M = 16


def splits_for(k: int, n: int, block_n: int, block_k: int, target_programs: int) -> int:
    """K splits for a [k, n] weight: enough programs a row block to fill the GPU (a
    function of the weight's shape only)."""
    chunks = k // block_k
    return max(1, min(chunks, -(-target_programs // (n // block_n))))


def block_n_for(n: int, tiles: RowMatmulTiles) -> int:
    """Columns a program for a weight of n columns: tiles.block_n, or the largest power of
    two dividing n below it (0: under 16, not taken)."""
    b = min(tiles.block_n, n & -n)
    return b if b >= 16 else 0


def _kernel(x_ref, w_ref, *rest, block_m: int, block_k: int, chunks_per_split: int, transpose_w: bool,
            deferred_norm: bool):
    """x_ref [M, K] and o_ref [S, M, N] whole: this block's rows are gathered and stored
    with the index clamped to M - 1, so rows past M repeat the last one and store the same
    bits at its place (no padded copy of x, no padded partials written). deferred_norm:
    rest starts with the norm's weight [K] (x's chunks are multiplied by it as loaded) and
    ends with ss_ref [S, M] float32, the rows' sums of squares over this split's K range
    (written by the first column tile's programs)."""
    norm_ref, o_ref, ss_ref = rest if deferred_norm else (None, rest[0], None)
    m, n, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_n = w_ref.shape[0] if transpose_w else w_ref.shape[1]
    rows = jnp.minimum(m * block_m + jnp.arange(block_m, dtype=jnp.int32), x_ref.shape[0] - 1)

    def step(c, carry):
        acc, ss = carry
        k0 = pl.multiple_of(c * block_k, block_k)
        xv = x_ref[rows, pl.ds(k0, block_k)]
        if deferred_norm:
            xf = xv.astype(jnp.float32)
            ss = ss + jnp.sum(xf * xf, axis=1)
            xv = (norm_ref[pl.ds(k0, block_k)].astype(jnp.float32)[None, :] * xf).astype(xv.dtype)
        if transpose_w:  # w block [BN, K]
            wv = w_ref[:, pl.ds(k0, block_k)]
            return acc + lax.dot_general(xv, wv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32), ss
        wv = w_ref[pl.ds(k0, block_k), :]
        return acc + jnp.dot(xv, wv, preferred_element_type=jnp.float32), ss

    lo = s * chunks_per_split
    acc, ss = lax.fori_loop(lo, lo + chunks_per_split, step, (jnp.zeros((block_m, block_n), jnp.float32),
                                                              jnp.zeros((block_m,), jnp.float32)))
    o_ref[s, rows, pl.ds(pl.multiple_of(n * block_n, block_n), block_n)] = acc
    if deferred_norm:
        @pl.when(n == 0)
        def _():
            ss_ref[s, rows] = ss


def shape_problem(k: int, n: int, tiles: RowMatmulTiles | None = None) -> str | None:
    """Why `row_matmul` does not take a [k, n] weight, or None."""
    t = RowMatmulTiles() if tiles is None else tiles
    if k <= 0 or k % t.block_k or not block_n_for(n, t):
        return f"the row kernel takes weights [K, N] with K a multiple of {t.block_k} and N of 16"
    return None


def supported(x, w, transpose_w: bool = False, tiles: RowMatmulTiles | None = None) -> bool:
    """Whether `row_matmul` takes x and w (`shape_problem`, a kernel dtype)."""
    K, N = (w.shape[::-1] if transpose_w else w.shape) if w.ndim == 2 else (0, 0)
    return (w.ndim == 2 and x.shape[-1] == K and jnp.dtype(w.dtype) in map(jnp.dtype, KERNEL_DTYPES)
            and shape_problem(K, N, tiles) is None)


def row_matmul(x, w, *, transpose_w: bool = False, tiles: RowMatmulTiles | None = None,
               num_splits: int | None = None, block_m: int = BLOCK_M, sum_splits: bool = True,
               norm_weight=None, interpret: bool | None = None):
    """x [..., K] @ w [K, N] (w [N, K] with transpose_w: a tied LM head) -> [..., N]
    float32, row-invariant (see the module). sum_splits False: -> the K splits [S, rows, N] unsummed, for a
    kernel that adds them in split order as it loads them (`kernels.mla_inputs`). tiles:
    None, the defaults.

    norm_weight [K] (with sum_splits False): an RMSNorm deferred to the consumer, which
    needs no kernel of its own: the splits are of (norm_weight * x, rounded to x's dtype)
    @ w, and -> (splits, ss [S, rows] float32: each split's sum of x's squares over its K
    range); the consumer scales the splits' sum by rsqrt(sum of ss / K + eps)."""
    t = RowMatmulTiles() if tiles is None else tiles
    if not supported(x, w, transpose_w, t):
        raise ValueError(f"row_matmul: {shape_problem(*(w.shape[::-1] if transpose_w else w.shape), t)}; "
                         f"got x {x.shape}, w {w.shape} (transpose_w={transpose_w})")
    K, N = w.shape[::-1] if transpose_w else w.shape
    block_n, block_k = block_n_for(N, t), t.block_k
    if norm_weight is not None and (sum_splits or norm_weight.shape != (K,)):
        raise ValueError(f"row_matmul: a deferred norm takes sum_splits=False and a weight [{K}], got "
                         f"{getattr(norm_weight, 'shape', norm_weight)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(w.dtype)
    M = x2.shape[0]
    Mp = -(-M // block_m) * block_m
    S = num_splits or splits_for(K, N, block_n, block_k, t.target_programs)
    chunks = K // block_k
    if chunks % S:
        S = max(d for d in range(1, S + 1) if chunks % d == 0)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    w_spec = (pl.BlockSpec((block_n, K), lambda m, n, s: (n, 0)) if transpose_w
              else pl.BlockSpec((K, block_n), lambda m, n, s: (0, n)))
    part = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_k=block_k, chunks_per_split=chunks // S,
                          transpose_w=transpose_w, deferred_norm=norm_weight is not None),
        grid=(Mp // block_m, N // block_n, S),
        in_specs=[pl.BlockSpec(), w_spec] + ([] if norm_weight is None else [pl.BlockSpec()]),
        out_specs=pl.BlockSpec() if norm_weight is None else [pl.BlockSpec(), pl.BlockSpec()],
        out_shape=(jax.ShapeDtypeStruct((S, M, N), jnp.float32) if norm_weight is None else
                   [jax.ShapeDtypeStruct((S, M, N), jnp.float32), jax.ShapeDtypeStruct((S, M), jnp.float32)]),
        interpret=interpret, compiler_params=params, name="jspec_row_matmul",
    )(x2, w, *(() if norm_weight is None else (norm_weight,)))
    if norm_weight is not None:
        return tuple(part)
    return in_order_sum(part).reshape(lead + (N,)) if sum_splits else part
