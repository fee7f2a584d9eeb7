"""jspec: speculative decoding for LLMs in JAX/XLA.

    params = jspec.load(target_dir, draft=draft_dir)
    out = jspec.generate(params, "def fib(n):", max_new_tokens=64)
"""
from jspec.config import CacheConfig, DraftConfig, ModelConfig, SpecConfig
from jspec.api import GenerateOutput, SpecStats, generate, logits
from jspec.loading import DraftParams, Params, load

__version__ = "0.1.0"

__all__ = ["CacheConfig", "DraftConfig", "DraftParams", "GenerateOutput", "ModelConfig", "Params",
           "SpecConfig", "SpecStats", "generate", "load", "logits"]
