"""Pallas (Triton) expert products for MoE decode and verification: each (token, expert)
pair reads its expert's weights straight from the stacked [E, Din, Dout] array.

At decode sizes (N tokens, N*k < E pairs) the routed experts are a few matrix-vector
products, memory bound: the only real cost is reading the chosen experts' weights. The
gather formulation (`routed_experts_reference`: `w[ids]`, then batched products) first
copies every pair's expert into a new array, which XLA did at 0.3-0.7 TB/s on the H200.

Kernel (`expert_matmul`): out[p, :] = x[row(p), :] @ w[e(p), :, :] in float32.
- Pairs come from a routing table ids [N, KP] (each token's experts, padded to KP
  columns) and a number of slots per token: pair p = n * slots + j is token n's j-th
  expert, e(p) = ids[n, j] (a 1-D ids [P] is one slot a token). x holds a row per token
  (row(p) = n: the routed and shared experts of a token read its activation without a
  copy per pair) or a row per pair (row(p) = p).
- Grid (P, Dout tiles, K splits); the pair axis varies fastest, so the programs that read
  one tile of the same expert for different pairs run together and the repeats hit L2.
- A program takes BN output columns of one pair and walks its share of the Din rows in
  chunks of BK: it loads the [BK, BN] weight tile of expert ids[p] from the whole array
  (dynamic indexing; XLA makes no copy) and the matching BK activations, and accumulates
  x * w elementwise in a float32 [BK, BN] tile, summed over rows once at the end (no
  tensor cores: a pair is one row).
- Dout not a multiple of BN: the last tile starts at Dout - BN and overlaps its
  neighbour (both write the same values). Din not a multiple of BK: the last chunk starts
  at Din - BK and zeroes the activations of rows an earlier chunk took. No loads out of
  bounds, no masks.
- K splits (more programs when P * tiles is small): each split writes its partial sums
  to its own [P, Dout] slice, which the wrapper adds up (XLA fuses that into the next op).
- An id outside [0, E + E2) names no expert: its pair's output is zero and its program
  reads no weights. Expert parallelism (`models.deepseek`) marks the pairs whose expert
  another device holds that way. Arrays over 4 GB (V3's gate_up: 15 GB) get 64-bit
  offsets from Pallas' Triton lowering.

`expert_matmul` may also take a second stacked array, `extra`, whose experts follow w's
(ids E..): DeepSeek's shared experts run in the routed experts' products that way
(`pl.when` picks the array per program; no concatenated copy).

`routed_experts` chains two of them as DeepSeek's routed experts do: h = x @ gate_up
(rounded to the activations' dtype, as the reference's product is), silu(h_gate) * h_up
in that dtype, then @ down, kept in float32. The second product takes the first one's K
splits as they are (`gated`): each program sums its chunk of them, rounds, and applies
silu(gate) * up while loading its activations, so no kernel runs between the two.

Tiles and thresholds are `ExpertTiles` (below; `Tuning.experts`), taken as `tiles=`
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
from jspec.kernels.fp8 import mosaic as fp8_mosaic
from jspec.kernels.tiling import (KERNEL_DTYPES, chunk_start, in_order_sum, is_pow2, pow2_floor,
                                  wraps_triton_offsets)
from jspec.quantization import FP8_DTYPES, GROUP, dequantized_experts


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """Tiles of the expert kernel (`Tuning.experts`: decode and verification's routed and
    shared experts, DeepSeek's dense MLP and router product at a few rows) and `matvec`, the
    same kernel for few-row dense products (`models.layers.Linear(row_kernel=True)`).

    Measured on the H200 (benchmarks/kernels.py moe, device time of the routed
    experts, bf16): 3.3 TB/s at V3 N=1, 3.5-3.7 TB/s at N=4..16, 1.9 TB/s at V2-Lite N=1.
    Sizes tuned one by one gained 2-9% at most (BK=32, 4 warps, 4 stages at V3 N>=4)."""

    block_n: int = 128  # output columns per program
    block_k: int = 64  # weight rows per loop step
    num_warps: int = 2  # beat 4 warps by 5-20% on every product measured
    num_stages: int = 3
    # The gated second product (`routed_experts`) of one token takes 64-column tiles:
    # V2-Lite's 8 experts 15.7 us instead of 17.7 with 128 (matvec_configs, a probe at 3bf4f68
    # down, H200); the first product stays at 128 (26.0 us against 27.8 with 64). At 4 tokens
    # (32 pairs) 64 made an MTP round 5% slower (benchmarks/deepseek.py mtp),
    # so more tokens keep block_n.
    gated_block_n: int = 64
    # The first product of one token takes gated_block_n-wide tiles too when its input is at
    # least this wide: DeepSeek-V3's 9 experts [7168, 4096] 144 us against 168 us with 128
    # (3.7 against 3.1 TB/s, mla_b1_configs, a probe at 3bf4f68, H200); V2-Lite's [2048, 2816]
    # keep block_n.
    narrow_first_min_din: int = 4096
    target_programs: int = 528  # four programs per SM on an H200 (132 SMs): more K splits below that
    min_split_chunks: int = 4  # a K split walks at least this many chunks
    # DeepSeek's dense MLP at a few rows runs as one wide expert; its second product keeps
    # 128-column tiles (H200: 15.8 us against 18.0 with gated_block_n 64,
    # benchmarks/profiler.py decode --model v2lite).
    dense_down_block_n: int = 128
    matvec_max_rows: int = 1  # `matvec` runs the kernel for products of at most this many rows
    # `matvec`'s tiles: 64 columns a program and 16 K splits were the fastest of 21 tilings
    # for V2-Lite's 2048 x 3648 and 2048 x 2048 products (matvec_configs, a probe at 3bf4f68);
    # matvec_splits None: from target_programs and min_split_chunks.
    matvec_block_n: int = 64
    matvec_splits: int | None = 16
    # Larger weights stay XLA's products, which stream them faster (DeepSeek-V3's 16384 x
    # 7168 output projection: 0.44 ms a V3 layer through `matvec`, 0.36 through XLA; below
    # 10M elements XLA pads the row, see `Tuning.two_row_elements`).
    matvec_max_elements: int = 10_000_000
    # On a Hopper GPU, FP8 stacks with at most this many (token, expert) pairs go through the
    # Mosaic GPU pair kernel (`mosaic_experts`; 0: never), its tiles `Tuning.fp8_mosaic`.
    mosaic_pairs: int = 64

# --------------------------------------------------------------------------- reference

def _gather(w, extra, ids):
    """w[ids] over the experts of w [E, ...] followed by those of `extra` (None: none); an
    id outside them gives zeros."""
    E = w.shape[0]
    got = w[jnp.clip(ids, 0, E - 1)]
    if extra is not None:
        got = jnp.where((ids < E)[:, None, None], got, extra[jnp.clip(ids - E, 0, extra.shape[0] - 1)])
    named = (ids >= 0) & (ids < E + (0 if extra is None else extra.shape[0]))
    return jnp.where(named[:, None, None], got, jnp.zeros((), got.dtype))


def pairs_of(x, ids, slots: int | None = None):
    """The (token, expert) pairs of a routing table: x [N, D] (a row per token) or [P, D]
    (a row per pair), ids [N, KP] (or [P]: one slot a token) -> (x_pairs [P, D], pair ids
    [P]), P = N * slots, pair n * slots + j being token n's j-th expert."""
    ids2 = ids.reshape(-1, 1) if ids.ndim == 1 else ids
    slots = ids2.shape[1] if slots is None else slots
    flat = ids2[:, :slots].reshape(-1)
    return (x if x.shape[0] == flat.shape[0] else jnp.repeat(x, slots, axis=0)), flat


def silu_mul(gate, up):
    """DeepSeek's expert activation silu(gate) * up, in the inputs' dtype."""
    return jax.nn.silu(gate) * up


def silu_mul_float32(gate, up, dtype):
    """`silu_mul` of gate and up (float32 values of `dtype` numbers) computed in float32,
    each operation's result rounded to `dtype` as jax's `silu_mul` on `dtype` arrays rounds
    it (sigmoid as exp, add, divide; then the two products): the kernel's form, since
    Triton has no 16-bit division."""
    def rnd(v):
        return v.astype(dtype).astype(jnp.float32)
    sigmoid = rnd(1.0 / rnd(1.0 + rnd(jnp.exp(-gate))))
    return rnd(rnd(gate * sigmoid) * up)


def routed_experts_reference(x, ids, gate_up, down, extra=None, slots: int | None = None):
    """x [N, D] (each token) or [P, D] (each pair), ids [N, KP] (each token's experts; or
    [P]) and `slots` as `pairs_of`, gate_up [E, D, 2Fm], down [E, Fm, D], extra: (gate_up,
    down) of experts E.. -> [P, D] float32: the gather formulation (copies each pair's
    expert weights, then batched products in the activations' dtype)."""
    x_pairs, ids = pairs_of(x, ids, slots)
    Fm = down.shape[1]
    extra_gu, extra_down = (None, None) if extra is None else extra
    h = jnp.einsum("pd,pdf->pf", x_pairs, _gather(gate_up, extra_gu, ids))  # [P, 2Fm]
    a = silu_mul(h[:, :Fm], h[:, Fm:])
    return jnp.einsum("pf,pfd->pd", a, _gather(down, extra_down, ids)).astype(jnp.float32)


def rms_norm(x, weight, eps: float):
    """RMSNorm of x's rows [..., D] with weight [D] as `models.layers.RMSNorm` computes it
    (the factor in float32, the normed row rounded to x's dtype, then times the weight)."""
    xf = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * (xf * r).astype(x.dtype)


def normed(x, norm):
    """x RMS-normed by norm (weight, eps) as `rms_norm` does; x itself when norm is None."""
    return x if norm is None else rms_norm(x, *norm)


def normed_with_top(x, norm):
    """(x RMS-normed by norm (weight, eps) as `rms_norm` does, a bound [..., 1] float32 on
    each normed row's largest magnitude) for the float16 rows of the FP8 kernels
    (`fp8.matmul.half_rows`): r * max |x w| (r the norm's factor) widened by 2^-6 for the
    roundings to x's dtype (two, each at most 2^-8). It reads x as the norm's sum of squares
    does, so XLA computes both in one reduction where a maximum of the normed rows would be
    a pass of its own."""
    weight, eps = norm
    xf = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    top = r * jnp.max(jnp.abs(xf * weight.astype(jnp.float32)), axis=-1, keepdims=True) * (1 + 2 ** -6)
    return weight * (xf * r).astype(x.dtype), top


def prologue_norm(x, norm):
    """(x, norm) for a kernel with the norm in its prologue: the prologue rounds in x's
    dtype, so a norm weight of another dtype is applied here instead -> (x, norm or None)."""
    if norm is None or norm[0].dtype == x.dtype:
        return x, norm
    return rms_norm(x, *norm), None


def expert_matmul_reference(x, ids, w, slots: int | None = None, norm=None):
    """x [N or P, Din], ids [N, KP] or [P] (see `pairs_of`), w [E, Din, Dout] -> [P, Dout]
    float32 (float32 products); norm (weight [Din], eps): x's rows RMS-normed first."""
    if norm is not None:
        x = rms_norm(x, *norm)
    x_pairs, ids = pairs_of(x, ids, slots)
    return jnp.einsum("pd,pdf->pf", x_pairs.astype(jnp.float32), _gather(w, None, ids).astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)


# --------------------------------------------------------------------------- kernel

def _row_rstd(x_ref, row, din: int, eps: float):
    """RMSNorm's factor of x_ref's row: the whole row's sum of squares, loaded as Din's
    power-of-two pieces (independent loads, one latency, not a loop's) -> float32 scalar."""
    total, start = jnp.zeros((), jnp.float32), 0
    for size in (1 << b for b in reversed(range(din.bit_length())) if din >> b & 1):
        xv = x_ref[row, pl.ds(start, size)].astype(jnp.float32)
        total, start = total + jnp.sum(xv * xv), start + size
    return lax.rsqrt(total / din + eps)


def _row_chunk(x_ref, norm_ref, row, kc, size: int, rstd):
    """[size] float32: x_ref[row, kc:kc+size], RMS-normed with norm_ref's weight and the
    factor rstd (None: as it is), each step rounded to x's dtype as `rms_norm` rounds."""
    xv = x_ref[row, pl.ds(kc, size)].astype(jnp.float32)
    if rstd is None:
        return xv

    def rounded(v):
        return v.astype(x_ref.dtype).astype(jnp.float32)
    return rounded(norm_ref[pl.ds(kc, size)].astype(jnp.float32) * rounded(xv * rstd))

def _kernel(ids_ref, x_ref, w_ref, *rest, din: int, dout: int, num_experts: int, num_extra: int,
            block_k: int, block_n: int, chunks_per_split: int, num_chunks: int,
            reduce_each_step: bool, slots: int, token_rows: bool, gated, norm_eps, scaled: bool = False,
            extra_scaled: bool = False):
    """One (pair p, column tile j, K split s).

    ids_ref [N, KP] int32 (pair p: ids[p // slots, p % slots]); x_ref [N, Din] (token_rows)
    or [P, Din], or with `gated` (the activations' dtype) [S1, P, 2 Din] float32: a
    product's K splits, whose sum's halves give silu(gate) * up; w_ref [E, Din, Dout] and,
    with `num_extra`, the extra experts' [E2, Din, Dout] (ids E.. E+E2-1) (whole arrays);
    with `norm_eps`, norm_ref [Din]: x's rows RMS-normed with that weight first; with
    `scaled`, scale_ref [E, Din / GROUP, Dout] float32: w holds FP8 values, each weight
    times the scale of its group of GROUP rows and its column (a chunk lies in one group);
    with `extra_scaled`, extra_scale_ref [E2, Din / GROUP, Dout]: the same for the extra experts;
    o_ref [S, P, Dout] float32 (whole; this program writes [s, p, n0:n0+BN])."""
    rest = list(rest)
    norm_ref = rest.pop(0) if norm_eps is not None else None
    scale_ref = rest.pop(0) if scaled else None
    extra_ref = rest.pop(0) if num_extra else None
    extra_scale_ref = rest.pop(0) if extra_scaled else None
    o_ref, = rest
    p, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = ids_ref[p // slots, p % slots]
    row = p // slots if token_rows else p
    n0 = j * block_n
    if dout % block_n:  # the last tile overlaps its neighbour instead of running past Dout
        n0 = jnp.minimum(n0, dout - block_n)
    lo = s * chunks_per_split
    hi = jnp.minimum(lo + chunks_per_split, num_chunks)
    rstd = None if norm_eps is None else _row_rstd(x_ref, row, din, norm_eps)

    def activations(kc):  # [BK] float32: inputs kc .. kc + BK of this pair
        if gated is None:
            return _row_chunk(x_ref, norm_ref, row, kc, block_k, rstd)
        gate = sum(x_ref[i, row, pl.ds(kc, block_k)] for i in range(x_ref.shape[0]))
        up = sum(x_ref[i, row, pl.ds(din + kc, block_k)] for i in range(x_ref.shape[0]))
        return silu_mul_float32(gate.astype(gated).astype(jnp.float32), up.astype(gated).astype(jnp.float32),
                                 gated)

    def product(ref, expert, scales=None):  # this program's share of x[row] @ ref[expert][:, n0:n0+BN]
        def step(c, acc):
            kc, fresh = chunk_start(c, block_k, din)
            xv = activations(kc) if fresh is None else jnp.where(fresh, activations(kc), 0.0)
            wv = ref[expert, pl.ds(kc, block_k), pl.ds(n0, block_n)].astype(jnp.float32)
            if scales is not None:
                wv = wv * scales[expert, kc // GROUP, pl.ds(n0, block_n)][None, :]
            if reduce_each_step:
                return acc + jnp.sum(xv[:, None] * wv, axis=0)
            return acc + xv[:, None] * wv

        shape = (block_n,) if reduce_each_step else (block_k, block_n)
        acc = lax.fori_loop(lo, hi, step, jnp.zeros(shape, jnp.float32))
        o_ref[s, p, pl.ds(n0, block_n)] = acc if reduce_each_step else jnp.sum(acc, axis=0)

    @pl.when((e < 0) | (e >= num_experts + num_extra))
    def _():  # no expert: zeros, nothing read
        o_ref[s, p, pl.ds(n0, block_n)] = jnp.zeros((block_n,), jnp.float32)

    @pl.when((e >= 0) & (e < num_experts))
    def _():
        product(w_ref, jnp.clip(e, 0, num_experts - 1), scale_ref)

    if num_extra:
        @pl.when((e >= num_experts) & (e < num_experts + num_extra))
        def _():
            product(extra_ref, jnp.clip(e - num_experts, 0, num_extra - 1), extra_scale_ref)


def _table(ids, slots):
    """ids [N, KP] or [P] and slots -> (ids [N, KP], slots); raises for a bad table."""
    if getattr(ids, "ndim", None) not in (1, 2):
        raise ValueError(f"ids must be a routing table [N, KP] or pair ids [P], got shape "
                         f"{getattr(ids, 'shape', ids)}")
    ids2 = ids.reshape(-1, 1) if ids.ndim == 1 else ids
    slots = ids2.shape[1] if slots is None else slots
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= ids2.shape[1]:
        raise ValueError(f"slots must be an int in [1, {ids2.shape[1]}] (the table's columns), got {slots!r}")
    return ids2, slots


def _check_matmul(x, ids, w, extra=None, slots=None, gated=None, norm=None, w_scale=None, extra_scale=None,
                  triton: bool = True):
    """Raises ValueError / TypeError for arguments `expert_matmul` does not take; else
    -> (ids as a table [N, KP], slots, pairs P, whether x has a row per token)."""
    if w_scale is not None:
        _check_scale(w, w_scale)
    if extra_scale is not None:
        if extra is None:
            raise ValueError("extra_scale goes with extra experts, and there are none")
        _check_scale(extra, extra_scale)
    if norm is not None:
        if gated is not None:
            raise ValueError("norm and gated exclude each other (a gated input is a product's K splits)")
        weight, eps = norm
        if getattr(weight, "shape", None) != (w.shape[1],) or weight.dtype != x.dtype:
            raise ValueError(f"norm weight must be [{w.shape[1]}] of x's dtype {x.dtype}, got "
                             f"{getattr(weight, 'dtype', None)} {getattr(weight, 'shape', weight)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"norm eps must be a float >= 0, got {eps!r}")
    if extra is not None:
        if getattr(extra, "ndim", None) != 3 or getattr(w, "ndim", None) != 3 or extra.shape[1:] != w.shape[1:]:
            raise ValueError(f"extra experts must be [E2, Din, Dout] like w {getattr(w, 'shape', w)}, got "
                             f"{getattr(extra, 'shape', extra)}")
        if w_scale is None and extra_scale is None and extra.dtype != w.dtype:
            raise TypeError(f"extra experts' dtype {extra.dtype} differs from w's {w.dtype}")
        if w_scale is not None and extra_scale is None and jnp.dtype(extra.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
            raise TypeError(f"extra experts beside FP8 ones are float32, bfloat16 or float16, or FP8 with "
                            f"extra_scale, got {extra.dtype}")
    if getattr(w, "ndim", None) != 3 or getattr(x, "ndim", None) != (3 if gated is not None else 2):
        want = "[S1, P, 2 Din] (gated)" if gated is not None else "[N or P, Din]"
        raise ValueError(f"expert_matmul needs x {want} and w [E, Din, Dout], got shapes "
                         f"{getattr(x, 'shape', x)} and {getattr(w, 'shape', w)}")
    ids2, slots = _table(ids, slots)
    N = ids2.shape[0]
    P = N * slots
    E, Din, Dout = w.shape
    rows, Din_x = x.shape[-2:]
    if gated is not None:
        if x.dtype != jnp.float32 or Din_x != 2 * Din or rows != P:
            raise ValueError(f"gated x must be float32 [S1, {P}, {2 * Din}] (a product's K splits of the "
                             f"gate and up halves), got {x.dtype} {x.shape}")
        if jnp.dtype(gated) not in map(jnp.dtype, KERNEL_DTYPES):
            raise TypeError(f"gated must be the activations' dtype, got {gated!r}")
    elif rows not in (N, P):
        raise ValueError(f"x has {rows} rows for {N} tokens x {slots} slots (want a row per token or per pair)")
    elif Din_x != Din:
        raise ValueError(f"weights take {Din} inputs, x has {Din_x}")
    if N < 1 or E < 1:
        raise ValueError(f"no pairs or no experts: ids {ids.shape}, w {w.shape}")
    if Din < 16 or Dout < 16:
        raise ValueError(f"Din and Dout must be >= 16 (Triton tiles), got {Din} and {Dout}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integer, got {ids.dtype}")
    for name, a in (("x", x),) + (() if w_scale is not None else (("w", w),)):
        if jnp.dtype(a.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
            raise TypeError(f"{name} dtype {a.dtype} is not float32, bfloat16 or float16")
    for name, a in (("w", w), ("extra", extra)):
        if triton and a is not None and wraps_triton_offsets(a):  # the Triton kernel's limit alone
            raise ValueError(f"{name} {a.dtype} {a.shape} has more than 2^31 elements in at most 2^32 bytes, which "
                             f"Pallas' Triton lowering indexes with wrapping 32-bit offsets")
    return ids2, slots, P, gated is None and rows == N and slots > 1


def _check_scale(w, w_scale) -> None:
    """An FP8 weight's group scales (`expert_matmul(w_scale=)`): ValueError / TypeError."""
    if jnp.dtype(w.dtype) not in FP8_DTYPES:
        raise TypeError(f"w_scale goes with an FP8 weight, w is {w.dtype}")
    E, Din, Dout = w.shape
    if Din % GROUP or getattr(w_scale, "shape", None) != (E, Din // GROUP, Dout) or w_scale.dtype != jnp.float32:
        raise ValueError(f"an FP8 weight [E, Din, Dout] = {w.shape} needs Din a multiple of {GROUP} and float32 "
                         f"scales [E, Din / {GROUP}, Dout], got {getattr(w_scale, 'dtype', None)} "
                         f"{getattr(w_scale, 'shape', w_scale)}")


def expert_matmul(x, ids, w, extra=None, *, slots: int | None = None, gated=None, norm=None, w_scale=None,
                  extra_scale=None, sum_splits: bool = True,
                  block_n: int | None = None, block_k: int | None = None, num_splits: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  reduce_each_step: bool = False, interpret: bool | None = None, tiles: ExpertTiles | None = None,
                  tile_pairs: int | None = None):
    """out[p] = x[row(p)] @ w[e(p)] for the pairs of a routing table: ids [N, KP] int
    (token n's experts; or [P], one a token), slots (pairs a token, default KP): pair
    p = n * slots + j has expert e(p) = ids[n, j]; x [N, Din] (a row per token) or [P, Din]
    (a row per pair); w [E, Din, Dout] -> [P, Dout] float32, reading only the experts the
    table names (a pair whose id names no expert gives zeros). extra [E2, Din, Dout]: more experts, which
    ids E.. E+E2-1 name (DeepSeek's shared experts beside the routed ones, without a
    concatenated copy).

    gated (the activations' dtype): x is instead [S1, P, 2 Din] float32, the K splits of a
    product whose sum holds each pair's gate and up halves; the input is silu(gate) * up
    of that sum rounded to `gated` (`routed_experts`). norm (weight [Din] of x's dtype,
    eps): each program RMS-norms x's row first, as `rms_norm` does (so a decoder's norm
    needs no kernel of its own before its product). sum_splits False: return this
    product's own K splits [S, P, Dout] unsummed (what a gated product takes).

    block_n: output columns per program, block_k: weight rows per loop step (powers of
    two; capped at Dout and Din). num_splits: programs sharing one (pair, tile)'s rows
    (default: enough programs to fill the GPU, `tiles.target_programs`, each walking at
    least `tiles.min_split_chunks` chunks). num_warps, num_stages: Triton's. Each None
    takes `tiles`' value (`ExpertTiles`; None: the defaults).
    reduce_each_step: sum each step's [BK, BN] products over rows at once (a [BN]
    accumulator) instead of accumulating the tile and summing it at the end.
    interpret None: interpret mode unless the default backend is a GPU. tile_pairs: choose
    the default splits as for this many pairs (None: P): a fixed number makes each pair's
    sums independent of the others (`Tuning.row_invariant`). w_scale [E, Din / GROUP, Dout]
    float32: w is FP8 (`jspec.quantization`), each weight times the scale of its group of
    GROUP rows and its column; chunks then take at most GROUP rows. extra_scale [E2, Din /
    GROUP, Dout]: the same for FP8 extra experts (without it they are read as they are: the
    compute dtype, unscaled)."""
    ids2, slots, P, token_rows = _check_matmul(x, ids, w, extra, slots, gated, norm, w_scale, extra_scale)
    E, Din, Dout = w.shape
    E2 = 0 if extra is None else extra.shape[0]
    t = ExpertTiles() if tiles is None else tiles
    block_n = t.block_n if block_n is None else block_n
    block_k = t.block_k if block_k is None else block_k
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if not is_pow2(v):
            raise ValueError(f"{name} must be a power of two, got {v!r}")
    BN = min(block_n, pow2_floor(Dout))
    BK = min(block_k, pow2_floor(Din), GROUP if w_scale is not None or extra_scale is not None else Din)
    col_tiles = pl.cdiv(Dout, BN)
    num_chunks = pl.cdiv(Din, BK)
    if num_splits is None:
        want = pl.cdiv(t.target_programs, (P if tile_pairs is None else tile_pairs) * col_tiles)
        num_splits = max(1, min(want, num_chunks // t.min_split_chunks))
    if not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    per_split = pl.cdiv(num_chunks, min(num_splits, num_chunks))
    S = pl.cdiv(num_chunks, per_split)  # no empty splits
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    kernel = functools.partial(_kernel, din=Din, dout=Dout, num_experts=E, num_extra=E2, block_k=BK,
                               block_n=BN, chunks_per_split=per_split, num_chunks=num_chunks,
                               reduce_each_step=bool(reduce_each_step), slots=slots, token_rows=token_rows,
                               gated=None if gated is None else jnp.dtype(gated),
                               norm_eps=None if norm is None else float(norm[1]), scaled=w_scale is not None,
                               extra_scaled=extra_scale is not None)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        params = plt.CompilerParams(num_warps=t.num_warps if num_warps is None else num_warps,
                                    num_stages=t.num_stages if num_stages is None else num_stages)
    whole = pl.BlockSpec()  # whole arrays, indexed inside the kernel
    out = pl.pallas_call(
        kernel,
        grid=(P, col_tiles, S),
        in_specs=[whole] * (3 + (norm is not None) + (w_scale is not None) + (E2 > 0) + (extra_scale is not None)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((S, P, Dout), jnp.float32),
        interpret=interpret,
        compiler_params=params,
        name="jspec_expert_matmul",
    )(ids2.astype(jnp.int32), x, w, *(() if norm is None else (norm[0],)), *(() if w_scale is None else (w_scale,)),
      *(() if extra is None else (extra,)), *(() if extra_scale is None else (extra_scale,)))
    if not sum_splits:
        return out
    return in_order_sum(out)



# --------------------------------------------------------------------------- dense rows

def uses_matvec(x, w, tiles: ExpertTiles | None = None, *, any_size: bool = False, scaled: bool = False) -> bool:
    """Whether `matvec` runs the kernel for x [..., K] @ w [K, N]: at most
    `tiles.matvec_max_rows` rows and (unless any_size) a weight of fewer than
    `tiles.matvec_max_elements` elements, on a GPU (see the dispatch; a 2-D float weight,
    or with `scaled` an FP8 one of K a multiple of GROUP). tiles None: the defaults."""
    t = ExpertTiles() if tiles is None else tiles
    rows = x.size // x.shape[-1]
    if dispatch.backend() == "reference" or getattr(w, "ndim", None) != 2 or not 1 <= rows <= t.matvec_max_rows:
        return False  # more rows: XLA's product (the limits hold under JSPEC_KERNELS=pallas too)
    if not any_size and w.size >= t.matvec_max_elements:
        return False
    if scaled and not (jnp.dtype(w.dtype) in FP8_DTYPES and w.shape[0] % GROUP == 0):
        return False  # the kernel's FP8 path takes whole groups only (also under JSPEC_KERNELS=pallas)
    takes = scaled or jnp.dtype(w.dtype) in map(jnp.dtype, KERNEL_DTYPES)
    return dispatch.want_pallas(takes and min(w.shape) >= 16)


def matvec(x, w, norm=None, *, w_scale=None, float32_out: bool = False, sum_splits: bool = True,
           interpret: bool | None = None, tiles: ExpertTiles | None = None):
    """x [..., K] @ w [K, N] for a few rows through the expert kernel (w as one expert,
    one pair a row) -> [..., N] in w's dtype (float32 with `float32_out`); norm (weight,
    eps): x's rows RMS-normed first, in the kernel. XLA runs a one-row product with split-K
    partials and a copy of x padded to two rows (`models.layers.pad_one_row`); here the K
    splits are summed by the consumer's fusion and the norm needs no kernel of its own.
    sum_splits False: -> the K splits [S, rows, N] float32 unsummed, for a kernel that sums
    them as it loads them (`kernels.mla.inputs`). tiles: `matvec_block_n` columns a
    program, `matvec_splits` K splits, the rest as `expert_matmul` (None: the defaults).
    w_scale [K / GROUP, N] float32: w is FP8 (`jspec.quantization`), read as FP8 and scaled
    in the kernel; the product is then in x's dtype."""
    t = ExpertTiles() if tiles is None else tiles
    dtype = x.dtype if w_scale is not None else w.dtype  # the dtype the product rounds to
    if norm is not None and not x.dtype == norm[0].dtype == dtype:  # the prologue rounds in one dtype
        x, norm = rms_norm(x, *norm), None
    rows = x.reshape(-1, x.shape[-1]).astype(dtype)
    y = expert_matmul(rows, jnp.zeros((rows.shape[0],), jnp.int32), w[None], norm=norm,
                      w_scale=None if w_scale is None else w_scale[None], block_n=t.matvec_block_n,
                      num_splits=t.matvec_splits, sum_splits=sum_splits, interpret=interpret, tiles=t)
    if not sum_splits:
        return y
    return y.astype(jnp.float32 if float32_out else dtype).reshape(x.shape[:-1] + (w.shape[1],))


# --------------------------------------------------------------------------- routed experts

def _check_experts(x, ids, gate_up, down, extra=None, slots=None, scales=None, extra_scales=None,
                   triton: bool = True) -> None:
    """Raises ValueError / TypeError for arguments `routed_experts` does not take (triton
    False: leaves out the Triton kernel's own limit, `wraps_triton_offsets`, for
    `uses_mosaic`, which shares the other checks)."""
    if getattr(gate_up, "ndim", None) != 3 or getattr(down, "ndim", None) != 3:
        raise ValueError(f"gate_up must be [E, D, 2Fm] and down [E, Fm, D], got "
                         f"{getattr(gate_up, 'shape', gate_up)} and {getattr(down, 'shape', down)}")
    E, D, F2 = gate_up.shape
    if down.shape != (E, F2 // 2, D) or F2 % 2:
        raise ValueError(f"down {down.shape} does not match gate_up {gate_up.shape} "
                         f"(want [E, Fm, D] = {(E, F2 // 2, D)})")
    extra_gu, extra_down = (None, None) if extra is None else extra
    gu_scale, down_scale = (None, None) if scales is None else scales
    extra_gu_scale, extra_down_scale = (None, None) if extra_scales is None else extra_scales
    if gate_up.dtype != down.dtype and gu_scale is None and down_scale is None:
        raise TypeError(f"gate_up and down dtypes differ: {gate_up.dtype}, {down.dtype}")
    _, _, P, _ = _check_matmul(x, ids, gate_up, extra_gu, slots, w_scale=gu_scale, extra_scale=extra_gu_scale,
                               triton=triton)
    _check_matmul(jax.ShapeDtypeStruct((1, P, F2), jnp.float32), ids, down, extra_down, slots, gated=x.dtype,
                  triton=triton,
                  w_scale=down_scale, extra_scale=extra_down_scale)
    if extra is not None and extra_gu.shape[0] != extra_down.shape[0]:
        raise ValueError(f"extra experts: gate_up {extra_gu.shape} and down {extra_down.shape} hold "
                         f"different numbers of experts")


def is_supported(x, ids, gate_up, down, extra=None, slots=None, scales=None, extra_scales=None) -> bool:
    """Whether `routed_experts` takes these arguments (the dispatch falls back to the
    reference when not)."""
    try:
        _check_experts(x, ids, gate_up, down, extra, slots, scales, extra_scales)
    except (TypeError, ValueError):
        return False
    return True


def routed_experts(x, ids, gate_up, down, extra=None, slots: int | None = None, *, norm=None,
                   interpret: bool | None = None, gate_up_tiles: dict | None = None, down_tiles: dict | None = None,
                   tiles: ExpertTiles | None = None, as_tokens: int | None = None, scales=None,
                   extra_scales=None):
    """The routed experts of a routing table's (token, expert) pairs with the Pallas
    kernel: x [N, D] (each token's activation; or [P, D], each pair's), ids [N, KP] int
    (each token's experts; or [P]) and slots as `expert_matmul`, gate_up [E, D, 2Fm], down
    [E, Fm, D] -> [P, D] float32; extra: (gate_up [E2, D, 2Fm], down [E2, Fm, D]) of experts
    E.. E+E2-1 (shared experts), read in the same products. Same roundings as
    `routed_experts_reference` up to the last product, which stays float32: the second
    product sums the first one's K splits, rounds them to x's dtype and applies silu(gate)
    * up as it loads them. norm (weight [D], eps): x's rows RMS-normed first, in the first
    product's prologue (`expert_matmul`). tiles: `ExpertTiles` (None: the defaults); one
    token's second product, and its first one from `tiles.narrow_first_min_din` inputs on,
    take `tiles.gated_block_n`-wide tiles. *_tiles: `expert_matmul`'s keyword arguments
    for each product, over those. as_tokens: tiles and splits chosen as for this many
    tokens whatever the table holds (`Tuning.row_invariant` passes 1: each pair's sums then
    run in the order of a one-token decode step's). scales (gate_up's [E, D / GROUP, 2Fm],
    down's [E, Fm / GROUP, D], float32): gate_up and down are FP8 (`jspec.quantization`),
    read as FP8 and scaled (`expert_matmul(w_scale=)`). Either scale may be None, its stack
    then in the compute dtype (a dense MLP whose width is no multiple of GROUP keeps its
    down projection dequantized). extra_scales: the same for FP8 extra experts (None: they
    are in the compute dtype)."""
    _check_experts(x, ids, gate_up, down, extra, slots, scales, extra_scales)
    gu_scale, down_scale = (None, None) if scales is None else scales
    extra_gu_scale, extra_down_scale = (None, None) if extra_scales is None else extra_scales
    t = ExpertTiles() if tiles is None else tiles
    x, norm = prologue_norm(x, norm)
    extra_gu, extra_down = (None, None) if extra is None else extra
    tokens = ids.shape[0] if as_tokens is None else as_tokens
    one_token = tokens == 1  # see ExpertTiles.gated_block_n and narrow_first_min_din
    narrow = {"block_n": t.gated_block_n}
    first = narrow if one_token and gate_up.shape[1] >= t.narrow_first_min_din else {}
    second = narrow if one_token else {}
    if as_tokens is not None:  # the splits too: as for as_tokens tokens' pairs
        pinned = {"tile_pairs": as_tokens * _table(ids, slots)[1]}
        first, second = first | pinned, second | pinned
    h = expert_matmul(x, ids, gate_up, extra_gu, slots=slots, sum_splits=False, norm=norm, interpret=interpret,
                      tiles=t, w_scale=gu_scale, extra_scale=extra_gu_scale,
                      **(first | (gate_up_tiles or {})))  # [S1, P, 2Fm]: K splits
    return expert_matmul(h, ids, down, extra_down, slots=slots, gated=x.dtype, interpret=interpret, tiles=t,
                         w_scale=down_scale, extra_scale=extra_down_scale, **(second | (down_tiles or {})))


def uses_mosaic(x, ids, gate_up, down, extra=None, slots=None, scales=None, extra_scales=None, *,
                norm=None, tiles: ExpertTiles | None = None, as_tokens: int | None = None) -> bool:
    """Whether `moe_experts` runs the pairs through the Mosaic GPU kernel
    (`mosaic_experts`): arguments `routed_experts` takes (but for the Triton kernel's own
    offsets limit), both stacks FP8 with their scales (extra experts FP8 too, or none),
    bfloat16 or float16 activations (after the norm, `norm`), D and Fm multiples of GROUP,
    2Fm and D of 64, at most `tiles.mosaic_pairs` pairs, not the row-invariant mode
    (as_tokens None: it keeps the Triton kernel), kernels not switched off, and a Hopper
    GPU."""
    t = ExpertTiles() if tiles is None else tiles
    if as_tokens is not None or dispatch.backend() == "reference" or scales is None or None in scales:
        return False
    if extra is not None and (extra_scales is None or None in extra_scales):
        return False
    try:
        _check_experts(x, ids, gate_up, down, extra, slots, scales, extra_scales, triton=False)
        if norm is not None:
            _check_matmul(x, ids, gate_up, slots=slots, norm=norm, w_scale=scales[0], triton=False)
    except (TypeError, ValueError):
        return False
    ids2, slots = _table(ids, slots)
    P = ids2.shape[0] * slots
    rows = jax.ShapeDtypeStruct((P, gate_up.shape[1]), x.dtype)
    Fm = down.shape[1]
    flat = jax.ShapeDtypeStruct((P,), ids.dtype)
    extra_gu, extra_down = (None, None) if extra is None else extra
    extra_gu_scale, extra_down_scale = (None, None) if extra is None else extra_scales
    return (P <= t.mosaic_pairs and x.shape[0] in (ids2.shape[0], P) and x.shape[-1] == gate_up.shape[1]
            and fp8_mosaic.pairs_supported(rows, flat, gate_up, scales[0], extra_gu, extra_gu_scale)
            and fp8_mosaic.pairs_supported(jax.ShapeDtypeStruct((P, Fm), x.dtype), flat, down, scales[1],
                                           extra_down, extra_down_scale)
            and fp8_mosaic.on_hopper())


def mosaic_experts(x, ids, gate_up, down, extra=None, slots: int | None = None, *, scales, extra_scales=None,
                   tiles=None, top=None, interpret: bool | None = None):
    """`routed_experts_reference`'s result for FP8 stacks through the Mosaic GPU pair kernel
    (`kernels.fp8.mosaic.fp8_pairs_mosaic`: the weight streamed by TMA and widened in
    registers, 3.5-3.9 TB/s where the Triton expert kernel reads FP8 at about 2): x (normed)
    [N, D] or [P, D], ids and slots as `pairs_of`, scales (gate_up's, down's), extra and
    extra_scales as `routed_experts` -> [P, D] float32. h = x @ gate_up rounded to x's
    dtype, silu(gate) * up in that dtype (one XLA fusion between the two kernels), then @
    down in float32. tiles: `MosaicTiles` (None: the defaults). top: x's rows' bounds
    [N or P, 1] for their float16 factors (`normed_with_top`; None: their maxima)."""
    ids2, slots = _table(ids, slots)
    x_pairs, flat = pairs_of(x, ids2, slots)
    top_pairs = None if top is None else pairs_of(top, ids2, slots)[0]
    Fm = down.shape[1]
    extra_gu, extra_down = (None, None) if extra is None else extra
    extra_gu_scale, extra_down_scale = (None, None) if extra is None else extra_scales
    # K splits as for one token's pairs whatever the tokens: a pair's sums are then those of
    # a one-token decode step (verification's rows equal decoding's)
    h = fp8_mosaic.fp8_pairs_mosaic(x_pairs, flat, gate_up, scales[0], extra_gu, extra_gu_scale, tiles=tiles,
                                    tile_pairs=slots, top=top_pairs, interpret=interpret)  # [P, 2Fm] in x's dtype
    a = silu_mul(h[:, :Fm], h[:, Fm:])
    return fp8_mosaic.fp8_pairs_mosaic(a, flat, down, scales[1], extra_down, extra_down_scale, float32_out=True,
                                       tiles=tiles, tile_pairs=slots, interpret=interpret)


def uses_kernel(x, ids, gate_up, down, extra=None, slots=None, scales=None, extra_scales=None) -> bool:
    """Whether `moe_experts` takes the Pallas kernel for these arguments (see the dispatch)."""
    if dispatch.backend() == "reference":
        return False
    return dispatch.want_pallas(dispatch.backend() == "pallas" or
                                is_supported(x, ids, gate_up, down, extra, slots, scales, extra_scales))


def moe_experts(x, ids, gate_up, down, extra=None, slots: int | None = None, norm=None, *,
                tiles: ExpertTiles | None = None, as_tokens: int | None = None, scales=None, extra_scales=None,
                mosaic_tiles=None):
    """Dispatch: `routed_experts` (the kernel, with `tiles` and `as_tokens`) where
    `uses_kernel`, else `routed_experts_reference`; same arguments, [P, D] float32; norm
    (weight, eps): x's rows RMS-normed first (`rms_norm`; the kernel's prologue). scales,
    extra_scales: FP8 stacks' (`routed_experts`); the reference dequantizes the stacks into
    x's dtype first. JSPEC_KERNELS=pallas forces the kernel (interpret mode off GPU; raises
    for arguments it does not take). On a Hopper GPU, FP8 stacks of few pairs run
    `mosaic_experts` instead (`uses_mosaic`; its tiles `mosaic_tiles`, a `MosaicTiles`)."""
    if uses_mosaic(x, ids, gate_up, down, extra, slots, scales, extra_scales, norm=norm, tiles=tiles,
                   as_tokens=as_tokens):
        xn, top = (x, None) if norm is None else normed_with_top(x, norm)
        return mosaic_experts(xn, ids, gate_up, down, extra, slots, scales=scales, extra_scales=extra_scales,
                              tiles=mosaic_tiles, top=top)
    if uses_kernel(x, ids, gate_up, down, extra, slots, scales, extra_scales):
        return routed_experts(x, ids, gate_up, down, extra, slots, norm=norm, tiles=tiles, as_tokens=as_tokens,
                              scales=scales, extra_scales=extra_scales)
    gate_up, down = dequantized_experts(gate_up, down, scales, x.dtype)
    if extra is not None:
        extra = dequantized_experts(*extra, extra_scales, x.dtype)
    return routed_experts_reference(normed(x, norm), ids, gate_up, down, extra, slots)

