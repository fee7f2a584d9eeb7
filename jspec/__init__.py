"""jspec: speculative decoding for LLMs in JAX/XLA.

    params = jspec.load(target_dir, draft=draft_dir)         # or draft="ngram": prompt lookup
    out = jspec.generate(params, "def fib(n):", max_new_tokens=64)
    prog = jspec.compile(params, prompts, max_new_tokens=64)   # compile once, run many times
    out = prog.run(other_prompts)
    out = jspec.generate(params, prompt, constraint=jspec.JsonSchema(schema))   # structured output
    for chunk in jspec.stream(params, "def fib(n):"):          # tokens and text as rounds commit
        print(chunk.text, end="")
"""
from jspec.config import CacheConfig, ModelConfig, SpecConfig
from jspec.constraints import Choice, Json, JsonSchema, Regex
from jspec.tuning import Tuning
from jspec.api import (Compiled, GenerateOutput, SpecStats, calibrate_kv_scales, clear_caches, compile, generate,
                       logits, stream)
from jspec.drafts import DFlashDraft, Draft, Eagle3Draft, EagleDraft, MtpDraft, StandaloneDraft
from jspec.loading import load, load_draft, shard
from jspec.loop.proposers.ngram import NgramDraft
from jspec.params import DraftParams, Params
from jspec.results import TokenLogprob
from jspec.serve import Adaptive, Delta, Engine, EngineError, QueueFull, RequestOutput
from jspec.streaming import StreamChunk

__version__ = "0.1.0"

__all__ = ["Adaptive", "CacheConfig", "Choice", "Compiled", "DFlashDraft", "Delta", "Draft", "DraftParams", "Eagle3Draft", "EagleDraft", "Engine",
           "EngineError", "GenerateOutput", "Json", "JsonSchema", "ModelConfig", "MtpDraft", "NgramDraft", "Params", "QueueFull", "RequestOutput",
           "Regex", "SpecConfig", "SpecStats", "StandaloneDraft", "StreamChunk", "TokenLogprob", "Tuning", "clear_caches",
           "calibrate_kv_scales", "compile", "generate", "load", "load_draft", "logits", "shard", "stream"]
