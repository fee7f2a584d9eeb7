"""Pallas (Triton) products with an FP8 weight read as FP8 (`jspec.quantization`: a kernel
[K, N] in E4M3 with float32 scales [K / GROUP, N], one per group of GROUP = 128 rows and
column).

out [M, N] = sum over groups g of (x[:, g] @ w[g]) * scale[g], by one of two kernels:

- **Tensor cores** (`_kernel`, more than `Fp8Tiles.vector_rows` rows): each program takes
  BM rows and BN columns and walks its share of the groups; a step loads x's [BM, 128] tile
  and the weight's [128, BN] FP8 tile, widens the weight (E4M3 values are exact in
  bfloat16 and float16), multiplies into float32 and adds the product times that group's
  column scales to the float32 accumulator. bfloat16 rows are multiplied in float16
  (`half_rows`: E4M3 widens to float16 in one instruction and to bfloat16 in several;
  each row divided by a power of two that keeps it in float16's range, 1 for activations,
  and its sums multiplied back). The row tile is the smallest power of two that holds the
  rows (at least 16, the tensor cores' smallest tile; at most `Fp8Tiles.block_m`), so up
  to block_m rows read the weight once; rows past the product's are masked, neither
  loaded nor stored.
- **CUDA cores** (`_vector_kernel`, one row by default): no tile to pad to 16 rows; a
  step loads a [32, 256] FP8 tile, widens it to float32 and adds its products with the
  row elementwise into a float32 tile, summed over its rows once at the end.

K splits (more programs when the tiles are few; they divide the groups, so every program
runs the same static loop) write float32 partial sums [S, M, N] that the wrapper adds in
split order (`tiling.in_order_sum`). The numerics differ from dequantizing first (each
group's float32 sum is scaled, not each weight), by float32 rounding: `matmul_reference`
computes the same order in jnp.

Speed (H200, docs/benchmarks.md, "What do FP8 weights gain on the GPU?"): at decode rows
the kernels stream the FP8 weight at 2-2.6 TB/s, about half the rate XLA reads a bfloat16
weight, so they are about as fast as bfloat16, not twice as fast. XLA has no fused
product: a weight dequantized in the graph is written out in bfloat16 and read again.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jspec.kernels import dispatch
from jspec.kernels.tiling import KERNEL_DTYPES, half_factor, in_order_sum, is_pow2, pow2_ceil
from jspec.quantization import FP8_DTYPES, GROUP


@dataclasses.dataclass(frozen=True)
class Fp8Tiles:
    """Tiles of `fp8_matmul` (`Tuning.fp8`). block_m: the tallest row tile; a product of
    fewer rows takes the smallest power of two that holds them (at least 16, the tensor
    cores' smallest tile), so the weight is read once up to block_m rows. block_n: columns
    a program. target_programs: K splits are added until the grid has about this many
    programs (four per SM on an H200), each split walking at least min_split_groups groups
    (splits divide the groups evenly). evict_first: weight tiles are loaded with Triton's
    evict-first policy (read once, they need not stay in L2). max_rows: `Linear` runs the
    kernel for products of at most this many rows; more (a prompt's blocks) dequantize the
    weight and run XLA's product, which is then bound by arithmetic. vector_rows: products
    of at most this many rows run the CUDA-core kernel instead (`_vector_kernel`: a
    [vector_block_k, vector_block_n] tile a step, no tensor-core tile to pad to).
    mosaic_rows: on a Hopper GPU, products of at most this many rows (and max_rows; the
    kernel takes 16 at most) run the Mosaic GPU kernel instead (`kernels.fp8.mosaic`, tiles
    `Tuning.fp8_mosaic`; bfloat16 or float16 rows, N a multiple of 64: `mosaic.uses_kernel`);
    0: never. 16: the 8B shape's FP8 decode step on an H200 took 3.08 and 3.33 ms at batch 1
    (two machines) against 3.61 and 3.75 with 0, 3.48 against 4.52 at batch 8, the chain S=3
    round 4.10 against 5.06 ms (benchmarks/results/bench_fp8_8b_mosaic_h200*.json). The
    other defaults are the H200's best of the tilings swept on the 8B shape's
    projections (docs/experiments.md, "FP8 products at decode rows")."""

    block_m: int = 64
    block_n: int = 128
    target_programs: int = 528
    min_split_groups: int = 2
    num_warps: int = 4
    num_stages: int = 3
    evict_first: bool = True
    max_rows: int = 64
    vector_rows: int = 1
    vector_block_n: int = 256
    vector_block_k: int = 32
    mosaic_rows: int = 16


def half_rows(rows, top=None):
    """bfloat16 rows [M, K] -> (float16 rows, float32 factors [M, 1]): each row divided by
    its `tiling.half_factor`, then converted. The tensor-core kernel multiplies in float16
    (E4M3 widens to it in one instruction, to bfloat16 in several) and multiplies its rows'
    sums back by the factors. top [M, 1] float32: a bound on each row's largest magnitude
    (at least it; None: the rows' own maxima) the factors are taken from instead, so a
    caller that has one (`moe_experts.normed_with_top`) spares the rows a pass."""
    factor = half_factor(rows) if top is None else half_factor(top=top)
    return (rows.astype(jnp.float32) / factor).astype(jnp.float16), factor


def kernel_rows(x, tiles: Fp8Tiles | None = None):
    """The rows x [M, K] the kernel multiplies, as float32 values: bfloat16 rows as the
    tensor-core kernel takes them (`half_rows`), others as they are."""
    t = Fp8Tiles() if tiles is None else tiles
    if x.dtype == jnp.bfloat16 and x.shape[0] > t.vector_rows:
        half, factor = half_rows(x)
        return half.astype(jnp.float32) * factor
    return x.astype(jnp.float32)


def matmul_reference(x, w, scale, out_dtype=None, tiles: Fp8Tiles | None = None):
    """`fp8_matmul` in jnp: x [M, K] @ (w [K, N] FP8, scale [K / GROUP, N]) -> [M, N], each
    group's product in float32 times its scales, summed in group order (x as the kernel
    takes it, `kernel_rows`)."""
    M, K = x.shape
    G = K // GROUP
    parts = jnp.einsum("mgk,gkn->gmn", kernel_rows(x, tiles).reshape(M, G, GROUP),
                       w.reshape(G, GROUP, -1).astype(jnp.float32), preferred_element_type=jnp.float32)
    return in_order_sum(parts * scale[:, None, :]).astype(out_dtype or x.dtype)


def supported(x, w, scale) -> bool:
    """Whether `fp8_matmul` takes these arguments: x [..., K] of a kernel dtype, w [K, N]
    FP8 with K a multiple of GROUP and N of 16, scale [K / GROUP, N] float32."""
    if getattr(w, "ndim", None) != 2 or jnp.dtype(w.dtype) not in FP8_DTYPES:
        return False
    K, N = w.shape
    return (jnp.dtype(x.dtype) in map(jnp.dtype, KERNEL_DTYPES) and x.shape[-1] == K and K % GROUP == 0
            and N % 16 == 0 and getattr(scale, "shape", None) == (K // GROUP, N) and scale.dtype == jnp.float32)


def uses_kernel(x, w, scale, tiles: Fp8Tiles | None = None) -> bool:
    """Whether a `Linear` runs `fp8_matmul` for x @ w: the kernel takes it, at most
    `tiles.max_rows` rows, on a GPU (JSPEC_KERNELS=pallas: anywhere, interpreted)."""
    t = Fp8Tiles() if tiles is None else tiles
    rows = x.size // x.shape[-1]
    if dispatch.backend() == "reference" or not supported(x, w, scale) or rows > t.max_rows:
        return False
    return dispatch.want_pallas(True)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_m: int, block_n: int, steps: int, rows: int, evict_first: bool,
            n_base: int):
    """One (row tile i, column tile j, K split s): o[s, i rows, j cols] = sum over the
    split's `steps` groups of (x tile @ w tile) * scales, the columns counted from n_base
    in w and from 0 in o. Rows past the product's (the tile's padding) are neither loaded
    nor stored."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, n0 = i * block_m, n_base + j * block_n
    real = m0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0) < rows  # [BM, 1]
    real_x = jnp.broadcast_to(real, (block_m, GROUP))
    evict = "evict_first" if evict_first else None

    def step(t, acc):
        g = s * steps + t
        k0 = pl.multiple_of(g * GROUP, GROUP)
        xv = plt.load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, GROUP)], mask=real_x, other=0)
        wv = plt.load(w_ref.at[pl.ds(k0, GROUP), pl.ds(n0, block_n)], eviction_policy=evict).astype(xv.dtype)
        part = lax.dot_general(xv, wv, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + part * s_ref[g, pl.ds(n0, block_n)][None, :]

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    plt.store(o_ref.at[s, pl.ds(m0, block_m), pl.ds(j * block_n, block_n)], acc,
              mask=jnp.broadcast_to(real, (block_m, block_n)))


def _vector_kernel(x_ref, w_ref, s_ref, o_ref, *, block_n: int, block_k: int, steps: int, rows: int,
                   evict_first: bool, n_base: int):
    """One (column tile j, K split s) of a product of a few rows, on the CUDA cores: each
    row's products accumulate elementwise in a float32 [block_k, block_n] tile and are
    summed over its rows once, at the end. o[s, :, j cols] (from n_base in w)."""
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = n_base + j * block_n
    evict = "evict_first" if evict_first else None

    def step(t, acc):
        g = s * steps + t
        scale = s_ref[g, pl.ds(n0, block_n)][None, :]
        for u in range(GROUP // block_k):
            k0 = pl.multiple_of(g * GROUP + u * block_k, block_k)
            w = plt.load(w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)], eviction_policy=evict)
            w = w.astype(jnp.float32) * scale
            acc = tuple(a + x_ref[r, pl.ds(k0, block_k)].astype(jnp.float32)[:, None] * w for r, a in enumerate(acc))
        return acc

    acc = lax.fori_loop(0, steps, step, tuple(jnp.zeros((block_k, block_n), jnp.float32) for _ in range(rows)))
    for r in range(rows):
        o_ref[s, r, pl.ds(j * block_n, block_n)] = jnp.sum(acc[r], axis=0)


def column_spans(columns: int, block_n: int) -> list[tuple[int, int, int]]:
    """[(first column, width, column tile)]: the columns that whole tiles of block_n cover,
    then the rest (a multiple of 16) in the largest power-of-two tile that divides it, so a
    width such as Qwen3.5's Gated DeltaNet in_proj (16,480 = 128 x 128 + 96) is not read
    in tiles of 32."""
    main = columns // block_n * block_n
    spans = [(0, main, block_n)] if main else []
    if columns > main:
        rest = columns - main
        spans.append((main, rest, rest & -rest if rest & -rest < block_n else block_n))
    return spans


def row_tile(rows: int, tiles: Fp8Tiles) -> int:
    """The row tile of a product of `rows` rows: the smallest power of two >= rows, at
    least 16, at most tiles.block_m."""
    return min(max(16, pow2_ceil(rows)), tiles.block_m)


def splits_of(groups: int, programs: int, tiles: Fp8Tiles, num_splits: int | None = None) -> int:
    """K splits for a grid of `programs` row and column tiles: the largest divisor of the
    groups at most num_splits (None: enough splits for about tiles.target_programs
    programs, each of at least tiles.min_split_groups groups)."""
    if num_splits is None:
        num_splits = max(1, min(-(-tiles.target_programs // programs), groups // tiles.min_split_groups))
    return max(d for d in range(1, min(num_splits, groups) + 1) if groups % d == 0)


def fp8_matmul(x, w, scale, *, out_dtype=None, float32_out: bool = False, tiles: Fp8Tiles | None = None,
               num_splits: int | None = None, interpret: bool | None = None):
    """x [..., K] @ an FP8 weight w [K, N] with scales [K / GROUP, N] float32 -> [..., N] in
    x's dtype (float32 with float32_out). tiles: `Fp8Tiles` (None: the defaults);
    num_splits: at most this many K splits (None: from the tiles). interpret None:
    interpret mode unless the default backend is a GPU. ValueError for arguments it does
    not take (`supported`)."""
    if not supported(x, w, scale):
        raise ValueError(f"fp8_matmul takes x [..., K] (float32, bfloat16 or float16), an FP8 w [K, N] with K a "
                         f"multiple of {GROUP} and N of 16, and float32 scales [K / {GROUP}, N]; got x "
                         f"{getattr(x, 'dtype', None)} {getattr(x, 'shape', x)}, w {getattr(w, 'dtype', None)} "
                         f"{getattr(w, 'shape', w)}, scale {getattr(scale, 'dtype', None)} "
                         f"{getattr(scale, 'shape', scale)}")
    t = Fp8Tiles() if tiles is None else tiles
    if not (is_pow2(t.block_m) and t.block_m >= 16 and is_pow2(t.block_n) and t.block_n >= 16):
        raise ValueError(f"block_m and block_n must be powers of two >= 16, got {t.block_m} and {t.block_n}")
    K, N = w.shape
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    G = K // GROUP
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        params = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    whole = pl.BlockSpec()
    vector = M <= t.vector_rows
    factor = None
    if not vector and rows.dtype == jnp.bfloat16:
        rows, factor = half_rows(rows)
    BM = M if vector else row_tile(M, t)
    Mp = -(-M // BM) * BM
    if Mp > M:
        rows = jnp.pad(rows, ((0, Mp - M), (0, 0)))  # never loaded (masked): in bounds for interpret mode
    outs = []
    for n_base, width, BN in column_spans(N, t.vector_block_n if vector else t.block_n):
        if vector:
            S = splits_of(G, width // BN, t, num_splits)
            kernel = functools.partial(_vector_kernel, block_n=BN, block_k=t.vector_block_k, steps=G // S, rows=M,
                                       evict_first=t.evict_first, n_base=n_base)
            grid, name = (width // BN, S), "jspec_fp8_matvec"
        else:
            S = splits_of(G, (Mp // BM) * (width // BN), t, num_splits)
            kernel = functools.partial(_kernel, block_m=BM, block_n=BN, steps=G // S, rows=M,
                                       evict_first=t.evict_first, n_base=n_base)
            grid, name = (Mp // BM, width // BN, S), "jspec_fp8_matmul"
        parts = pl.pallas_call(
            kernel, grid=grid, in_specs=[whole, whole, whole], out_specs=whole,
            out_shape=jax.ShapeDtypeStruct((S, Mp, width), jnp.float32), interpret=interpret,
            compiler_params=params, name=name,
        )(rows, w, scale)
        outs.append(in_order_sum(parts[:, :M]))  # the padding rows were never written
    y = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
    if factor is not None:
        y = y * factor
    dtype = jnp.float32 if float32_out else (out_dtype or x.dtype)
    return y.astype(dtype).reshape(x.shape[:-1] + (N,))
