"""Small integer helpers shared by every layer (imports nothing from jspec)."""
from __future__ import annotations


def cdiv(a, b):
    """Ceiling of a / b for ints (or integer arrays) with b > 0."""
    return -(-a // b)


def round_up(a, b):
    """The smallest multiple of b that is >= a."""
    return cdiv(a, b) * b
