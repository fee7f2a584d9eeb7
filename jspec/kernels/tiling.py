"""Powers of two for the kernels' tile sizes (Triton tiles are powers of two)."""
from __future__ import annotations

import numbers


def is_pow2(n) -> bool:
    """Whether n is an integer power of two (1, 2, 4, ...)."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()
