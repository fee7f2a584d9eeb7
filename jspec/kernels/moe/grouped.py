"""Grouped expert products for MoE prefill and batches of at least one pair an expert: the
(token, expert) pairs sorted by expert, each expert's group padded to whole
tiles of BM rows, and one Pallas (Triton) program per (tile, column block) multiplying
its BM rows by its expert's weights on the tensor cores.

Layout (`group_layout`, XLA ops): pair p of P = N*k has expert flat[p]; the pairs of
expert e take rows [start_e, start_e + size_e) of a padded array of R rows, start_e a
multiple of BM, so every tile of BM rows belongs to one expert (`tile_expert[t]`; -1: a
tile past the last group, which its programs skip). R = P + E*(BM-1) rounded up to BM
bounds the padded groups whatever the routing, so shapes are static; rows no pair took
are zeros in the input and are never read back from the output.

Kernel (`grouped_matmul`): out[t*BM:(t+1)*BM, n0:n0+BN] = x[t*BM:(t+1)*BM, :] @
w[tile_expert[t], :, n0:n0+BN], float32 accumulation over BK-row chunks of Din, rounded to
x's dtype as `jax.lax.ragged_dot` rounds its result. Din or Dout not a multiple of the
tile: the last chunk / column block overlaps its neighbour (the chunk's repeated inputs
are zeroed), as in `kernels.moe.experts`.

`grouped_experts` runs DeepSeek's routed experts this way (gate_up, silu(gate) * up in
the activations' dtype, down), the same roundings as the `ragged_dot` formulation
(`grouped_experts_reference`), which the CPU and `JSPEC_KERNELS=reference` use.

FP8 experts (`w_scale` [E, Din / GROUP, Dout] float32 beside an FP8 w, `jspec.quantization`):
each chunk (at most GROUP rows, inside one group) is widened to x's dtype on the tensor
cores' path and its product times the group's column scales before it joins the float32
sum, so a step reads the FP8 bytes; the reference dequantizes the stacks into x's dtype
first (the two differ by that rounding). On a Hopper GPU, from
`W8a8Tiles.min_pairs_per_expert` pairs an expert, both products are FP8 x FP8 instead
(`uses_w8a8`; `kernels.fp8.w8a8.fp8_w8a8_grouped`: the rows rounded to E4M3 per group of
128, the same layout in row blocks of `w8a8.grouped_block_rows`).

Tiles and thresholds are `GroupedTiles` (below; `Tuning.grouped`), taken as `tiles=`
(None: the defaults, with the measurements behind them).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jspec.kernels import dispatch
from jspec.kernels.fp8 import mosaic as fp8_mosaic, w8a8 as fp8_w8a8
from jspec.kernels.moe.experts import silu_mul
from jspec.kernels.tiling import KERNEL_DTYPES, chunk_start, is_pow2, pow2_floor, wraps_triton_offsets
from jspec.quantization import FP8_DTYPES, GROUP, dequantized_experts


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """Tiles of the grouped expert kernel (`Tuning.grouped`: prefill and batches of at least
    one (token, expert) pair an expert)."""

    # False: `grouped` takes `jax.lax.ragged_dot` on a GPU at any size (benchmark A/Bs).
    kernel: bool = True
    # The kernel runs from this many pairs an expert on (so wherever the model groups
    # pairs: it does from E pairs on); below, ragged_dot. Kernel time a call in the
    # profiler, H200 (benchmarks/kernels.py moe): V2-Lite's routed experts at 32 tokens (3
    # pairs an expert) 322 us (the two products 175 + 90 us, 3.7-3.8 TB/s over the distinct
    # experts) against 367 for ragged_dot; V3 at 32 tokens (one pair an expert) 3.6 ms
    # against 7.8 (wall). Wall-clock timings of these calls outside a CUDA graph
    # (moe_paths, a probe at 3bf4f68) favour ragged_dot at 16-32 V2-Lite tokens only through the
    # grouped path's 47 kernel launches against 13, which the decode loop's command
    # buffers do not pay.
    min_pairs_per_expert: int = 1
    # Rows a tile: small_block_m while the pairs are few against the experts (little
    # padding: each group's tiles read its expert once), large_block_m from
    # large_from_pairs_per_expert pairs an expert on.
    small_block_m: int = 16
    large_block_m: int = 64
    large_from_pairs_per_expert: int = 16
    block_n: int = 128  # output columns a program
    block_k: int = 64  # input rows a loop step
    num_warps: int = 4
    num_stages: int = 3


def block_rows(pairs: int, num_experts: int, tiles: GroupedTiles | None = None) -> int:
    """BM for `pairs` (token, expert) pairs over `num_experts` experts: `tiles.small_block_m`,
    or `large_block_m` from `large_from_pairs_per_expert` pairs an expert on (None: the
    defaults)."""
    t = GroupedTiles() if tiles is None else tiles
    return t.large_block_m if pairs >= t.large_from_pairs_per_expert * num_experts else t.small_block_m


def padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """R: the rows that hold any routing's groups, each padded to whole tiles of block_m."""
    return pl.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m


def group_layout(flat, num_experts: int, block_m: int):
    """flat [P] int: each pair's expert -> (rows [P] int32: each pair's row in the padded
    layout, tile_expert [R / block_m] int32: each tile's expert, -1 past the last group).
    A pair whose id names no expert (outside [0, E): another device's, under expert
    parallelism) gets a row after the last group, in a tile of expert -1."""
    P = flat.shape[0]
    E = num_experts
    key = _group_key(flat, E)  # no expert: E, after every group
    order = jnp.argsort(key, stable=True)  # pairs by expert
    sizes = jnp.bincount(key, length=E + 1).astype(jnp.int32)  # [E+1]: the last, pairs of no expert
    padded = jnp.concatenate([pl.cdiv(sizes[:E], block_m) * block_m, sizes[E:]])
    start, pstart = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded  # unpadded, padded group starts
    expert = key[order]
    rows = jnp.zeros((P,), jnp.int32).at[order].set(pstart[expert] + jnp.arange(P, dtype=jnp.int32) - start[expert])
    R = padded_rows(P, E, block_m)
    ends = jnp.cumsum(padded[:E])  # [E]: where each padded group ends
    tile_start = jnp.arange(R // block_m, dtype=jnp.int32) * block_m
    tile_expert = jnp.searchsorted(ends, tile_start, side="right").astype(jnp.int32)
    return rows, jnp.where(tile_start < ends[-1], tile_expert, -1)


def _group_key(flat, num_experts: int):
    """flat [P] ids -> int32 [P]: the id, or num_experts for an id that names no expert."""
    flat = flat.astype(jnp.int32)
    return jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)


def grouped_matmul_reference(x, tile_expert, w, block_m: int):
    """x [R, Din], tile_expert [R / block_m], w [E, Din, Dout] -> [R, Dout] in x's dtype
    (float32 accumulation); tiles of expert -1 give zeros."""
    R, Din = x.shape
    tiles = x.reshape(R // block_m, block_m, Din)
    ws = w[jnp.clip(tile_expert, 0, w.shape[0] - 1)]  # [T, Din, Dout]
    out = jnp.einsum("tmd,tdf->tmf", tiles, ws, preferred_element_type=jnp.float32)
    out = jnp.where((tile_expert >= 0)[:, None, None], out, 0.0)
    return out.reshape(R, -1).astype(x.dtype)


def _kernel(tile_ref, x_ref, w_ref, *rest, din: int, dout: int, num_experts: int, block_m: int, block_k: int,
            block_n: int, interpret: bool, scaled: bool = False, paired: bool = False):
    """One (tile t, column block j): o[t rows, j columns] = x[t rows] @ w[tile_expert[t]];
    `scaled`: rest begins with scale_ref [E, Din / GROUP, Dout] float32 (w is FP8).
    `paired`: w_ref holds the FP8 stack as uint16 [E, Din, Dout / 2] (two adjacent columns a
    value, the even one in the low byte: `pair_view`), so that its offsets stay under 2^31;
    the even and odd columns are two products, stored with a stride of 2."""
    scale_ref, o_ref = rest if scaled else (None, *rest)
    t, j = pl.program_id(0), pl.program_id(1)
    e = tile_ref[t]
    m0 = t * block_m
    n0 = j * block_n
    if dout % block_n:  # the last block overlaps its neighbour instead of running past Dout
        n0 = jnp.minimum(n0, dout - block_n)
    halves = ((0, 1), (1, 1)) if paired else ((0, 0),)  # (first column, stride exponent)
    width = block_n // 2 if paired else block_n

    @pl.when(e >= 0)
    def _():
        expert = jnp.minimum(e, num_experts - 1)

        def step(c, accs):
            kc, fresh = chunk_start(c, block_k, din)
            xv = x_ref[pl.ds(m0, block_m), pl.ds(kc, block_k)]
            if fresh is not None:  # the inputs an earlier chunk took count zero
                xv = jnp.where(fresh[None, :], xv, jnp.zeros_like(xv))
            if paired:
                both = w_ref[expert, pl.ds(kc, block_k), pl.ds(n0 // 2, width)]  # uint16
                tiles = [lax.bitcast_convert_type((both >> (8 * h)).astype(jnp.uint8), jnp.float8_e4m3fn)
                         for h in (0, 1)]
            else:
                tiles = [w_ref[expert, pl.ds(kc, block_k), pl.ds(n0, block_n)]]
            out = []
            for acc, wv, (c0, st) in zip(accs, tiles, halves):
                if scale_ref is not None:  # FP8 widened exactly; the chunk's group scales on its product
                    wv = wv.astype(xv.dtype)
                xa = xv
                if interpret:  # the CPU has no 16-bit dot with a float32 result; the products are exact in float32
                    xa, wv = xv.astype(jnp.float32), wv.astype(jnp.float32)
                part = lax.dot(xa, wv, preferred_element_type=jnp.float32)
                if scale_ref is not None:
                    part = part * scale_ref[expert, kc // GROUP, pl.ds(n0 + c0, width, 1 << st)][None, :]
                out.append(acc + part)
            return tuple(out)

        zero = jnp.zeros((block_m, width), jnp.float32)
        accs = lax.fori_loop(0, pl.cdiv(din, block_k), step, (zero,) * len(halves))
        for acc, (c0, st) in zip(accs, halves):
            o_ref[pl.ds(m0, block_m), pl.ds(n0 + c0, width, 1 << st)] = acc.astype(o_ref.dtype)


def pairable(w) -> bool:
    """Whether `pair_view` takes the stack w: E4M3 [E, Din, Dout] with Dout even and at least
    32 (two columns a value; 16-column halves of the kernel's tiles)."""
    return jnp.dtype(w.dtype) == jnp.dtype(jnp.float8_e4m3fn) and w.shape[2] % 2 == 0 and w.shape[2] >= 32


def pair_view(w):
    """An FP8 stack [E, Din, Dout] (Dout even) as uint16 [E, Din, Dout / 2], two adjacent
    columns a value (the even one in the low byte): the same bytes with half the elements, so
    Pallas' Triton lowering indexes it with 32-bit offsets that do not wrap
    (`tiling.wraps_triton_offsets`). Not free: jax lowers a bitcast to a wider type as
    shifts and ors, so XLA writes this uint16 copy of the stack at every call (one stack's
    bytes of scratch); only stacks whose own offsets would wrap take it."""
    E, Din, Dout = w.shape
    return lax.bitcast_convert_type(lax.bitcast_convert_type(w, jnp.uint8).reshape(E, Din, Dout // 2, 2), jnp.uint16)


def grouped_matmul(x, tile_expert, w, *, block_m: int, block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, interpret: bool | None = None,
                   w_scale=None, paired: bool | None = None):
    """x [R, Din] (tiles of block_m rows, see the module doc), tile_expert [R / block_m]
    int, w [E, Din, Dout] -> [R, Dout] in x's dtype; rows of tiles with expert -1 are left
    unwritten. block_n, block_k: output columns a program and Din rows a loop step
    (powers of two, capped at Dout and Din, and at GROUP with w_scale); num_warps,
    num_stages: Triton's; each None: `GroupedTiles`' default. interpret None: interpret
    mode unless the default backend is a GPU. w_scale [E, Din / GROUP, Dout] float32: w is
    FP8 (see the module doc). paired: the FP8 stack read through `pair_view` (None: where its
    own offsets would wrap, `tiling.wraps_triton_offsets`; DeepSeek-V3's 256 down experts)."""
    if getattr(x, "ndim", None) != 2 or getattr(w, "ndim", None) != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul needs x [R, Din] and w [E, Din, Dout], got {getattr(x, 'shape', x)} "
                         f"and {getattr(w, 'shape', w)}")
    R, Din = x.shape
    E, _, Dout = w.shape
    if not (isinstance(block_m, int) and block_m >= 16 and is_pow2(block_m)) or R % block_m:
        raise ValueError(f"block_m must be a power of two >= 16 dividing the {R} rows, got {block_m!r}")
    if getattr(tile_expert, "shape", None) != (R // block_m,) or not jnp.issubdtype(tile_expert.dtype, jnp.integer):
        raise ValueError(f"tile_expert must be int [{R // block_m}], got {getattr(tile_expert, 'dtype', None)} "
                         f"{getattr(tile_expert, 'shape', tile_expert)}")
    if Din < 16 or Dout < 16:
        raise ValueError(f"Din and Dout must be >= 16 (Triton tiles), got {Din} and {Dout}")
    for name, a in (("x", x),) + (() if w_scale is not None else (("w", w),)):
        if jnp.dtype(a.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
            raise TypeError(f"{name} dtype {a.dtype} is not float32, bfloat16 or float16")
    if w_scale is not None:
        if jnp.dtype(w.dtype) not in FP8_DTYPES:
            raise TypeError(f"w_scale goes with an FP8 weight, w is {w.dtype}")
        if Din % GROUP or getattr(w_scale, "shape", None) != (E, Din // GROUP, Dout) or w_scale.dtype != jnp.float32:
            raise ValueError(f"an FP8 weight [E, Din, Dout] = {w.shape} needs Din a multiple of {GROUP} and float32 "
                             f"scales [E, Din / {GROUP}, Dout], got {getattr(w_scale, 'dtype', None)} "
                             f"{getattr(w_scale, 'shape', w_scale)}")
    elif x.dtype != w.dtype:
        raise TypeError(f"x and w dtypes differ: {x.dtype}, {w.dtype}")
    if paired is None:
        paired = w_scale is not None and wraps_triton_offsets(w)
    if paired and (w_scale is None or not pairable(w)):
        raise ValueError(f"the paired view takes an E4M3 stack with scales and an even Dout >= 32, got {w.dtype} "
                         f"{w.shape}")
    if wraps_triton_offsets(w) and not paired:
        raise ValueError(f"w {w.dtype} {w.shape} has more than 2^31 elements in at most 2^32 bytes, which Pallas' "
                         f"Triton lowering indexes with wrapping 32-bit offsets")
    t = GroupedTiles()
    block_n = t.block_n if block_n is None else block_n
    block_k = t.block_k if block_k is None else block_k
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if not is_pow2(v):
            raise ValueError(f"{name} must be a power of two, got {v!r}")
    BN, BK = min(block_n, pow2_floor(Dout)), min(block_k, pow2_floor(Din), GROUP if w_scale is not None else Din)
    if paired:  # two products of BN / 2 columns each: at least 16 (Triton's dot)
        BN = max(BN, 32)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    kernel = functools.partial(_kernel, din=Din, dout=Dout, num_experts=E, block_m=block_m, block_k=BK, block_n=BN,
                               interpret=interpret, scaled=w_scale is not None, paired=paired)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps if num_warps is None else num_warps,
                                    num_stages=t.num_stages if num_stages is None else num_stages)
    whole = pl.BlockSpec()  # whole arrays, indexed inside the kernel
    return pl.pallas_call(
        kernel,
        grid=(R // block_m, pl.cdiv(Dout, BN)),
        in_specs=[whole] * (3 + (w_scale is not None)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((R, Dout), x.dtype),
        interpret=interpret,
        compiler_params=params,
        name="jspec_grouped_matmul",
    )(tile_expert.astype(jnp.int32), x, pair_view(w) if paired else w, *(() if w_scale is None else (w_scale,)))


def grouped_experts_reference(xs, ids, gate_up, down):
    """xs [N, D], ids [N, k] (each token's routed experts), gate_up [E, D, 2Fm], down
    [E, Fm, D] -> [N*k, D] in xs' dtype (pair n*k + j: token n's j-th expert; zeros for an
    id outside [0, E)): the pairs sorted by expert through `jax.lax.ragged_dot`, then put
    back in pair order."""
    N, k = ids.shape
    E, Fm = gate_up.shape[0], down.shape[1]
    key = _group_key(ids.reshape(-1), E)
    order = jnp.argsort(key, stable=True)  # the pairs of no expert last, in no group
    sizes = jnp.bincount(key, length=E + 1)[:E].astype(jnp.int32)
    h = lax.ragged_dot(xs[order // k], gate_up, sizes)  # [N*k, 2Fm]
    h = lax.ragged_dot(silu_mul(h[:, :Fm], h[:, Fm:]), down, sizes)  # [N*k, D]
    h = jnp.where((key[order] < E)[:, None], h, jnp.zeros((), h.dtype))
    return h[inverse(order)]


def inverse(perm):
    """A permutation [P] -> its inverse [P] int32 (inverse[perm[i]] = i): `h[inverse(perm)]`
    puts back rows sorted by `perm` with a gather, with no zero-filled buffer to scatter
    into (see `padded_tokens`)."""
    return jnp.zeros(perm.shape, jnp.int32).at[perm].set(jnp.arange(perm.shape[0], dtype=jnp.int32))


def grouped_experts(xs, ids, gate_up, down, *, block_m: int | None = None, tiles: GroupedTiles | None = None,
                    interpret: bool | None = None, scales=None, w8a8: fp8_w8a8.W8a8Tiles | None = None):
    """`grouped_experts_reference` with the kernel: the pairs laid out by `group_layout`,
    both products as `grouped_matmul` (block_m None: `block_rows`; tiles: `GroupedTiles`,
    None: the defaults), silu(gate) * up in xs' dtype between them (an XLA fusion) ->
    [N*k, D] in xs' dtype. scales (gate_up's, down's): FP8 stacks (`grouped_matmul(w_scale=)`).
    w8a8 (`W8a8Tiles`, with scales): the products as FP8 x FP8 (`w8a8.fp8_w8a8_grouped`, the
    rows rounded to E4M3 per group) in row blocks of `w8a8.grouped_block_rows` (block_m None)."""
    gu_scale, down_scale = (None, None) if scales is None else scales
    N, k = ids.shape
    E, D, F2 = gate_up.shape
    Fm = F2 // 2
    P = N * k
    t = GroupedTiles() if tiles is None else tiles
    if block_m is None:
        block_m = block_rows(P, E, t) if w8a8 is None else fp8_w8a8.grouped_block_rows(P, E, w8a8)
    rows, tile_expert = group_layout(ids.reshape(-1), E, block_m)
    R = padded_rows(P, E, block_m)
    x = padded_tokens(xs, rows, k, R)  # [R, D]
    if w8a8 is not None:
        def product(x, tile_expert, w, w_scale):
            return fp8_w8a8.fp8_w8a8_grouped(x, tile_expert, w, w_scale, tiles=w8a8, block_m=block_m,
                                             interpret=interpret)
    else:
        product = functools.partial(grouped_matmul, block_m=block_m, block_n=t.block_n, block_k=t.block_k,
                                    num_warps=t.num_warps, num_stages=t.num_stages, interpret=interpret)
    h = product(x, tile_expert, gate_up, w_scale=gu_scale)  # [R, 2Fm]
    h = product(silu_mul(h[:, :Fm], h[:, Fm:]), tile_expert, down, w_scale=down_scale)  # [R, D]
    named = _group_key(ids.reshape(-1), E) < E  # the rows of other pairs are not written
    return jnp.where(named[:, None], h[rows], jnp.zeros((), h.dtype))


def padded_tokens(xs, rows, k: int, R: int):
    """xs [N, D], rows [N*k] (each pair's row, `group_layout`) -> [R, D]: pair p's token
    xs[p // k] at row rows[p], zeros in the rows no pair took. Gathered through each row's
    pair (a [R] int32 map), not scattered into a zero-filled [R, D] buffer: XLA fused
    those fills of every layer of a program into one kernel, all live at once (a prompt
    pass of 32 x 1,024 tokens through Qwen3.5-122B's 48 MoE layers: 48 x 1.7 GB)."""
    P = rows.shape[0]
    pair = jnp.full((R,), P, jnp.int32).at[rows].set(jnp.arange(P, dtype=jnp.int32))  # P: no pair
    return jnp.take(xs, pair // k, axis=0, mode="fill", fill_value=0)  # row of no pair: index N, filled


def uses_kernel(xs, ids, gate_up, down, tiles: GroupedTiles | None = None, scales=None) -> bool:
    """Whether `grouped` takes the kernel for these arguments (see the dispatch): at least
    `tiles.min_pairs_per_expert` pairs an expert, 16-bit or float32 arrays of one dtype
    (or FP8 stacks with their scales, inputs whole groups), widths >= 16, no stack whose
    offsets would wrap unless `pair_view` takes it (and `tiles.kernel`; tiles None: the
    defaults)."""
    t = GroupedTiles() if tiles is None else tiles
    if dispatch.backend() == "reference" or not t.kernel:
        return False
    if scales is None:
        dtypes = xs.dtype == gate_up.dtype == down.dtype
    else:
        dtypes = all(jnp.dtype(w.dtype) in FP8_DTYPES and w.shape[1] % GROUP == 0 for w in (gate_up, down))
    ok = (ids.size >= t.min_pairs_per_expert * gate_up.shape[0] and dtypes
          and not any(wraps_triton_offsets(w) and not (scales is not None and pairable(w)) for w in (gate_up, down))
          and jnp.dtype(xs.dtype) in map(jnp.dtype, KERNEL_DTYPES) and min(gate_up.shape[1:]) >= 16
          and min(down.shape[1:]) >= 16)
    return dispatch.want_pallas(ok)


def uses_w8a8(xs, ids, gate_up, down, scales=None, tiles: fp8_w8a8.W8a8Tiles | None = None) -> bool:
    """Whether `grouped` runs FP8 stacks as FP8 x FP8 products (`w8a8.fp8_w8a8_grouped`): a
    Hopper GPU, kernels not switched off, stacks the kernel takes, and at least
    `tiles.min_pairs_per_expert` pairs an expert (0: never; tiles None: the defaults), or
    any number where the Triton kernel would read a stack through `pair_view`, a copy of
    the stack every call (DeepSeek-V3's 256 down experts on one device: 1.27x at one pair
    an expert on an H200, docs/benchmarks.md)."""
    t = fp8_w8a8.W8a8Tiles() if tiles is None else tiles
    if scales is None or t.min_pairs_per_expert == 0 or dispatch.backend() == "reference":
        return False
    E = gate_up.shape[0]
    if ids.size < t.min_pairs_per_expert * E and not any(map(wraps_triton_offsets, (gate_up, down))):
        return False
    bt = dataclasses.replace(t, block_m=fp8_w8a8.grouped_block_rows(ids.size, E, t))
    R = padded_rows(ids.size, E, bt.block_m)
    blocks = jax.ShapeDtypeStruct((R // bt.block_m,), jnp.int32)
    return (all(fp8_w8a8.grouped_supported(jax.ShapeDtypeStruct((R, w.shape[1]), xs.dtype), blocks, w, s, bt)
                for w, s in ((gate_up, scales[0]), (down, scales[1])))
            and fp8_mosaic.on_hopper())


def grouped(xs, ids, gate_up, down, *, tiles: GroupedTiles | None = None, scales=None,
            w8a8: fp8_w8a8.W8a8Tiles | None = None):
    """Dispatch: `grouped_experts` (the kernel, with `tiles`) where `uses_kernel`, else
    `grouped_experts_reference`; same arguments and result. scales (gate_up's, down's):
    FP8 stacks, as FP8 x FP8 products where `uses_w8a8` (w8a8: `W8a8Tiles`, None: the
    defaults), else read as FP8 by the kernel, and dequantized into xs' dtype in the graph
    for the reference. JSPEC_KERNELS=pallas forces the kernel (interpret mode off GPU)."""
    if uses_w8a8(xs, ids, gate_up, down, scales, w8a8):
        return grouped_experts(xs, ids, gate_up, down, tiles=tiles, scales=scales,
                               w8a8=fp8_w8a8.W8a8Tiles() if w8a8 is None else w8a8)
    if uses_kernel(xs, ids, gate_up, down, tiles, scales):
        return grouped_experts(xs, ids, gate_up, down, tiles=tiles, scales=scales)
    return grouped_experts_reference(xs, ids, *dequantized_experts(gate_up, down, scales, xs.dtype))
