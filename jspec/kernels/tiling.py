"""What the kernels share about tiles: powers of two (Triton tiles are powers of two), the
last chunk of an axis that a tile does not divide, the dtypes the kernels take, and sums
in a fixed order (row-invariant numerics)."""
from __future__ import annotations

import math
import numbers
import operator

import jax.numpy as jnp
from jax import lax

KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # the array dtypes the Pallas kernels take


def wraps_triton_offsets(a) -> bool:
    """Whether Pallas' Triton lowering would index array `a` with wrapping offsets: it
    computes element offsets in signed 32-bit integers for arrays of at most 2^32 bytes
    (64-bit above; jax 0.10-0.11), so an array of 1-byte elements (FP8) with more than 2^31
    elements (and at most 2^32) reads the wrong place past element 2^31 - 1. Found on an
    H200: DeepSeek-V3's 256 FP8 down experts [256, 2048, 7168] gave NaN (docs/benchmarks.md).
    The expert and attention kernels refuse such arrays (their dispatch takes another path);
    the grouped kernel reads FP8 ones as uint16 pairs (`grouped.pair_view`)."""
    n = math.prod(getattr(a, "shape", ()))
    return n > 2 ** 31 and n * jnp.dtype(a.dtype).itemsize <= 2 ** 32


def is_pow2(n) -> bool:
    """Whether n is an integer power of two (1, 2, 4, ...)."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()


def half_factor(*tiles, top=None):
    """The power of two [..., 1] float32 (1 for rows under 2^15, as activations and queries
    are) that brings each row's largest magnitude over the tiles [..., *] under 2^15, so
    the rows divided by it convert to float16 without overflow: a bfloat16 value in
    float16's normal range converts exactly, smaller ones (under 2^-14 of the factor) keep
    fewer bits. Kernels that widen FP8 to float16 (one instruction; to bfloat16 several)
    multiply bfloat16 operands in float16 this way and their sums back by the factor.
    top: the rows' largest magnitudes [..., 1] float32 instead of the tiles.

    The rule, from the float32 bits of the largest magnitude (exponent e, biased E = e +
    127): 2^max(e - 14, 0), built as the bits max(E - 141, 0) + 127 << 23 (exact; no log2,
    which XLA may round the wrong way next to a power of two)."""
    if top is None:
        top = jnp.max(jnp.abs(tiles[0].astype(jnp.float32)), axis=-1, keepdims=True)
        for t in tiles[1:]:
            top = jnp.maximum(top, jnp.max(jnp.abs(t.astype(jnp.float32)), axis=-1, keepdims=True))
    biased = lax.shift_right_logical(lax.bitcast_convert_type(top.astype(jnp.float32), jnp.int32), 23) & 0xFF
    return lax.bitcast_convert_type(lax.shift_left(jnp.maximum(biased - 141, 0) + 127, 23), jnp.float32)


def chunk_start(c, size: int, total: int):
    """Chunk c of `size` along an axis of `total` -> (its first index, mask [size] of the
    indices no earlier chunk took, or None when `size` divides `total`): the last chunk
    overlaps its neighbour instead of running past the end (no out-of-bounds loads)."""
    k0 = c * size
    if total % size == 0:
        return k0, None
    kc = jnp.minimum(k0, total - size)
    return kc, kc + jnp.arange(size, dtype=jnp.int32) >= k0


def in_order_fold(n: int, term, zero, unroll: int, combine=operator.add):
    """Inside a kernel: combine(... combine(combine(zero, term(0)), term(1)) ..., term(n - 1)),
    in that order; written out when n <= unroll (the terms' loads issue together), else a
    loop (the same operations in the same order: the same bits)."""
    if n <= unroll:
        acc = zero
        for i in range(n):
            acc = combine(acc, term(jnp.int32(i)))
        return acc
    return lax.fori_loop(0, n, lambda i, acc: combine(acc, term(i)), zero)


def in_order_sum(parts):
    """parts [S, ...] -> their sum, added in split order, elementwise (XLA's reduction
    over S picks its order by the shape, so a row's sum could change with the number of
    rows: `Tuning.row_invariant`)."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total
