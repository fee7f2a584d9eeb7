"""Row-invariant products: x [M, K] @ w [K, N] where each row's result is the same bits
whatever the other rows and however many there are.

XLA's GPU products choose their algorithm (tiles, split-K, a matrix-vector reduction for
one row) by the shape, so a row's sum runs in another order in a 1-row decode step than
in a 5-row verification and near-ties flip. This kernel fixes the order: rows go in
blocks of `block_m` (16), each program owns a block of rows, `block_n` columns and one
of `num_splits` K ranges (both from the weight's shape: `layout_for`), and walks that
range in `block_k` chunks with one matrix-multiply-accumulate a chunk; the splits'
float32 partials are then added in split order. Tiles and splits depend on (K, N) only, never on M, and a matrix-multiply
instruction computes each row of its tile from that row alone.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels.tiling import KERNEL_DTYPES, in_order_sum


@dataclasses.dataclass(frozen=True)
class RowMatmulTiles:
    """Tiles of the row-invariant product (`Tuning.row_matmul`, `Tuning.row_invariant`):
    columns and K chunk a program, the programs a row block aims for (K splits follow from
    the weight's shape and this)."""

    block_n: int = 128
    block_k: int = 64
    target_programs: int = 264
    wide_n: int = 16384  # weights of at least this many columns (gate/up, LM heads), where wide_block_n
    wide_block_n: int = 256  # divides N: programs this wide and one K split while the column tiles
    one_wave: int = 132  # fit one wave of this many programs (the H100's SMs), else two splits
    num_warps: int = 4
    wide_num_warps: int = 8  # the wide tiles' programs: the 8B step 5.665 ms against 5.687 with 4, within noise
    # in the products alone (docs/experiments.md, fifth pass)
    num_stages: int = 3

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


def _kernel(x_ref, w_ref, o_ref, *, block_m: int, block_k: int, chunks_per_split: int, transpose_w: bool):
    """x_ref [M, K] and o_ref [S, M, N] whole: this block's rows are gathered and stored
    with the index clamped to M - 1, so rows past M repeat the last one and store the same
    bits at its place (no padded copy of x, no padded partials written)."""
    m, n, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_n = w_ref.shape[0] if transpose_w else w_ref.shape[1]
    rows = jnp.minimum(m * block_m + jnp.arange(block_m, dtype=jnp.int32), x_ref.shape[0] - 1)

    def step(c, acc):
        k0 = pl.multiple_of(c * block_k, block_k)
        xv = x_ref[rows, pl.ds(k0, block_k)]
        if transpose_w:  # w block [BN, K]
            wv = w_ref[:, pl.ds(k0, block_k)]
            return acc + lax.dot_general(xv, wv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        wv = w_ref[pl.ds(k0, block_k), :]
        return acc + jnp.dot(xv, wv, preferred_element_type=jnp.float32)

    lo = s * chunks_per_split
    acc = lax.fori_loop(lo, lo + chunks_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[s, rows, pl.ds(pl.multiple_of(n * block_n, block_n), block_n)] = acc


def is_wide(n: int, tiles: RowMatmulTiles) -> bool:
    """Whether a weight of n columns takes the wide tiles (gate/up products, LM heads)."""
    return n >= tiles.wide_n and n % tiles.wide_block_n == 0


def layout_for(k: int, n: int, tiles: RowMatmulTiles) -> tuple[int, int]:
    """(columns a program, K splits) for a [k, n] weight, from its shape only. Wide weights
    (`is_wide`) take wide_block_n columns a program and one K split where their column
    tiles fit one wave of tiles.one_wave programs, else two (measured faster at one row:
    docs/benchmarks.md); others `block_n_for` and `splits_for`. The split count divides
    k's chunks."""
    if is_wide(n, tiles):
        block_n = tiles.wide_block_n
        splits = 1 if n // block_n <= tiles.one_wave else 2
    else:
        block_n = block_n_for(n, tiles)
        splits = splits_for(k, n, block_n, tiles.block_k, tiles.target_programs)
    chunks = k // tiles.block_k
    return block_n, max(d for d in range(1, splits + 1) if chunks % d == 0)


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
               interpret: bool | None = None):
    """x [..., K] @ w [K, N] (w [N, K] with transpose_w: a tied LM head) -> [..., N]
    float32, row-invariant (see the module). sum_splits False: -> the K splits [S, rows, N]
    unsummed, for a kernel that adds them in split order as it loads them
    (`kernels.mla.inputs`). tiles: None, the defaults; num_splits: at most this many K
    splits instead of `layout_for`'s (the most that divide K's chunks)."""
    t = RowMatmulTiles() if tiles is None else tiles
    if not supported(x, w, transpose_w, t):
        raise ValueError(f"row_matmul: {shape_problem(*(w.shape[::-1] if transpose_w else w.shape), t)}; "
                         f"got x {x.shape}, w {w.shape} (transpose_w={transpose_w})")
    K, N = w.shape[::-1] if transpose_w else w.shape
    block_n, S = layout_for(K, N, t)
    block_k = t.block_k
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(w.dtype)
    M = x2.shape[0]
    Mp = -(-M // block_m) * block_m
    chunks = K // block_k
    if num_splits:
        S = max(d for d in range(1, num_splits + 1) if chunks % d == 0)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.wide_num_warps if is_wide(N, t) else t.num_warps,
                                    num_stages=t.num_stages)
    w_spec = (pl.BlockSpec((block_n, K), lambda m, n, s: (n, 0)) if transpose_w
              else pl.BlockSpec((K, block_n), lambda m, n, s: (0, n)))
    part = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_k=block_k, chunks_per_split=chunks // S,
                          transpose_w=transpose_w),
        grid=(Mp // block_m, N // block_n, S),
        in_specs=[pl.BlockSpec(), w_spec],
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((S, M, N), jnp.float32),
        interpret=interpret, compiler_params=params, name="jspec_row_matmul",
    )(x2, w)
    return in_order_sum(part).reshape(lead + (N,)) if sum_splits else part
