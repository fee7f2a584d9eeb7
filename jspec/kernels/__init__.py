"""Kernels, each beside its pure-jnp reference, with one dispatch point per operation."""
from jspec.kernels.attention import attend, attention_reference

__all__ = ["attend", "attention_reference"]
