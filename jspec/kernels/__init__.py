"""Kernels, each beside its pure-jnp reference, with one dispatch point per operation."""
from jspec.kernels.attention import attention, attention_reference

__all__ = ["attention", "attention_reference"]
