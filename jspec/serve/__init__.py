"""Serving: the continuous-batching engine (`engine.Engine`: scheduler, runner and output
processor wired together), its adaptive speculation (`tiers.Adaptive`) and the
OpenAI-compatible HTTP server (`server`)."""
from jspec.serve.engine import Engine, EngineError, Handle, QueueFull, RequestOutput, static_heap
from jspec.serve.output import Delta
from jspec.serve.tiers import Adaptive

__all__ = ["Adaptive", "Delta", "Engine", "EngineError", "Handle", "QueueFull", "RequestOutput", "static_heap"]
