"""Pallas **Mosaic GPU** product of a few rows with an FP8 weight (Hopper: TMA and wgmma),
the decode-rows counterpart of `jspec.kernels.fp8.matmul` (same numerics as
`matmul.matmul_reference`: out [M, N] = sum over groups g of (x[:, g] @ w[g]) * scale[g],
each group's product in float32, summed in group order).

Why: at decode (M = 1..16 rows) the product is bound by reading the weight, and the
Triton kernels of `matmul` stream the FP8 weight at 2.0-2.6 TB/s, so FP8 gains little
over XLA's bfloat16 product (~4.1 TB/s of bfloat16 bytes). Here the weight streams through
bulk tensor copies (TMA) several stages deep (`plgpu.emit_pipeline`).

Design (one warpgroup a CTA; grid (column blocks, K splits), `plgpu.kernel`):

- The product is computed transposed, out^T [block_n, Mp] = w^T [block_n, K] @ x^T
  [K, Mp], so the weight is wgmma's A operand (the instruction's M: block_n, a multiple
  of 64) and the few rows are its N (Mp = 8 or 16, the smallest wgmma N that holds
  them): no padding of the rows to 64.
- A pipeline step takes one group (GROUP = 128 weight rows): the FP8 tile [128,
  block_n] (TMA, 128-byte swizzle), the rows' tile x [Mp, 128] float16 and the group's
  scales [1, block_n]. The group's float32 product [block_n, Mp] (a fresh wgmma
  accumulator) is multiplied by its column scales and added to a float32 register
  accumulator, so each group is scaled as `matmul_reference` does.
- A from registers (a_regs, the GPU default, block_n 128 or 256; `_widen_to_regs`): each
  thread loads the bytes of its A fragment straight from the FP8 tile (the product's rows
  permuted so that they are adjacent weight columns: one 4- or 8-byte load a weight row),
  interleaves two rows with prmt and widens with cvt.rn.f16x2.e4m3x2 (E4M3 is exact in
  float16): 2 bytes of shared-memory traffic per weight byte (the TMA write, one read).
  The scales and the output store follow the same permutation (`scales_to_regs`,
  `store_from_regs`), so it never leaves the kernel. Hand-written Mosaic GPU code
  (`plgpu.inline_mgpu`): GPU only.
- Shared-memory path (a_regs=False, block_n 64, and interpret mode): the FP8 tile is
  loaded into registers in Mosaic's layouts, widened, stored as a swizzled float16 tile
  that wgmma reads transposed (MN-major A, allowed for 16-bit types): 6 bytes of
  shared-memory traffic per weight byte, ~10% slower on gate_up.
- The rows are multiplied in float16 as the Triton tensor-core kernel multiplies them
  (`matmul.half_rows`: each row divided by a power of two that keeps it in float16's
  range, its sums multiplied back), so bfloat16 rows match `matmul_reference` with
  `Fp8Tiles(vector_rows=0)` up to float32 summation order (relative error ~1e-7 on the 8B
  shapes).
- K splits (more CTAs when the column blocks are few: an H200 has 132 SMs) write float32
  partial sums [S, Mp, N] that the wrapper adds in split order (`tiling.in_order_sum`).
  With one split (fuse_out) the kernel writes the product [M, N] in the output dtype
  itself, the rows times their factors.

Measured (H200, jax 0.11.2, default tiles, .probe/mosaic/run3): the kernel alone streams
the FP8 weight at 3.9 TB/s on gate_up [4096, 28672] (30.1 us; XLA's bfloat16 product 54.1
us, the Triton kernel 41.6 us) and 3.5 TB/s on down [14336, 4096] (16.8 us; 27.8 and 22.2
us); a TMA pipeline that only streams the tiles reached ~3.9 TB/s end to end, so gate_up
is at that ceiling. Wall clock a product (6 weights a call): gate_up 32.8 us at one row
(1.73x XLA bfloat16, 1.41x Triton), 35.1 at 8 rows, 36.2 at 16; down 20.5, 19.6, 20.6.
The small projections (qkv, o: 25 and 17 MB) are bound by launches in that benchmark (the
kernel 8.5 and 6.2 us, but four launches a product with the rows' preparation and the
split sum). Every call also runs small XLA fusions for the rows (`half_rows`: their
largest magnitudes, unless the caller gives a bound as `top`; the division and padding)
and, with K splits, one for the sum. A normed input's bound comes from the norm's own pass
(`moe_experts.normed_with_top`, taken by `Linear(..., norm=)` and `mosaic_experts`).

Dispatch (`uses_kernel`): `models.layers.Linear` runs this kernel for products of at most
`Fp8Tiles.mosaic_rows` (default 16; 0 turns it off) bfloat16 or float16 rows with N a
multiple of 64 on a Hopper GPU (`on_hopper`: compute capability 9.x), tiles
`Tuning.fp8_mosaic`; other kernel-sized products run `matmul.fp8_matmul` (Triton).

One expert a pair (`fp8_pairs_mosaic`; `kernels.moe.experts.mosaic_experts` runs MoE
decode's routed and shared experts through it on Hopper): grid (pairs, column blocks, K
splits); each CTA reads its pair's expert id (a scalar load from global memory) and runs
the same body over views of the flattened stacks at that expert's rows, its pair's row the
first of 8. DeepSeek-V3's 9 experts of one token: 134 us against the Triton expert kernel's
233 (H200; docs/benchmarks.md, "DeepSeek's experts through the Mosaic GPU pair kernel").

Runs in interpret mode on the CPU with jax's Mosaic GPU interpreter
(`jax._src.pallas.mosaic_gpu.interpret`, private: `interpret_params()` is None where it
is missing); the interpreter (jax 0.10-0.11) runs only the first point of a pallas_call
grid, and has no layout_cast, no transposed wgmma operands and no inline_mgpu, so it runs
the shared-memory path with transposed copies (`_kernel`).
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
from jspec.kernels.fp8.matmul import Fp8Tiles, half_rows
from jspec.kernels.tiling import in_order_sum
from jspec.quantization import FP8_DTYPES, GROUP

MAX_ROWS = 16  # wgmma N of the transposed product: 8 or 16


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """block_n: weight columns a CTA (wgmma M: a multiple of 64). stages: pipeline steps in
    flight (TMA copies of [GROUP, block_n] FP8 tiles). num_splits: K splits (None: enough
    for about target_ctas CTAs, each split at least min_split_groups groups). load_8bit:
    the FP8 tile is read from shared memory in Mosaic's WGMMA_8BIT register layout (4-byte
    loads) rather than WGMMA (2-byte loads); shared-memory path only. a_regs: the widened
    weight goes to wgmma from registers (`_widen_to_regs`; block_n 128 or 256, on the GPU)
    rather than through a float16 tile in shared memory. fuse_out: with one split (and A from
    registers, or interpreted) the kernel writes the product [M, N] in the output dtype
    itself (rows times their factors), no partial sums for XLA to add."""

    block_n: int = 128
    stages: int = 3
    num_splits: int | None = None
    target_ctas: int = 400
    min_split_groups: int = 4
    load_8bit: bool = False
    a_regs: bool = True
    fuse_out: bool = True


def interpret_params():
    """The Mosaic GPU interpreter's parameters (`plgpu.kernel(interpret=...)`), or None on
    a jax without it (a private module)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:  # pragma: no cover - depends on the jax version
        return None
    return InterpretGPUParams()


def interpreter(interpret: bool | None):
    """The interpreter's parameters for `plgpu.kernel(interpret=...)`, or None to compile for
    the GPU. interpret None: interpret unless the default backend is a GPU."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret:
        return None
    mode = interpret_params()
    if mode is None:
        raise NotImplementedError("this jax has no Mosaic GPU interpreter")
    return mode


def operands_text(x, w, scale) -> str:
    """The dtypes and shapes of a product's operands, for a refusal's message."""
    return (f"got x {getattr(x, 'dtype', None)} {getattr(x, 'shape', x)}, w {getattr(w, 'dtype', None)} "
            f"{getattr(w, 'shape', w)}, scale {getattr(scale, 'dtype', None)} {getattr(scale, 'shape', scale)}")


def supported(x, w, scale, tiles: MosaicTiles | None = None) -> bool:
    """Whether `fp8_matmul_mosaic` takes these arguments: x [..., K] bfloat16 or float16
    of at most MAX_ROWS rows, w [K, N] FP8 with K a multiple of GROUP and N of 64, scale
    [K / GROUP, N] float32."""
    if getattr(w, "ndim", None) != 2 or jnp.dtype(w.dtype) not in FP8_DTYPES:
        return False
    K, N = w.shape
    rows = x.size // max(x.shape[-1], 1)
    return (jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and x.shape[-1] == K
            and K % GROUP == 0 and N % 64 == 0 and 1 <= rows <= MAX_ROWS
            and getattr(scale, "shape", None) == (K // GROUP, N) and scale.dtype == jnp.float32)


@functools.cache
def on_hopper() -> bool:
    """Whether the default backend is a GPU of compute capability 9.x (Hopper: H100, H200,
    H20, GH200): wgmma, which this kernel issues, exists on sm_90 alone."""
    if jax.default_backend() != "gpu":
        return False
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", "") or "")
    if cc:
        return cc.split(".")[0] == "9"
    kind = dev.device_kind.upper()  # pragma: no cover - a jax without compute_capability
    return any(name in kind for name in ("H100", "H200", "H800", "H20", "GH200"))


def uses_kernel(x, w, scale, tiles: Fp8Tiles | None = None) -> bool:
    """Whether a `Linear` runs `fp8_matmul_mosaic` for x @ w (before `matmul.fp8_matmul`,
    which takes the rest up to `Fp8Tiles.max_rows` rows): at most min(tiles.mosaic_rows,
    tiles.max_rows) rows (mosaic_rows 0: never), arguments the kernel takes (`supported`:
    bfloat16 or float16 rows, K a multiple of GROUP, N of 64), kernels not switched off
    (JSPEC_KERNELS=reference) and a Hopper GPU (`on_hopper`; never interpreted: under
    JSPEC_KERNELS=pallas on a CPU the Triton kernel runs)."""
    t = Fp8Tiles() if tiles is None else tiles
    rows = x.size // max(x.shape[-1], 1)
    return (rows <= min(t.mosaic_rows, t.max_rows) and supported(x, w, scale) and dispatch.backend() != "reference"
            and on_hopper())


def _swizzle(row_bytes: int) -> int:
    for s in (128, 64, 32):
        if row_bytes % s == 0:
            return s
    raise ValueError(f"rows of {row_bytes} bytes take no swizzle")


def tiled(row_elems: int, itemsize: int):
    """Tiling and swizzle transforms of a shared-memory tile whose rows hold row_elems
    elements of itemsize bytes."""
    s = _swizzle(row_elems * itemsize)
    return (plgpu.TilingTransform((8, s // itemsize)), plgpu.SwizzleTransform(s))



# ---- wgmma's A operand from registers (the GPU path, a_regs) -------------------------------
#
# wgmma's A operand is the weight tile transposed, w^T [block_n, GROUP], in float16. The
# FP8 tile in shared memory is [GROUP, block_n] with block_n contiguous (TMA, 128-byte
# swizzle), so A's rows are its columns. In Mosaic's WGMMA register layout a thread (warp
# w, lane l) holds A rows r = 64 i0 + 16 w + 8 i4 + l // 4 (i0 < block_n / 64, i4 < 2) at
# columns (k) 8 b + 2 (l % 4) + {0, 1}. The rows of the product are free to permute, so
# row r is taken to be weight column n = RT g + 2 i0 + i4 (g = 8 w + l // 4, RT = block_n /
# 32): the RT columns a thread holds are adjacent, and one RT-byte load of a weight row
# brings them all. Two loads (rows k, k + 1) are interleaved by byte permutes (prmt) into
# pairs along k and widened by cvt.rn.f16x2.e4m3x2, which is A's register. The scales are
# read in the same permuted order, and the thread writes its sums back to columns
# RT g .. RT g + RT - 1, so the permutation never leaves the kernel. Loads are conflict-free
# under the 128-byte swizzle (the four k rows a warp reads XOR into distinct chunks).

_PAIRS = """{
.reg .b32 t0, t1;
.reg .b16 h0, h1, h2, h3;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
mov.b32 {h0, h1}, t0;
mov.b32 {h2, h3}, t1;
cvt.rn.f16x2.FMTx2 $0, h0;
cvt.rn.f16x2.FMTx2 $1, h1;
cvt.rn.f16x2.FMTx2 $2, h2;
cvt.rn.f16x2.FMTx2 $3, h3;
}"""


def mgpu_modules():
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, vector
    return mgpu, mu, ir, arith, llvm, vector


def thread_coords():
    """(g, q) of this thread as i32: g = 8 warp + lane // 4 (its row group), q = lane % 4."""
    _, mu, ir, arith, _, _ = mgpu_modules()
    i32 = ir.IntegerType.get_signless(32)
    c = lambda v: arith.constant(i32, v)
    tid = arith.remui(mu.thread_idx(), c(128))
    lane = arith.remui(tid, c(32))
    g = arith.addi(arith.muli(arith.divui(tid, c(32)), c(8)), arith.divui(lane, c(4)))
    return g, arith.remui(lane, c(4))


def _widen_to_regs(block_n: int, fmt: str):
    """inline_mgpu: the FP8 tile ref [GROUP, block_n] (tiling (8, 128), 128-byte swizzle;
    fmt "e4m3" or "e5m2") -> w^T [block_n, GROUP] float16 in the WGMMA register layout,
    rows permuted (above)."""
    rt = block_n // 32
    pairs = _PAIRS.replace("FMT", fmt)  # cvt.rn.f16x2.e4m3x2 (e5m2x2)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=tiled(block_n, 1)),),
                       return_type=plgpu.ShapeDtypeStruct((block_n, GROUP), jnp.float16, layout=plgpu.Layout.WGMMA))
    def widen(ctx, w_ref):
        mgpu, mu, ir, arith, llvm, vector = mgpu_modules()
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        c = lambda v: arith.constant(i32, v)
        g, q = thread_coords()
        ptr = mu.memref_ptr(w_ref)
        n0 = arith.muli(g, c(rt))  # the thread's first weight column
        # unswizzled byte address of (k, n0) for k % 8 = 2 q + e; tiles of 8 rows x 128 bytes
        # are laid [k // 8][n // 128][k % 8][n % 128]; the swizzle XORs the 16-byte chunk
        # (address bits 4-6) with the row in the tile (bits 7-9).
        col = arith.addi(arith.muli(arith.divui(n0, c(128)), c(1024)), arith.remui(n0, c(128)))
        load_ty = ir.VectorType.get((rt // 4,), i32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        bases = []
        for e in (0, 1):
            row = arith.addi(arith.muli(q, c(2)), c(e))
            pre = arith.addi(arith.muli(row, c(128)), col)
            bases.append(arith.xori(pre, arith.shli(row, c(4))))
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((block_n, GROUP)), dtype=object)
        for b in range(GROUP // 8):
            words = []
            for e in (0, 1):
                addr = mu.getelementptr(ptr, [arith.addi(bases[e], c(b * 8 * block_n))], i8)
                words.append(llvm.load(load_ty, addr))
            for h in range(rt // 4):
                w0 = vector.extract(words[0], [], [h])
                w1 = vector.extract(words[1], [], [h])
                res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [w0, w1], pairs,
                                      "=r,=r,=r,=r,r,r", has_side_effects=False)
                for u in range(4):
                    jj = 4 * h + u  # column n0 + jj: row (i0, i4) = divmod(jj, 2)
                    idx = (jj // 2, b) + (0,) * 2 + (jj % 2,) + (0,) * 4
                    regs[idx] = mu.bitcast(llvm.extractvalue(i32, res, [u]), f16x2)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return widen


def scales_to_regs(block_n: int):
    """inline_mgpu: the scales ref [1, block_n] float32 -> [block_n] in the WGMMA row layout,
    in the permuted row order of `_widen_to_regs`."""
    rt = block_n // 32
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((block_n,), jnp.float32, layout=row_layout))
    def scales(ctx, s_ref):
        mgpu, mu, ir, arith, llvm, vector = mgpu_modules()
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        c = lambda v: arith.constant(i32, v)
        g, _ = thread_coords()
        ptr = mu.memref_ptr(s_ref)
        layout = row_layout.to_mgpu()
        regs = np.empty(layout.registers_shape((block_n,)), dtype=object)
        vec4 = ir.VectorType.get((4,), f32)
        for h in range(rt // 4):
            addr = mu.getelementptr(ptr, [arith.addi(arith.muli(g, c(rt)), c(4 * h))], f32)
            v = llvm.load(vec4, addr)
            for u in range(4):
                jj = 4 * h + u
                regs[(jj // 2, 0, jj % 2, 0, 0)] = mu.vector_slice(v, slice(u, u + 1))
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return scales


def store_from_regs(block_n: int, rows: int, dtype, factor: bool, factor_rows: int | None = None):
    """inline_mgpu: the sums [block_n, rows] float32 (WGMMA layout, permuted rows) -> the
    shared-memory ref [rows, block_n] of dtype in column order (RT consecutive columns a
    store), each row m times factor_ref[m] first if factor (a float32 ref [factor_rows],
    default rows; rows past it take the last factor: rows nobody keeps)."""
    rt = block_n // 32
    last = (factor_rows or rows) - 1

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()) + ((plgpu.RefType(),) if factor else ()))
    def store(ctx, total, out_ref, *factor_ref):
        mgpu, mu, ir, arith, llvm, vector = mgpu_modules()
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        out_ty = mu.dtype_to_ir_type(dtype)
        c = lambda v: arith.constant(i32, v)
        g, q = thread_coords()
        ptr = mu.memref_ptr(out_ref)
        regs = total.registers
        for i1 in range(rows // 8):
            for v in (0, 1):
                m = arith.addi(arith.muli(q, c(2)), c(8 * i1 + v))
                fac = None
                if factor:
                    mf = m if last == rows - 1 else arith.minsi(m, c(last))
                    fac = llvm.load(f32, mu.getelementptr(mu.memref_ptr(factor_ref[0]), [mf], f32))
                for h in range(rt // 4):
                    elems = []
                    for jj in range(4 * h, 4 * h + 4):
                        e = vector.extract(regs[(jj // 2, i1) + (0,) * 2 + (jj % 2,) + (0,) * 4], [], [v])
                        if fac is not None:
                            e = arith.mulf(e, fac)
                        if out_ty != f32:
                            e = arith.truncf(out_ty, e)
                        elems.append(e)
                    vec = vector.from_elements(ir.VectorType.get((4,), out_ty), elems)
                    off = arith.addi(arith.addi(arith.muli(m, c(block_n)), arith.muli(g, c(rt))), c(4 * h))
                    llvm.store(vec, mu.getelementptr(ptr, [off], out_ty))
        return None

    return store


def _kernel(*refs, block_n: int, steps: int, rows: int, stages: int, layouts: bool, load_8bit: bool = False,
            a_regs: bool = False, fused=None):
    """One (column block j, K split s) of the product: the sum over the split's `steps`
    groups of (w^T tile @ x^T tile) * scales, [block_n, rows] float32.

    refs: x_gmem [rows, K] float16, w_gmem [K, N] FP8, s_gmem [K / GROUP, N] float32,
    (f_gmem [rows] float32: the rows' factors, if fused; [M] with fused rows M < rows whose
    factors the kernel alone keeps, as a pair's), o_gmem, then the scratch:
    wb_smem (the float16 tile of the shared-memory path), out_smem, (xt_smem). o_gmem:
    [S, N, rows] float32 (shared-memory path), [S, rows, N] float32 (a_regs: A from
    registers, `_widen_to_regs`), or, fused = (M, dtype) (one split), the product itself
    [M, N] in dtype, its rows times their factors.

    layouts False: interpret mode, whose interpreter (jax 0.10-0.11) has neither
    layout_cast nor transposed wgmma operands: register arrays keep no layouts, and the
    widened tile and the rows are stored transposed (wb_smem [block_n, GROUP], xt_smem
    [GROUP, rows]) for a plain wgmma; the same products, sums and scales."""
    if fused is not None:
        x_gmem, w_gmem, s_gmem, f_gmem, o_gmem, wb_smem, out_smem, *xt_smem = refs
    else:
        x_gmem, w_gmem, s_gmem, o_gmem, wb_smem, out_smem, *xt_smem = refs
    cast = plgpu.layout_cast if layouts else (lambda a, _: a)
    fmt = "e5m2" if jnp.dtype(w_gmem.dtype) == jnp.dtype(jnp.float8_e5m2) else "e4m3"
    j, s = lax.axis_index("n"), lax.axis_index("k")
    cols = pl.ds(j * block_n, block_n)
    g0 = s * steps

    def step_regs(_, x_smem, w_smem, s_smem, total):
        sc = scales_to_regs(block_n)(s_smem.at[0])  # [block_n], permuted rows
        a = _widen_to_regs(block_n, fmt)(w_smem)  # w^T [block_n, GROUP] f16, permuted rows
        # every thread's reads of this slot done before the pipeline refills it (TMA)
        plgpu.commit_smem()

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(x_smem, (1, 0)))
            return acc_ref[...]

        part = pl.run_scoped(mma, plgpu.ACC((block_n, rows), jnp.float32))  # [block_n, rows]
        return total + part * lax.broadcast_in_dim(sc, (block_n, rows), [0])

    def step(_, x_smem, w_smem, s_smem, total):
        # The scales first: the pipeline refills this slot once the step returns, and the
        # barrier in commit_smem below orders every thread's reads before that.
        sc = cast(s_smem[0], plgpu.Layout.WGMMA.reduce(1))  # [block_n]
        w8 = cast(w_smem[...], plgpu.Layout.WGMMA_8BIT) if load_8bit else w_smem[...]
        wide = w8.astype(jnp.float16)  # E4M3 -> f16: exact
        if layouts:
            wb_smem[...] = wide
            a, b = plgpu.transpose_ref(wb_smem, (1, 0)), plgpu.transpose_ref(x_smem, (1, 0))
        else:
            wb_smem[...] = wide.T
            xt_smem[0][...] = x_smem[...].T
            a, b = wb_smem, xt_smem[0]
        plgpu.commit_smem()  # the stores visible to wgmma (async proxy)

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]

        part = pl.run_scoped(mma, plgpu.ACC((block_n, rows), jnp.float32))  # [block_n, rows]
        return total + part * lax.broadcast_in_dim(sc, (block_n, rows), [0])

    specs = [
        plgpu.BlockSpec((rows, GROUP), lambda t: (0, t), transforms=tiled(GROUP, 2)),
        plgpu.BlockSpec((GROUP, block_n), lambda t: (t, 0), transforms=tiled(block_n, 1)),
        plgpu.BlockSpec((1, block_n), lambda t: (t, 0)),
    ]
    zero = cast(jnp.zeros((block_n, rows), jnp.float32), plgpu.Layout.WGMMA)
    pipeline = plgpu.emit_pipeline(step_regs if a_regs else step, grid=(steps,), in_specs=specs,
                                   max_concurrent_steps=stages, init_carry=zero)
    total = pipeline(x_gmem.at[:, pl.ds(g0 * GROUP, steps * GROUP)],
                     w_gmem.at[pl.ds(g0 * GROUP, steps * GROUP), cols],
                     s_gmem.at[pl.ds(g0, steps), cols])
    if fused is not None:
        M, dtype = fused
        if a_regs:
            store_from_regs(block_n, rows, dtype, True, f_gmem.shape[0])(cast(total, plgpu.Layout.WGMMA), out_smem,
                                                                           f_gmem)
        else:  # interpret mode
            out_smem[...] = (total.T * f_gmem[...][:, None]).astype(dtype)
        dst, src = o_gmem.at[:, cols], out_smem.at[pl.ds(0, M)]
    elif a_regs:
        store_from_regs(block_n, rows, jnp.float32, False)(cast(total, plgpu.Layout.WGMMA), out_smem)
        dst, src = o_gmem.at[s, :, cols], out_smem
    else:
        out_smem[...] = total
        dst, src = o_gmem.at[s, cols], out_smem
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0)


def splits_of(groups: int, column_blocks: int, tiles) -> int:
    """K splits: tiles.num_splits if given (the largest divisor of the groups at most
    that), else the largest divisor of the groups that keeps column_blocks x splits at most
    tiles.target_ctas and each split at least tiles.min_split_groups groups (at least 1).
    column_blocks: the CTAs of one split; tiles: `MosaicTiles` or any tiles with those
    three fields (`w8a8.W8a8Tiles`)."""
    if tiles.num_splits is not None:
        cap = tiles.num_splits
    else:
        cap = max(1, min(tiles.target_ctas // column_blocks, groups // tiles.min_split_groups))
    return max(d for d in range(1, min(cap, groups) + 1) if groups % d == 0)


def _launch_setup(interpret, tiles: MosaicTiles, BN: int, Mp: int, S: int, dtype):
    """What both wrappers decide before `plgpu.kernel`: (interpreter params or None, a_regs,
    fused, scratch). interpret None: interpret mode unless the default backend is a GPU.
    a_regs: A from registers (GPU, 128- or 256-column blocks); fused: one split and the
    kernel writes the product in `dtype` (a_regs or interpreted); scratch: `_kernel`'s."""
    mode = interpreter(interpret)
    interpret = mode is not None
    a_regs = tiles.a_regs and not interpret and BN in (128, 256)
    fused = tiles.fuse_out and S == 1 and (a_regs or interpret)
    out_smem = plgpu.SMEM((Mp, BN) if a_regs or fused else (BN, Mp), dtype if fused else jnp.float32)
    if interpret:  # transposed copies for the interpreter's plain wgmma (see _kernel)
        scratch = [plgpu.SMEM((BN, GROUP), jnp.float16), out_smem, plgpu.SMEM((GROUP, Mp), jnp.float16)]
    elif a_regs:  # no float16 tile (wb_smem: a placeholder)
        scratch = [plgpu.SMEM((8,), jnp.float32), out_smem]
    else:
        scratch = [plgpu.SMEM((GROUP, BN), jnp.float16, transforms=tiled(BN, 2)), out_smem]
    return mode, a_regs, fused, scratch


def fp8_matmul_mosaic(x, w, scale, *, out_dtype=None, float32_out: bool = False, tiles: MosaicTiles | None = None,
                      top=None, interpret: bool | None = None, **tile_overrides):
    """x [..., K] (bfloat16 or float16, at most MAX_ROWS rows) @ an FP8 weight w [K, N] with
    scales [K / GROUP, N] float32 -> [..., N] in x's dtype (float32 with float32_out;
    out_dtype if given). tiles: `MosaicTiles` (None: the defaults), overridden field by
    field by tile_overrides (block_n=..., stages=..., num_splits=...). interpret None:
    interpret mode unless the default backend is a GPU. top [..., 1] float32: a bound on each
    row's largest magnitude for its float16 factor (`matmul.half_rows`)."""
    t = dataclasses.replace(tiles or MosaicTiles(), **tile_overrides)
    if not supported(x, w, scale, t):
        raise ValueError(f"fp8_matmul_mosaic takes x [..., K] (bfloat16 or float16, 1..{MAX_ROWS} rows), an FP8 "
                         f"w [K, N] with K a multiple of {GROUP} and N of 64, and float32 scales [K / {GROUP}, N]; "
                         + operands_text(x, w, scale))
    K, N = w.shape
    G = K // GROUP
    BN = max(b for b in (256, 128, 64) if b <= max(t.block_n, 64) and N % b == 0)  # N % 64 == 0
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    Mp = 8 if M <= 8 else 16
    half, factor = half_rows(rows, None if top is None else top.reshape(M, 1))
    if Mp > M:
        half = jnp.pad(half, ((0, Mp - M), (0, 0)))
    S = splits_of(G, N // BN, t)
    dtype = jnp.dtype(jnp.float32 if float32_out else (out_dtype or x.dtype))
    mode, a_regs, fused, scratch = _launch_setup(interpret, t, BN, Mp, S, dtype)
    fused = (M, dtype) if fused else None
    body = functools.partial(_kernel, block_n=BN, steps=G // S, rows=Mp, stages=t.stages,
                             layouts=mode is None, load_8bit=t.load_8bit, a_regs=a_regs, fused=fused)

    def jspec_fp8_mosaic(*refs):  # the kernel's name (profiles, HLO) is the body's
        return body(*refs)
    if fused:
        out_type, args = jax.ShapeDtypeStruct((M, N), dtype), (half, w, scale, jnp.pad(factor[:, 0], (0, Mp - M)))
    else:
        out_type, args = jax.ShapeDtypeStruct((S, Mp, N) if a_regs else (S, N, Mp), jnp.float32), (half, w, scale)
    # plgpu.kernel (a mesh) rather than pallas_call's grid: jax 0.10.2's interpreter runs
    # only the first point of a pallas_call grid.
    out = plgpu.kernel(
        jspec_fp8_mosaic, out_type=out_type, scratch_types=scratch, grid=(N // BN, S), grid_names=("n", "k"),
        compiler_params=plgpu.CompilerParams(), interpret=mode,
    )(*args)
    if fused:
        return out.reshape(x.shape[:-1] + (N,))
    y = in_order_sum(out[:, :M]) if a_regs else in_order_sum(out[:, :, :M]).T  # [M, N]: the padding rows dropped
    y = y * factor
    return y.astype(dtype).reshape(x.shape[:-1] + (N,))


# ---- one expert a pair: MoE decode's routed (and shared) experts --------------------------


def pairs_supported(x, ids, w, scale, extra=None, extra_scale=None) -> bool:
    """Whether `fp8_pairs_mosaic` takes these arguments: x [P, K] bfloat16 or float16 (a row
    a pair), ids [P] integer, w [E, K, N] FP8 with K a multiple of GROUP and N of 64, scale
    [E, K / GROUP, N] float32; extra and extra_scale (both or neither) the same for E2 more
    experts of the same K and N."""
    if getattr(w, "ndim", None) != 3 or getattr(x, "ndim", None) != 2 or getattr(ids, "ndim", None) != 1:
        return False
    E, K, N = w.shape
    if (jnp.dtype(w.dtype) not in FP8_DTYPES or K % GROUP or N % 64 or x.shape != (ids.shape[0], K)
            or jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            or not jnp.issubdtype(ids.dtype, jnp.integer)
            or getattr(scale, "shape", None) != (E, K // GROUP, N) or scale.dtype != jnp.float32):
        return False
    if (extra is None) != (extra_scale is None):
        return False
    if extra is not None:
        if getattr(extra, "ndim", None) != 3 or extra.shape[1:] != (K, N) or extra.dtype != w.dtype:
            return False
        if getattr(extra_scale, "shape", None) != (extra.shape[0], K // GROUP, N) or extra_scale.dtype != jnp.float32:
            return False
    return True


def _pairs_kernel(ids_gmem, *refs, K: int, rows: int, num_experts: int, num_extra: int, fused, a_regs: bool,
                  **kernel_args):
    """Pair p (grid axis "p") of `fp8_pairs_mosaic`: expert e = ids[p] read from w's stack
    (0 <= e < num_experts) or extra's (num_experts <= e < num_experts + num_extra) by `_kernel`
    over views of the flat arrays (the expert's K rows, the pair's Mp rows and output); any
    other id runs nothing (the wrapper zeroes its row).

    refs: x_gmem [P Mp, K] float16, (w_gmem [E K, N] FP8, s_gmem [E K / GROUP, N] float32)
    for each stack, (f_gmem [P] float32 if fused: the pairs' factors), o_gmem ([P, N] fused; [S, P Mp, N]
    a_regs; else [S, N, P Mp]), then `_kernel`'s scratch."""
    x_gmem, *refs = refs
    stacks = [refs[0:2]] + ([refs[2:4]] if num_extra else [])
    refs = refs[2 * len(stacks):]
    f_gmem, o_gmem, *scratch = refs if fused is not None else (None,) + tuple(refs)
    p = lax.axis_index("p")
    e = ids_gmem[p]
    G = K // GROUP
    x_p = x_gmem.at[pl.ds(p * rows, rows)]
    if fused is not None:
        heads, o_p = (f_gmem.at[pl.ds(p, 1)],), o_gmem.at[pl.ds(p, 1)]
    else:
        heads, o_p = (), (o_gmem.at[:, pl.ds(p * rows, rows)] if a_regs else o_gmem.at[:, :, pl.ds(p * rows, rows)])
    for (w_gmem, s_gmem), first, count in zip(stacks, (0, num_experts), (num_experts, num_extra)):
        @pl.when((e >= first) & (e < first + count))
        def _(w_gmem=w_gmem, s_gmem=s_gmem, first=first):
            i = e - first
            _kernel(x_p, w_gmem.at[pl.ds(i * K, K)], s_gmem.at[pl.ds(i * G, G)], *heads, o_p, *scratch, rows=rows,
                    a_regs=a_regs, fused=fused, **kernel_args)


def fp8_pairs_mosaic(x, ids, w, scale, extra=None, extra_scale=None, *, out_dtype=None, float32_out: bool = False,
                     tile_pairs: int | None = None, tiles: MosaicTiles | None = None, top=None,
                     interpret: bool | None = None, **tile_overrides):
    """One product a pair, each with its own expert: x [P, K] (bfloat16 or float16, a row a
    pair) and ids [P] -> [P, N], row p = x[p] @ w[ids[p]] with w [E, K, N] FP8 and its
    scales [E, K / GROUP, N] (`matmul.matmul_reference`'s numerics, as `fp8_matmul_mosaic`).
    extra (E2 experts [E2, K, N] FP8) and extra_scale: the experts E .. E + E2 - 1 (DeepSeek's
    shared experts), read where they are (no concatenated copy). A pair whose id names no
    expert (expert parallelism's -1) reads nothing and gets a zero row.

    The grid is (pairs, column blocks, K splits), pairs fastest, so the CTAs reading one
    column block of one expert for several pairs run together and share L2. Each pair's
    row goes to wgmma as the first of Mp = 8 rows (the rest zero). K splits are chosen for
    tile_pairs pairs (None: P): a fixed tile_pairs makes every pair's sums independent of
    how many pairs a call holds. Output in x's dtype (out_dtype; float32 with float32_out).
    top [P, 1] float32: a bound on each row's largest magnitude (`matmul.half_rows`)."""
    t = dataclasses.replace(tiles or MosaicTiles(), **tile_overrides)
    if not pairs_supported(x, ids, w, scale, extra, extra_scale):
        raise ValueError(f"fp8_pairs_mosaic takes x [P, K] (bfloat16 or float16), ids [P] integer, an FP8 w "
                         f"[E, K, N] with K a multiple of {GROUP} and N of 64 and its float32 scales "
                         f"[E, K / {GROUP}, N] (extra stacks alike); got x {getattr(x, 'dtype', None)} "
                         f"{getattr(x, 'shape', x)}, ids {getattr(ids, 'shape', ids)}, w {getattr(w, 'dtype', None)} "
                         f"{getattr(w, 'shape', w)}, scale {getattr(scale, 'shape', scale)}")
    P, K = x.shape
    E, _, N = w.shape
    E2 = 0 if extra is None else extra.shape[0]
    G = K // GROUP
    BN = max(b for b in (256, 128, 64) if b <= max(t.block_n, 64) and N % b == 0)
    Mp = 8
    half, factor = half_rows(x, None if top is None else top.reshape(P, 1))  # [P, K] float16, [P, 1]
    x8 = jnp.zeros((P, Mp, K), jnp.float16).at[:, 0].set(half).reshape(P * Mp, K)
    S = splits_of(G, (N // BN) * (tile_pairs or P), t)
    dtype = jnp.dtype(jnp.float32 if float32_out else (out_dtype or x.dtype))
    mode, a_regs, fused, scratch = _launch_setup(interpret, t, BN, Mp, S, dtype)
    fused = (1, dtype) if fused else None
    body = functools.partial(_pairs_kernel, K=K, rows=Mp, num_experts=E, num_extra=E2, fused=fused, a_regs=a_regs,
                             block_n=BN, steps=G // S, stages=t.stages, layouts=mode is None,
                             load_8bit=t.load_8bit)

    def jspec_fp8_pairs_mosaic(*refs):  # the kernel's name (profiles, HLO)
        return body(*refs)
    stacks = (w.reshape(E * K, N), scale.reshape(E * G, N))
    if E2:
        stacks += (extra.reshape(E2 * K, N), extra_scale.reshape(E2 * G, N))
    args = (ids.astype(jnp.int32), x8) + stacks
    if fused:
        out_type, args = jax.ShapeDtypeStruct((P, N), dtype), args + (factor.reshape(P),)
    else:
        out_type = jax.ShapeDtypeStruct((S, P * Mp, N) if a_regs else (S, N, P * Mp), jnp.float32)
    out = plgpu.kernel(
        jspec_fp8_pairs_mosaic, out_type=out_type, scratch_types=scratch, grid=(P, N // BN, S),
        grid_names=("p", "n", "k"), compiler_params=plgpu.CompilerParams(), interpret=mode,
    )(*args)
    if not fused:
        total = in_order_sum(out) if a_regs else jnp.swapaxes(in_order_sum(out), 0, 1)  # [P Mp, N]
        out = (total.reshape(P, Mp, N)[:, 0] * factor).astype(dtype)
    valid = (ids >= 0) & (ids < E + E2)
    return jnp.where(valid[:, None], out, jnp.zeros((), dtype))
