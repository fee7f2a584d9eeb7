"""Serving: the continuous-batching engine (`engine.Engine`) and its adaptive speculation
(`tiers.Adaptive`)."""
from jspec.serve.engine import Engine, Handle, QueueFull, RequestOutput
from jspec.serve.tiers import Adaptive

__all__ = ["Adaptive", "Engine", "Handle", "QueueFull", "RequestOutput"]
