"""Serving: the continuous-batching engine (`engine.Engine`)."""
from jspec.serve.engine import Engine, Handle, QueueFull, RequestOutput

__all__ = ["Engine", "Handle", "QueueFull", "RequestOutput"]
