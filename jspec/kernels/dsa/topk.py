"""DeepSeek-V3.2's sparse-attention selection: the slots of each row's k best indexer
scores (`models.deepseek.Indexer`, decoding and tree verification).

    scores [..., S] float32 (-inf: a slot the token does not see) -> [..., k] int32

the slots of the k largest scores, ties at the k-th score taken in slot order (the lowest
slots, as `lax.top_k`), listed in ascending slot order and padded with -1 where fewer than
k scores are above -inf. Order: `lax.top_k`'s, XLA's total order on floats, in which 0.0
ranks above -0.0 (the lightning indexer's relu sums give both: a sum of w * 0.0 terms
with negative weights is -0.0); the kernel keeps it. NaN scores are outside the contract
(lax.top_k ranks +NaN first, then the -inf mask drops it; the kernel never selects one).

`topk_slots_reference` is lax.top_k, the mask and a sort. `topk_slots` is a radix select
in Pallas (Triton) kernels, a grid of (key block, row) programs each, so that one row
(decoding at batch 1) still spreads over many SMs:

1. Keys. A float's bits, with the 31 low bits flipped where the sign bit is set, order as
   signed int32 the way the floats order (-inf < ... < -0.0 < 0.0 < ... < +inf); with the
   sign bit flipped too (u), as unsigned 32-bit patterns, read 8 bits (a digit) at a time
   from the top. Valid keys: above -inf's (and not NaN).
2. Four counting passes (digits of 8 bits, most significant first). Pass p counts, in
   each block of `block` slots, the valid keys (above -inf) whose first p digits equal
   the prefix chosen so far, by their digit p: a [16, C] one-hot of the digit's high 4
   bits times a [C, 16] one-hot of its low 4 bits (bfloat16 0/1, float32 sums: exact) is
   the block's 256-bin histogram, on the tensor cores, C = `chunk` slots at a time.
   jnp glue sums the blocks' histograms and picks the digit in which the rank sought
   falls (the largest digit with at least r keys at or above it; r -= the keys above it).
   After four passes the prefix is the k-th largest key T (of min(k, valid keys)) and r
   the keys equal to T to take; each block's count of keys above T is the sum over the
   passes of its counts above the digit chosen, and its count equal to T its last count.
3. Placing. Glue turns the blocks' counts into each block's first output position (an
   exclusive cumsum of the keys a block keeps: those above T and its share of the first r
   equal to T in slot order) and its quota of ties. A placing pass over the same blocks
   keeps, chunk by chunk, the keys above T and the equal ones whose rank among the row's
   equal keys (a cumsum) is within r, and stores each kept slot at its position (the
   block's first position plus a cumsum of the kept ones): ascending slot order, without
   a sort. Glue writes -1 past the kept count.

Five data passes over [R, S] and five small glue steps, whatever R, S and k. (A variant
that summed the passes' histograms with integer atomics inside the kernels, to spare the
glue between passes, counted nothing on an H100, jax 0.11.2: the atomic adds into the
aliased histogram buffer left it zero; docs/experiments.md.) S need not be
a multiple of a block: the last chunk of a row overlaps its neighbour (no out-of-bounds
loads) and masks the slots the neighbour holds; rows shorter than 16 are padded with -inf.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jspec.kernels import dispatch
from jspec.kernels.tiling import is_pow2, pow2_floor

MIN_SLOTS = 16  # the dot's smallest tile: rows shorter than this are padded with -inf
DIGITS = 256  # 8-bit digits: 4 counting passes
PASSES = 4
INT_MIN = -(2 ** 31)


def _key_of(x: float) -> int:
    bits = int(np.array(x, np.float32).view(np.int32))
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


NEG_INF_KEY = _key_of(-np.inf)  # keys above this and at most POS_INF_KEY: the scores that count
POS_INF_KEY = _key_of(np.inf)


# --------------------------------------------------------------------------- reference

def topk_slots_reference(scores, k: int):
    """scores [..., S] float32 (-inf: never selected) -> [..., k] int32: the slots of the k
    largest scores (lax.top_k: ties to the lowest slots), ascending, -1 padded."""
    _check_k(k)
    S = scores.shape[-1]
    if S < k:  # lax.top_k needs k <= S: the padding is never selected
        scores = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, k - S)], constant_values=-jnp.inf)
    best, top = lax.top_k(scores, k)  # [..., k]
    slots = jnp.sort(jnp.where(best > -jnp.inf, top, S).astype(jnp.int32), axis=-1)
    return jnp.where(slots < S, slots, -1)


# --------------------------------------------------------------------------- kernels

def _keys(x):
    """x [C] float32 -> (int32 keys [C] ordered as the floats, valid [C]: above -inf, not NaN)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ (lax.shift_right_arithmetic(bits, 31) & 0x7FFFFFFF)
    return key, (key > NEG_INF_KEY) & (key <= POS_INF_KEY)


def _chunk_at(k0, chunk: int, num_keys: int, ragged: bool):
    """The chunk of `chunk` slots from k0 -> (its first slot, mask [C] of the slots it owns
    or None): with `ragged`, a chunk past the end moves back to end at num_keys and masks
    the slots before k0 (all of them where k0 >= num_keys)."""
    if not ragged:
        return k0, None
    start = jnp.minimum(k0, num_keys - chunk)
    return start, start + jnp.arange(chunk, dtype=jnp.int32) >= k0


def _count_kernel(x_ref, prefix_ref, o_ref, *, p: int, block: int, chunk: int, num_keys: int, ragged: bool):
    """Pass p of (key block blk, row). x_ref [R, S] float32; prefix_ref [R] int32 (the first
    p digits chosen); o_ref [16, 16] int32: the block's valid keys under the prefix by
    their digit p (high 4 bits, low 4 bits)."""
    blk, row = pl.program_id(0), pl.program_id(1)
    d16 = jnp.arange(16, dtype=jnp.int32)
    prefix = prefix_ref[row] if p else None

    def step(c, acc):
        start, own = _chunk_at(blk * block + c * chunk, chunk, num_keys, ragged)
        key, ok = _keys(x_ref[row, pl.ds(start, chunk)])  # [C]
        if own is not None:
            ok = ok & own
        u = key ^ INT_MIN  # unsigned order as bits
        if p:
            ok = ok & (lax.shift_right_logical(u, 32 - 8 * p) == prefix)
        digit = lax.shift_right_logical(u, 24 - 8 * p) & (DIGITS - 1)
        hi = jnp.where(ok, lax.shift_right_logical(digit, 4), 16)  # 16: counted in no bin
        a = (d16[:, None] == hi[None, :]).astype(jnp.bfloat16)  # [16, C]
        b = ((digit & 15)[:, None] == d16[None, :]).astype(jnp.bfloat16)  # [C, 16]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, block // chunk, step, jnp.zeros((16, 16), jnp.float32))
    o_ref[...] = acc.astype(jnp.int32)


def _place_kernel(x_ref, thr_ref, off_ref, quota_ref, o_ref, *, block: int, chunk: int, num_keys: int, ragged: bool,
                  k: int):
    """The placing pass of (key block blk, row). thr_ref [R] int32: the row's threshold key
    T; off_ref [R, NB]: the block's first output position; quota_ref [R, NB]: how many of
    the block's keys equal to T it keeps (its first ones; <= 0: none); o_ref [R, k] int32
    (whole): the row's kept slots at their positions."""
    blk, row = pl.program_id(0), pl.program_id(1)
    thr, off, quota = thr_ref[row], off_ref[row, blk], quota_ref[row, blk]
    lane = jnp.arange(chunk, dtype=jnp.int32)

    def step(c, carry):
        kept, ties = carry  # kept slots and keys equal to T in the block's earlier chunks
        start, own = _chunk_at(blk * block + c * chunk, chunk, num_keys, ragged)
        key, ok = _keys(x_ref[row, pl.ds(start, chunk)])  # [C]
        if own is not None:
            ok = ok & own
        eq = (ok & (key == thr)).astype(jnp.int32)
        tie_rank = ties + jnp.cumsum(eq)  # 1-based rank among the block's keys equal to T
        keep = (ok & (key > thr)) | ((eq > 0) & (tie_rank <= quota))
        n = keep.astype(jnp.int32)
        pos = off + kept + jnp.cumsum(n) - 1
        plt.store(o_ref.at[row, jnp.where(keep, pos, k)], start + lane, mask=keep)  # scattered; k: past the end
        return kept + jnp.sum(n), ties + jnp.sum(eq)

    lax.fori_loop(0, block // chunk, step, (jnp.int32(0), jnp.int32(0)))


# --------------------------------------------------------------------------- glue

def _pick(hist, r):
    """One pass's histograms [R, NB, 256] and the rank r [R] sought among their keys ->
    (the digit d [R] holding it, the rank within that digit [R], each block's keys with a
    digit above d [R, NB])."""
    tot = jnp.sum(hist, axis=1)  # [R, 256]
    at_least = jnp.flip(jnp.cumsum(jnp.flip(tot, 1), axis=1), 1)  # [R, 256]: keys with digit >= d
    d = jnp.sum((at_least >= r[:, None]).astype(jnp.int32), axis=1) - 1  # r = 0 (no keys): 255, nothing kept
    above = jnp.take_along_axis(at_least - tot, d[:, None], axis=1)[:, 0]
    blocks_above = jnp.sum(jnp.where(jnp.arange(DIGITS, dtype=jnp.int32) > d[:, None, None], hist, 0), axis=2)
    return d, r - above, blocks_above


def _check_k(k) -> None:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be a static int >= 1, got {k!r}")


def _check(scores, k) -> None:
    _check_k(k)
    if getattr(scores, "ndim", 0) < 1 or scores.shape[-1] < 1:
        raise ValueError(f"expected scores [..., S] with S >= 1, got {getattr(scores, 'shape', scores)}")
    if scores.dtype != jnp.float32:
        raise TypeError(f"scores must be float32, got {scores.dtype}")


def is_supported(scores, k) -> bool:
    try:
        _check(scores, k)
    except (TypeError, ValueError):
        return False
    return True


# Rows of more slots than this take the reference where there are more than
# KERNEL_MAX_ROWS_LONG of them: on an H100 (jax 0.11.2, k 2048, benchmarks/deepseek.py dsa --topk)
# the kernels took 320 against 293 us at 128 rows of 16k slots and 851 against 796 at 64k,
# but 159 against 213 at 128 rows of 4k and 297 against 632 at 32 rows of 64k.
KERNEL_MAX_ROWS_LONG = 64
LONG_ROW = 8192


def pays(rows: int, num_keys: int) -> bool:
    """Whether the kernels beat the reference at this size (see KERNEL_MAX_ROWS_LONG)."""
    return rows <= KERNEL_MAX_ROWS_LONG or num_keys <= LONG_ROW


def uses_kernel(scores, k) -> bool:
    """Whether `select` runs the kernels for these arguments (see jspec.kernels.dispatch):
    JSPEC_KERNELS=pallas always, auto where supported and `pays` on a GPU."""
    mode = dispatch.backend()
    if mode == "reference":
        return False
    if mode == "pallas":
        return True
    rows = int(np.prod(scores.shape[:-1]))
    return dispatch.want_pallas(is_supported(scores, k) and pays(rows, scores.shape[-1]))


def select(scores, k: int):
    """Dispatch: the kernels where they run (`uses_kernel`), else the reference."""
    if uses_kernel(scores, k):
        return topk_slots(scores, k)
    return topk_slots_reference(scores, k)


def tiles_for(rows: int, num_keys: int, *, block: int | None = None, chunk: int = 512,
              min_programs: int = 1024) -> tuple[int, int]:
    """(block, chunk) `topk_slots` uses for `rows` rows of `num_keys` (>= 16) slots: chunk
    at most the largest power of two <= num_keys (and <= block); block None: the largest
    power-of-two multiple of chunk that leaves at least min_programs (rows x blocks)
    programs a pass, chunk where even that leaves fewer."""
    for name, v in (("chunk", chunk), ("block", block if block is not None else 16)):
        if not (is_pow2(v) and v >= MIN_SLOTS):
            raise ValueError(f"{name} must be a power of two >= {MIN_SLOTS}, got {v!r}")
    chunk = min(chunk, pow2_floor(num_keys), block or chunk)
    if block is None:
        block = chunk
        while block < num_keys and rows * pl.cdiv(num_keys, 2 * block) >= min_programs:
            block *= 2
    if block > 2 ** 24:  # a block's counts are float32 sums: exact below 2**24
        raise ValueError(f"block {block} > 2**24 slots")
    return block, chunk


def topk_slots(scores, k: int, *, interpret: bool | None = None, block: int | None = None, chunk: int = 512,
               min_programs: int = 1024, num_warps: int = 4, num_stages: int = 2):
    """The kernels for `topk_slots_reference` (same arguments, same result bit for bit).

    Tiles: chunk, the slots a program reads at a time (a power of two >= 16, made at most
    S's largest power of two); block, the slots a program counts and places (a power-of-two
    multiple of chunk; None: `tiles_for`'s choice from min_programs); num_warps,
    num_stages: Triton's. interpret None: interpret mode off the GPU."""
    _check(scores, k)
    lead, S = scores.shape[:-1], scores.shape[-1]
    x = scores.reshape(-1, S)  # [R, S]
    if S < MIN_SLOTS:
        x = jnp.pad(x, ((0, 0), (0, MIN_SLOTS - S)), constant_values=-jnp.inf)
    R, Sp = x.shape
    block, chunk = tiles_for(R, Sp, block=block, chunk=chunk, min_programs=min_programs)
    NB = pl.cdiv(Sp, block)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    params = None
    if not interpret:
        params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    geometry = dict(block=block, chunk=chunk, num_keys=Sp, ragged=Sp % block != 0)
    whole = pl.BlockSpec()

    def count(p, prefix):  # -> [R, NB, 256] int32
        out = pl.pallas_call(
            functools.partial(_count_kernel, p=p, **geometry), grid=(NB, R),
            in_specs=[whole, whole],
            out_specs=pl.BlockSpec((None, None, 16, 16), lambda b, r: (r, b, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((R, NB, 16, 16), jnp.int32),
            interpret=interpret, compiler_params=params, name=f"jspec_dsa_topk_count{p}",
        )(x, prefix)
        return out.reshape(R, NB, DIGITS)

    prefix = jnp.zeros((R,), jnp.int32)
    hist = count(0, prefix)
    valid = jnp.sum(hist, axis=(1, 2))  # [R]
    r = jnp.minimum(valid, k)  # the rank of the threshold: min(k, valid keys)
    kept_total = r
    above = jnp.zeros((R, NB), jnp.int32)  # each block's keys above the threshold
    for p in range(PASSES):
        if p:
            hist = count(p, prefix)
        d, r, blocks_above = _pick(hist, r)
        above = above + blocks_above
        prefix = lax.shift_left(prefix, 8) | d
    thr = prefix ^ INT_MIN  # [R]: the threshold's key (signed order)
    equal = jnp.take_along_axis(hist, d[:, None, None], axis=2)[..., 0]  # [R, NB]: keys equal to it
    quota = r[:, None] - (jnp.cumsum(equal, axis=1) - equal)  # ties a block may keep: r - earlier blocks' ties
    keep = above + jnp.clip(quota, 0, equal)  # [R, NB]
    off = jnp.cumsum(keep, axis=1) - keep
    out = pl.pallas_call(
        functools.partial(_place_kernel, k=k, **geometry), grid=(NB, R),
        in_specs=[whole] * 4, out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((R, k), jnp.int32),
        interpret=interpret, compiler_params=params, name="jspec_dsa_topk_place",
    )(x, thr, off, quota)
    out = jnp.where(jnp.arange(k, dtype=jnp.int32) < kept_total[:, None], out, -1)
    return out.reshape(lead + (k,))
