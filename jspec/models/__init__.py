"""Flax modules: the Llama-family target and the draft heads (EAGLE, EAGLE-3)."""
from jspec.models.llama import LlamaModel, Linear, RMSNorm, apply_rope

__all__ = ["LlamaModel", "Linear", "RMSNorm", "apply_rope"]
