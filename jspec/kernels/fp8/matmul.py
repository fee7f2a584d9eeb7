"""Pallas (Triton) products with an FP8 weight read as FP8 (`jspec.quantization`: a kernel
[K, N] in E4M3 with float32 scales [K / GROUP, N], one per group of GROUP = 128 rows and
column).

out [M, N] = sum over groups g of (x[:, g] @ w[g]) * scale[g]: each program takes BM rows
and BN columns and walks its share of the groups; a step loads x's [BM, 128] tile and the
weight's [128, BN] FP8 tile, widens the weight to x's dtype (E4M3 values are exact in
bfloat16 and float16), multiplies on the tensor cores into float32 and adds the product
times that group's column scales to the float32 accumulator. The weight's bytes are read
once per row tile: at decode sizes (a few rows) the product is bound by reading the weight,
and FP8 halves those bytes. XLA has no such product: a weight dequantized in the graph is
written out in bfloat16 and read again (H200, docs/benchmarks.md: 2.6x slower than bfloat16
at 32 rows).

Rows are padded to a multiple of BM (at least 16, the tensor cores' smallest tile). K splits
(more programs when the row and column tiles are few) write float32 partial sums [S, M, N]
that the wrapper adds in split order (`tiling.in_order_sum`). The numerics differ from
dequantizing first (each group's float32 sum is scaled, not each weight), by float32
rounding: `matmul_reference` computes the same order in jnp.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels import dispatch
from jspec.kernels.tiling import KERNEL_DTYPES, in_order_sum, is_pow2
from jspec.quantization import FP8_DTYPES, GROUP


@dataclasses.dataclass(frozen=True)
class Fp8Tiles:
    """Tiles of `fp8_matmul` (`Tuning.fp8`). block_m: rows a program (at least 16); the rows
    of a product are padded to it. block_n: columns a program. target_programs: K splits
    are added until the grid has about this many programs (four per SM on an H200), each
    split walking at least min_split_groups groups. max_rows: `Linear` runs the kernel for
    products of at most this many rows; more (a prompt's blocks) dequantize the weight and
    run XLA's product, which is then bound by arithmetic."""

    block_m: int = 16
    block_n: int = 128
    target_programs: int = 528
    min_split_groups: int = 2
    num_warps: int = 4
    num_stages: int = 3
    max_rows: int = 256


def matmul_reference(x, w, scale, out_dtype=None):
    """`fp8_matmul` in jnp: x [M, K] @ (w [K, N] FP8, scale [K / GROUP, N]) -> [M, N], each
    group's product in float32 times its scales, summed in group order."""
    M, K = x.shape
    G = K // GROUP
    parts = jnp.einsum("mgk,gkn->gmn", x.reshape(M, G, GROUP).astype(jnp.float32),
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


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_m: int, block_n: int, groups_per_split: int, groups: int):
    """One (row tile i, column tile j, K split s): o[s, i rows, j cols] = sum over the
    split's groups of (x tile @ w tile) * scales."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, n0 = i * block_m, j * block_n
    lo = s * groups_per_split
    hi = jnp.minimum(lo + groups_per_split, groups)

    def step(g, acc):
        k0 = g * GROUP
        xv = x_ref[pl.ds(m0, block_m), pl.ds(k0, GROUP)]
        wv = w_ref[pl.ds(k0, GROUP), pl.ds(n0, block_n)].astype(xv.dtype)
        part = lax.dot_general(xv, wv, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + part * s_ref[g, pl.ds(n0, block_n)][None, :]

    acc = lax.fori_loop(lo, hi, step, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[s, pl.ds(m0, block_m), pl.ds(n0, block_n)] = acc


def fp8_matmul(x, w, scale, *, out_dtype=None, float32_out: bool = False, tiles: Fp8Tiles | None = None,
               num_splits: int | None = None, interpret: bool | None = None):
    """x [..., K] @ an FP8 weight w [K, N] with scales [K / GROUP, N] float32 -> [..., N] in
    x's dtype (float32 with float32_out). tiles: `Fp8Tiles` (None: the defaults);
    num_splits: K splits (None: from the tiles). interpret None: interpret mode unless the
    default backend is a GPU. ValueError for arguments it does not take (`supported`)."""
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
    BM = t.block_m
    BN = t.block_n
    while N % BN:
        BN //= 2
    Mp = -(-M // BM) * BM
    rows = jnp.pad(rows, ((0, Mp - M), (0, 0)))
    G = K // GROUP
    tiles_mn = (Mp // BM) * (N // BN)
    if num_splits is None:
        num_splits = max(1, min(-(-t.target_programs // tiles_mn), G // t.min_split_groups))
    per_split = -(-G // min(num_splits, G))
    S = -(-G // per_split)  # no empty splits
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    whole = pl.BlockSpec()
    parts = pl.pallas_call(
        functools.partial(_kernel, block_m=BM, block_n=BN, groups_per_split=per_split, groups=G),
        grid=(Mp // BM, N // BN, S),
        in_specs=[whole, whole, whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((S, Mp, N), jnp.float32),
        interpret=interpret,
        compiler_params=params,
        name="jspec_fp8_matmul",
    )(rows, w, scale)
    y = in_order_sum(parts)[:M]
    dtype = jnp.float32 if float32_out else (out_dtype or x.dtype)
    return y.astype(dtype).reshape(x.shape[:-1] + (N,))
