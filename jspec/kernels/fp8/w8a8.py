"""Pallas **Mosaic GPU** FP8 x FP8 product for a prompt's rows (w8a8, Hopper wgmma): the
rows rounded to E4M3 per token and group of GROUP (128) input columns, times an FP8 weight
w [K, N] with its scales [K / GROUP, N], as DeepSeek's reference inference, SGLang and vLLM
compute block-FP8 layers.

Numerics (`w8a8_reference`): x8, xs = `quantize_rows(x)` (each row's group divided by its
largest magnitude over 448, rounded to E4M3); out [M, N] = sum over groups g, in group
order, of (x8[:, g] @ w[g]) * (xs[:, g] x scale[g]) in float32. The tensor cores take the
E4M3 operands as they are (their products exact) and sum a group in their own order and
precision; the group's sum is then scaled and added to a float32 accumulator in registers
(per-group promotion, as DeepGEMM does), so the kernel equals the reference up to that
summation (relative error about 1e-4 on small shapes, 2e-5 on the 8B shape's
projections, H200).

Why: at prompt rows the products are bound by arithmetic, and Hopper's FP8 tensor cores do
twice bfloat16's. jspec's other FP8 paths widen the weight to 16 bits (the decode kernels;
a prompt's blocks dequantize it in the graph for XLA's bfloat16 product), so they gain
bytes, not arithmetic (docs/benchmarks.md, "What do FP8 weights gain on the GPU?").
Measured (H200, jax 0.11.2): 0.97-1.38x the dequantized path at 2,048 rows (across calls),
0.88-0.89x at 8,192, 1.7-2.2x at 512 and 1.4-3.9x at 128; 0.76-0.93x XLA's bfloat16 product
at 2,048 rows, 1.08-1.24x at 128 rows with K splits. In the 8B model it makes a batch-32
chain round, whose verification has 128 rows, 2.4x faster than the dequantized path (16.3
-> 6.9 ms, across two calls), and a prompt 2-4% faster, so `Linear` takes it from 65 rows,
past the Triton kernel's (docs/benchmarks.md, "A Mosaic GPU w8a8 kernel over jspec's
[K, N] weights").

Design (grid (row blocks, column blocks, K splits), row blocks fastest so the CTAs reading
one column block of the weight run together and share L2):

- K splits where the row and column blocks are too few to fill the SMs (a product of a
  hundred rows): each split's CTAs sum their range of the groups, write float32 partial
  sums [S, M, N], and the wrapper adds them in split order (`W8a8Tiles.num_splits`,
  `mosaic.splits_of`).

- The product is computed transposed, out^T [block_n, rows] = w^T [block_n, K] @ x8^T
  [K, rows]. An 8-bit wgmma operand in shared memory must be K-major: the rows x8 [M, K]
  are (wgmma's B, through a transposed view of the TMA tile), the weight [K, N] is not, so
  the weight is wgmma's A operand from registers (`fp8_to_regs`): each thread loads four
  bytes (its four adjacent weight columns) from each of four consecutive weight rows and
  transposes the 4 x 4 bytes with byte permutes (prmt), which gives A's registers in
  Mosaic's WGMMA_8BIT layout (four consecutive K values of one row a register), the
  product's rows permuted as `mosaic.scales_to_regs` and `mosaic.store_from_regs` expect
  (weight column n = RT g + 2 i0 + i4; see `kernels.fp8.mosaic`).
- Warp-specialized (`plgpu.emit_pipeline_warp_specialized`, as Pallas' own Hopper matmul
  and DeepGEMM): a memory warpgroup keeps `stages` groups of tiles in flight (the rows'
  x8 [block_m, GROUP] and the weight's [GROUP, block_n] by TMA, 128-byte swizzle, and
  their scales [1, block_m] (xs stored [G, M]) and [1, block_n]); two compute warpgroups
  each take half of the block's rows against the same weight tile, so one's promotion
  (the group's float32 sums times row x column scales, added to the accumulator in
  registers) runs while the other's product is on the tensor cores. A single warpgroup
  a CTA, waiting for each group's product before scaling it, ran 1.3-1.5x slower.
- Each compute warpgroup writes its product [block_m / 2, block_n] in the output dtype
  (a shared-memory tile, then TMA).

Interpret mode (the CPU, jax's Mosaic GPU interpreter, which has no inline_mgpu nor
transposed wgmma operands): the tiles are widened to float16 (exact for E4M3) and stored
transposed for a plain wgmma; the same group products, scales and sums.

Dispatch: `models.layers.Linear` runs this kernel on a Hopper GPU for products of at least
`W8a8Tiles.min_rows` rows (0: never) outside the row-invariant mode (`uses_kernel`).

MoE experts grouped by expert (`fp8_w8a8_grouped`): the same kernel over the (token,
expert) pairs laid out by `kernels.moe.grouped.group_layout`, every row block one expert's;
each CTA reads its block's expert from tile_expert and takes that expert's views of the
flat stacks [E K, N] and [E G, N] (a block of expert -1 runs nothing). `grouped.grouped`
runs it for FP8 stacks on Hopper from `W8a8Tiles.min_pairs_per_expert` pairs an expert
(or fewer, where its Triton kernel would copy a stack: `grouped.uses_w8a8`).
Measured (H200, jax 0.11.2, both products of the routed experts): V2-Lite's 1.3-2.1x the
Triton grouped kernel over the FP8 stacks from 48 pairs an expert (1.24-1.31x bf16 from 192),
V3's 1.3-2.1x from 4; a 4,096-token V2-Lite prompt 1.56x faster in FP8, 1.08x bf16
(docs/benchmarks.md, "w8a8 for the grouped experts").
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.kernels import dispatch
from jspec.kernels.fp8 import mosaic
from jspec.kernels.tiling import in_order_sum
from jspec.quantization import E4M3_MAX, GROUP

TINY = 1e-12  # the smallest group maximum a row's scale is taken from (an all-zero group)


@dataclasses.dataclass(frozen=True)
class W8a8Tiles:
    """block_n: weight columns a CTA (wgmma M; 128 or 256). block_m: rows a CTA (a multiple
    of 16 from 32 to 256: 16, 8 rows a warpgroup, gave a misaligned address on an H200),
    half to each compute warpgroup (wgmma N: block_m / 2; the two float32
    accumulators take block_n x block_m / 128 registers a thread: 128 at the defaults).
    stages: pipeline steps in flight. min_rows: `Linear` runs the kernel for products of at
    least this many rows on a Hopper GPU (0: never); 65 by default, the first row count past
    `Fp8Tiles.max_rows` (64), up to which the Triton FP8 kernel is as fast or faster (the
    8B shape's down projection at 64 rows: 45 us against 83). num_splits: K splits, each
    CTA summing a range of the groups into float32 partial sums that the wrapper adds in
    split order (None: enough for about target_ctas CTAs, each split at least
    min_split_groups groups; `mosaic.splits_of`): few rows over few column blocks leave
    most SMs idle otherwise (the 8B down projection at 128 rows: 32 CTAs). Defaults: the
    best of those measured on the 8B shape's projections (docs/benchmarks.md)."""

    block_n: int = 128
    block_m: int = 128
    stages: int = 4
    min_rows: int = 65
    num_splits: int | None = None
    target_ctas: int = 132  # an H100's or H200's SMs: one warp-specialized CTA each
    min_split_groups: int = 4
    # MoE experts grouped by expert (`kernels.moe.grouped`: prompt passes, large batches):
    # FP8 stacks take `fp8_w8a8_grouped` on a Hopper GPU from min_pairs_per_expert (token,
    # expert) pairs an expert (0: never), in row blocks of grouped_block_m rows, or of
    # grouped_large_block_m from grouped_large_from pairs an expert (`grouped_block_rows`).
    # Measured (H200, both products): against the Triton grouped kernel over the FP8 stacks,
    # V2-Lite's experts 0.98x at 12 pairs an expert, 1.32x at 48, 2.0-2.1x from 384;
    # 64-row blocks 11-13% faster than 128 at 16-48 pairs an expert, 128-row blocks 16-45%
    # faster from 64 (docs/benchmarks.md, "w8a8 for the grouped experts").
    min_pairs_per_expert: int = 16
    grouped_block_m: int = 64
    grouped_large_block_m: int = 128
    grouped_large_from: int = 64

    def __post_init__(self):
        if any(b % 16 or not 32 <= b <= 256 for b in (self.block_m, self.grouped_block_m, self.grouped_large_block_m)):
            raise ValueError(f"W8a8Tiles takes block_m, grouped_block_m and grouped_large_block_m multiples of 16 from "
                             f"32 to 256; got {self}")
        if self.block_n not in (128, 256):
            raise ValueError(f"W8a8Tiles takes block_n 128 or 256; got {self}")
        if (self.stages < 1 or self.min_rows < 0 or self.num_splits is not None and self.num_splits < 1
                or self.target_ctas < 1 or self.min_split_groups < 1 or self.min_pairs_per_expert < 0):
            raise ValueError(f"W8a8Tiles takes stages >= 1, min_rows >= 0, num_splits None or >= 1, target_ctas >= 1, "
                             f"min_split_groups >= 1 and min_pairs_per_expert >= 0; got {self}")


def quantize_rows(x):
    """x [M, K] (K a multiple of GROUP) -> (x8 [M, K] E4M3, xs [M, K / GROUP] float32): each
    row's group of GROUP columns divided by xs = its largest magnitude over 448 (at least
    TINY / 448) and rounded to E4M3, so x ~ x8 * xs group by group."""
    M, K = x.shape
    xg = x.astype(jnp.float32).reshape(M, K // GROUP, GROUP)
    xs = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), TINY) / E4M3_MAX  # [M, G]
    x8 = (xg / xs[..., None]).astype(jnp.float8_e4m3fn).reshape(M, K)
    return x8, xs


def w8a8_reference(x, w, scale, out_dtype=None):
    """The kernel's numerics in jnp: x [M, K] @ (w [K, N] FP8, scale [K / GROUP, N]) with the
    rows rounded by `quantize_rows`; each group's float32 product times (row scale x column
    scale), summed in group order."""
    M, K = x.shape
    G = K // GROUP
    x8, xs = quantize_rows(x)
    parts = jnp.einsum("mgk,gkn->gmn", x8.astype(jnp.float32).reshape(M, G, GROUP),
                       w.reshape(G, GROUP, -1).astype(jnp.float32), preferred_element_type=jnp.float32)
    return in_order_sum(parts * (xs.T[:, :, None] * scale[:, None, :])).astype(out_dtype or x.dtype)


def supported(x, w, scale, tiles: W8a8Tiles | None = None) -> bool:
    """Whether `fp8_w8a8_mosaic` takes these arguments: x [..., K] bfloat16, float16 or
    float32, w [K, N] E4M3 with K a multiple of GROUP and N of the tiles' block_n, scale
    [K / GROUP, N] float32."""
    t = tiles or W8a8Tiles()
    if getattr(w, "ndim", None) != 2 or jnp.dtype(w.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        return False
    K, N = w.shape
    return (jnp.dtype(x.dtype) in map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32)) and x.shape[-1] == K
            and K % GROUP == 0 and N % t.block_n == 0 and getattr(scale, "shape", None) == (K // GROUP, N)
            and scale.dtype == jnp.float32)


def uses_kernel(x, w, scale, tiles: W8a8Tiles | None = None) -> bool:
    """Whether a `Linear` runs `fp8_w8a8_mosaic` for x @ w: at least tiles.min_rows rows
    (0: never), arguments it takes, kernels not switched off (JSPEC_KERNELS=reference) and
    a Hopper GPU (`mosaic.on_hopper`)."""
    t = tiles or W8a8Tiles()
    rows = x.size // max(x.shape[-1], 1)
    return (t.min_rows > 0 and rows >= t.min_rows and supported(x, w, scale, t) and dispatch.backend() != "reference"
            and mosaic.on_hopper())


# ---- wgmma's A operand from registers: the FP8 weight tile transposed ----------------------
#
# Mosaic's WGMMA_8BIT register layout of A [block_n, GROUP]: a thread (warp w, lane l) holds
# rows r = 64 i0 + 16 w + 8 i4 + l // 4 at columns (k) 16 b + 4 (l % 4) + {0, 1, 2, 3}, one
# 32-bit register (four bytes, k ascending) for each (i0, b, i4). Row r is weight column
# n = RT g + 2 i0 + i4 (g = 8 w + l // 4, RT = block_n / 32), as in `kernels.fp8.mosaic`, so
# one RT-byte load of a weight row brings all of a thread's columns, and four such loads
# (rows k .. k + 3) are a 4 x 4 byte block that prmt transposes into four registers.

_TRANSPOSE = """{
.reg .b32 t0, t1, t2, t3;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
prmt.b32 t2, $6, $7, 0x5140;
prmt.b32 t3, $6, $7, 0x7362;
prmt.b32 $0, t0, t2, 0x5410;
prmt.b32 $1, t0, t2, 0x7632;
prmt.b32 $2, t1, t3, 0x5410;
prmt.b32 $3, t1, t3, 0x7632;
}"""


def fp8_to_regs(block_n: int):
    """inline_mgpu: the E4M3 tile ref [GROUP, block_n] (tiling (8, 128), 128-byte swizzle) ->
    w^T [block_n, GROUP] E4M3 in the WGMMA_8BIT register layout, rows permuted (above)."""
    rt = block_n // 32

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=mosaic.tiled(block_n, 1)),),
                       return_type=plgpu.ShapeDtypeStruct((block_n, GROUP), jnp.float8_e4m3fn,
                                                          layout=plgpu.Layout.WGMMA_8BIT))
    def load(ctx, w_ref):
        mgpu, mu, ir, arith, llvm, vector = mosaic.mgpu_modules()
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        c = lambda v: arith.constant(i32, v)
        g, q = mosaic.thread_coords()
        ptr = mu.memref_ptr(w_ref)
        n0 = arith.muli(g, c(rt))  # the thread's first weight column
        # the tile's bytes are laid [k // 8][n // 128][k % 8][n % 128]; the swizzle XORs the
        # 16-byte chunk (address bits 4-6) with the row in the 8-row tile (bits 7-9)
        col = arith.addi(arith.muli(arith.divui(n0, c(128)), c(1024)), arith.remui(n0, c(128)))
        bases = []
        for e in range(4):  # rows 4 q + e of each 16-row chunk
            r = arith.addi(arith.muli(q, c(4)), c(e))
            tile, rin = arith.divui(r, c(8)), arith.remui(r, c(8))
            pre = arith.addi(arith.addi(arith.muli(tile, c(8 * block_n)), arith.muli(rin, c(128))), col)
            bases.append(arith.xori(pre, arith.shli(rin, c(4))))
        load_ty = ir.VectorType.get((rt // 4,), i32)
        f8x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        regs = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape((block_n, GROUP)), dtype=object)
        for b in range(GROUP // 16):
            words = [llvm.load(load_ty, mu.getelementptr(ptr, [arith.addi(base, c(b * 16 * block_n))], i8))
                     for base in bases]
            for h in range(rt // 4):
                block = [vector.extract(word, [], [h]) for word in words]
                res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), block, _TRANSPOSE,
                                      "=r,=r,=r,=r,r,r,r,r", has_side_effects=False)
                for u in range(4):
                    jj = 4 * h + u  # column n0 + jj: row (i0, i4) = divmod(jj, 2)
                    regs[(jj // 2, b, 0, 0, jj % 2, 0, 0, 0, 0)] = mu.bitcast(llvm.extractvalue(i32, res, [u]), f8x4)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return load


def cols_to_regs(block_m: int):
    """inline_mgpu: the rows' scales ref [1, block_m] float32 -> [block_m] in the WGMMA
    column layout (a thread's columns 8 j + 2 (l % 4) + {0, 1})."""
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((block_m,), jnp.float32, layout=col_layout))
    def cols(ctx, s_ref):
        mgpu, mu, ir, arith, llvm, vector = mosaic.mgpu_modules()
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        c = lambda v: arith.constant(i32, v)
        _, q = mosaic.thread_coords()
        ptr = mu.memref_ptr(s_ref)
        layout = col_layout.to_mgpu()
        regs = np.empty(layout.registers_shape((block_m,)), dtype=object)
        vec2 = ir.VectorType.get((2,), f32)
        for j in range(block_m // 8):
            regs[(j, 0, 0)] = llvm.load(vec2, mu.getelementptr(ptr, [arith.addi(arith.muli(q, c(2)), c(8 * j))], f32))
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return cols


def _specs(block_n: int, block_m: int):
    """The pipeline's tiles a group: the rows x8 [block_m, GROUP], their scales [1, block_m],
    the weight [GROUP, block_n] and its scales [1, block_n]."""
    return [
        plgpu.BlockSpec((block_m, GROUP), lambda t: (0, t), transforms=mosaic.tiled(GROUP, 1)),
        plgpu.BlockSpec((1, block_m), lambda t: (t, 0)),
        plgpu.BlockSpec((GROUP, block_n), lambda t: (t, 0), transforms=mosaic.tiled(block_n, 1)),
        plgpu.BlockSpec((1, block_n), lambda t: (t, 0)),
    ]


def _split_operands(x_gmem, xs_gmem, w_gmem, s_gmem, rows, cols, groups: int):
    """The pipeline's operands of row block `rows`, column block `cols` and K split k (the
    grid's "k"): its `groups` groups of the rows, their scales, the weight and its scales."""
    g0 = lax.axis_index("k") * groups
    ks = pl.ds(g0 * GROUP, groups * GROUP)
    gs = pl.ds(g0, groups)
    return x_gmem.at[rows, ks], xs_gmem.at[gs, rows], w_gmem.at[ks, cols], s_gmem.at[gs, cols]


def _out_block(o_gmem, rows, cols, split: bool):
    """Where a block's output goes: o_gmem [M, N] (one split) or [S, M, N] (float32 partial
    sums, split k at k)."""
    return o_gmem.at[lax.axis_index("k"), rows, cols] if split else o_gmem.at[rows, cols]


def _kernel(x_gmem, xs_gmem, w_gmem, s_gmem, o_gmem, *, block_n: int, block_m: int, groups: int, stages: int,
            split: bool):
    """One (row block i, column block j, K split k) of the product on the GPU. x_gmem
    [M, K] E4M3, xs_gmem [G, M] float32, w_gmem [K, N] E4M3, s_gmem [G, N] float32, o_gmem
    [M, N] (or [S, M, N] float32 with split); `groups`: a split's groups.

    Warp-specialized (`plgpu.emit_pipeline_warp_specialized`): a memory warpgroup issues the
    TMA copies; two compute warpgroups each take half of the block's rows against the same
    weight tile, so one's promotion (its group's sums scaled and added) runs while the
    other's product is on the tensor cores. Each builds A from the weight tile itself
    (`fp8_to_regs`)."""
    i, j = lax.axis_index("m"), lax.axis_index("n")
    rows, cols = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)
    half = block_m // 2  # a compute warpgroup's rows

    def step(_, x_smem, xs_smem, w_smem, s_smem, total):
        mine = pl.ds(lax.axis_index("wg") * half, half)
        ws = mosaic.scales_to_regs(block_n)(s_smem.at[0])  # [block_n], permuted rows
        xs = cols_to_regs(half)(xs_smem.at[0, mine])  # [half]
        a = fp8_to_regs(block_n)(w_smem)  # w^T [block_n, GROUP] E4M3, permuted rows

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(x_smem.at[mine], (1, 0)))
            return acc_ref[...]

        part = pl.run_scoped(mma, plgpu.ACC((block_n, half), jnp.float32))  # [block_n, half]
        both = lax.broadcast_in_dim(ws, (block_n, half), [0]) * lax.broadcast_in_dim(xs, (block_n, half), [1])
        return total + part * both

    def scope(out_smem):
        def compute(run_pipeline):
            wg = lax.axis_index("wg")
            total = run_pipeline(plgpu.layout_cast(jnp.zeros((block_n, half), jnp.float32), plgpu.Layout.WGMMA))
            mine = out_smem.at[wg]
            mosaic.store_from_regs(block_n, half, out_smem.dtype, False)(plgpu.layout_cast(total, plgpu.Layout.WGMMA),
                                                                          mine)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(mine, _out_block(o_gmem, pl.ds(i * block_m + wg * half, half), cols, split))
            plgpu.wait_smem_to_gmem(0)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(groups,), memory_registers=40, in_specs=_specs(block_n, block_m), wg_axis="wg",
            num_compute_wgs=2, max_concurrent_steps=stages, compute_context=compute)
        pipeline(*_split_operands(x_gmem, xs_gmem, w_gmem, s_gmem, rows, cols, groups))

    pl.run_scoped(scope, plgpu.SMEM((2, half, block_n), o_gmem.dtype), collective_axes="wg")


def _kernel_interpreted(x_gmem, xs_gmem, w_gmem, s_gmem, o_gmem, out_smem, wt_smem, xt_smem, *, block_n: int,
                        block_m: int, groups: int, stages: int, split: bool):
    """`_kernel`'s product in jax's Mosaic GPU interpreter (the CPU): one warpgroup, the
    tiles widened to float16 (exact for E4M3) and stored transposed for a plain wgmma (the
    interpreter has no inline_mgpu nor transposed operands); the same group products,
    scales and sums."""
    i, j = lax.axis_index("m"), lax.axis_index("n")
    rows, cols = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)

    def step(_, x_smem, xs_smem, w_smem, s_smem, total):
        wt_smem[...] = w_smem[...].astype(jnp.float16).T
        xt_smem[...] = x_smem[...].astype(jnp.float16).T
        ws, xs = s_smem[0], xs_smem[0]
        plgpu.commit_smem()

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, wt_smem, xt_smem)
            return acc_ref[...]

        part = pl.run_scoped(mma, plgpu.ACC((block_n, block_m), jnp.float32))
        return total + part * (ws[:, None] * xs[None, :])

    pipeline = plgpu.emit_pipeline(step, grid=(groups,), in_specs=_specs(block_n, block_m),
                                   max_concurrent_steps=stages, init_carry=jnp.zeros((block_n, block_m), jnp.float32))
    total = pipeline(*_split_operands(x_gmem, xs_gmem, w_gmem, s_gmem, rows, cols, groups))
    out_smem[...] = total.T.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, _out_block(o_gmem, rows, cols, split))
    plgpu.wait_smem_to_gmem(0)


def fp8_w8a8_mosaic(x, w, scale, *, out_dtype=None, float32_out: bool = False, tiles: W8a8Tiles | None = None,
                    interpret: bool | None = None, **tile_overrides):
    """x [..., K] (bfloat16, float16 or float32) @ an E4M3 weight w [K, N] with scales
    [K / GROUP, N] float32, the rows rounded to E4M3 per group (`quantize_rows`) -> [..., N]
    in x's dtype (float32 with float32_out; out_dtype if given). tiles: `W8a8Tiles`,
    overridden field by field by tile_overrides. interpret None: interpret mode unless the
    default backend is a GPU."""
    t = dataclasses.replace(tiles or W8a8Tiles(), **tile_overrides)
    if not supported(x, w, scale, t):
        raise ValueError(f"fp8_w8a8_mosaic takes x [..., K] (bfloat16, float16 or float32), an E4M3 w [K, N] with K "
                         f"a multiple of {GROUP} and N of block_n={t.block_n}, and float32 scales [K / {GROUP}, N]; "
                         + mosaic.operands_text(x, w, scale))
    K, N = w.shape
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    Mp = -(-M // t.block_m) * t.block_m
    dtype = jnp.dtype(jnp.float32 if float32_out else (out_dtype or x.dtype))
    y = _launch(jnp.pad(rows, ((0, Mp - M), (0, 0))), w, scale, None, t, dtype, interpret)[:M]
    return y.reshape(x.shape[:-1] + (N,))


def _launch(x, w, scale, tile_expert, t: W8a8Tiles, dtype, interpret):
    """The kernel over x [Mp, K] (Mp whole blocks of t.block_m rows) -> [Mp, N] in dtype:
    w [K, N] and scale [G, N] (tile_expert None), or stacks w [E, K, N] and scale [E, G, N]
    with tile_expert [Mp / block_m] naming each row block's expert (-1: none, its rows left
    unwritten; `fp8_w8a8_grouped`)."""
    mode = mosaic.interpreter(interpret)
    K, N = w.shape[-2:]
    G = K // GROUP
    BM, BN = t.block_m, t.block_n
    Mp = x.shape[0]
    x8, xs = quantize_rows(x)
    S = mosaic.splits_of(G, (Mp // BM) * (N // BN), t)
    block_dtype = jnp.dtype(jnp.float32) if S > 1 else dtype  # partial sums, or the product itself
    sizes = dict(block_n=BN, block_m=BM, groups=G // S, stages=min(t.stages, G // S), split=S > 1)
    if mode is not None:
        body, extra = functools.partial(_kernel_interpreted, **sizes), {}
        scratch = [plgpu.SMEM((BM, BN), block_dtype), plgpu.SMEM((BN, GROUP), jnp.float16),
                   plgpu.SMEM((GROUP, BM), jnp.float16)]
    else:
        body, extra, scratch = functools.partial(_kernel, **sizes), dict(num_threads=3, thread_name="wg"), []
    args = (x8, xs.T, w, scale)
    if tile_expert is not None:
        body = functools.partial(_expert_block, body=body, K=K)
        args = (tile_expert.astype(jnp.int32), x8, xs.T, w.reshape(-1, N), scale.reshape(-1, N))

    def jspec_fp8_w8a8(*refs):  # the kernel's name (profiles, HLO)
        return body(*refs)
    out = plgpu.kernel(
        jspec_fp8_w8a8, out_type=jax.ShapeDtypeStruct((S, Mp, N) if S > 1 else (Mp, N), block_dtype),
        scratch_types=scratch, grid=(Mp // BM, N // BN, S), grid_names=("m", "n", "k"),
        compiler_params=plgpu.CompilerParams(), interpret=mode, **extra,
    )(*args)
    return in_order_sum(out).astype(dtype) if S > 1 else out


def _expert_block(te_gmem, x_gmem, xs_gmem, w_gmem, s_gmem, *refs, body, K: int):
    """Row block i (grid axis "m") of `fp8_w8a8_grouped`: `body` (`_kernel` or
    `_kernel_interpreted`) over the views of its expert e = tile_expert[i] in the flat
    stacks w_gmem [E K, N] and s_gmem [E G, N]; a block of expert -1 runs nothing."""
    e = te_gmem[lax.axis_index("m")]
    G = K // GROUP

    @pl.when(e >= 0)
    def _():
        body(x_gmem, xs_gmem, w_gmem.at[pl.ds(e * K, K)], s_gmem.at[pl.ds(e * G, G)], *refs)


def grouped_block_rows(pairs: int, num_experts: int, tiles: W8a8Tiles | None = None) -> int:
    """The row block of `fp8_w8a8_grouped` for `pairs` (token, expert) pairs over
    `num_experts` experts: tiles.grouped_block_m, or grouped_large_block_m from
    grouped_large_from pairs an expert (fewer rows of padding a group against fewer reads
    of its expert's weight)."""
    t = tiles or W8a8Tiles()
    return t.grouped_large_block_m if pairs >= t.grouped_large_from * num_experts else t.grouped_block_m


def grouped_supported(x, tile_expert, w, scale, tiles: W8a8Tiles | None = None) -> bool:
    """Whether `fp8_w8a8_grouped` takes these arguments: x [R, K] (bfloat16, float16 or
    float32; R whole blocks of tiles.block_m rows), tile_expert [R / block_m] integer, w
    [E, K, N] E4M3 with K a multiple of GROUP and N of tiles.block_n, scale [E, K / GROUP, N]
    float32."""
    t = tiles or W8a8Tiles()
    if getattr(w, "ndim", None) != 3 or getattr(x, "ndim", None) != 2 or x.shape[0] % t.block_m:
        return False
    E, K, N = w.shape
    return (getattr(tile_expert, "shape", None) == (x.shape[0] // t.block_m,)
            and jnp.issubdtype(tile_expert.dtype, jnp.integer) and getattr(scale, "shape", None) == (E, K // GROUP, N)
            and supported(x, jax.ShapeDtypeStruct((K, N), w.dtype), jax.ShapeDtypeStruct((K // GROUP, N), scale.dtype),
                          t))


def fp8_w8a8_grouped(x, tile_expert, w, scale, *, out_dtype=None, tiles: W8a8Tiles | None = None,
                     interpret: bool | None = None, **tile_overrides):
    """Grouped expert products in w8a8: x [R, K] in row blocks of tiles.block_m rows, each
    block one expert's (`kernels.moe.grouped.group_layout`), tile_expert [R / block_m] int
    (each block's expert; -1: none), w [E, K, N] E4M3 with scales [E, K / GROUP, N] float32
    -> [R, N] in x's dtype (out_dtype if given): block i's rows times w[tile_expert[i]] as
    `fp8_w8a8_mosaic` computes a product (`w8a8_grouped_reference`); the rows of blocks of
    expert -1 are left unwritten. tiles: `W8a8Tiles`, overridden field by field."""
    t = dataclasses.replace(tiles or W8a8Tiles(), **tile_overrides)
    if not grouped_supported(x, tile_expert, w, scale, t):
        raise ValueError(f"fp8_w8a8_grouped takes x [R, K] (bfloat16, float16 or float32, R whole blocks of "
                         f"block_m={t.block_m} rows), tile_expert [R / block_m] int, an E4M3 w [E, K, N] with K a "
                         f"multiple of {GROUP} and N of block_n={t.block_n}, and float32 scales [E, K / {GROUP}, N]; "
                         f"got tile_expert {getattr(tile_expert, 'dtype', None)} "
                         f"{getattr(tile_expert, 'shape', tile_expert)}, " + mosaic.operands_text(x, w, scale))
    return _launch(x, w, scale, tile_expert, t, jnp.dtype(out_dtype or x.dtype), interpret)


def w8a8_grouped_reference(x, tile_expert, w, scale, block_m: int, out_dtype=None):
    """`fp8_w8a8_grouped`'s numerics in jnp: each row block of x [R, K] through
    `w8a8_reference` with its expert's weight; blocks of expert -1 give zeros."""
    R, K = x.shape
    T = R // block_m
    e = jnp.clip(tile_expert, 0, w.shape[0] - 1)
    out = jax.vmap(lambda xb, wb, sb: w8a8_reference(xb, wb, sb, out_dtype=jnp.float32))(
        x.reshape(T, block_m, K), w[e], scale[e])
    out = jnp.where((tile_expert >= 0)[:, None, None], out, 0.0)
    return out.reshape(R, -1).astype(out_dtype or x.dtype)
