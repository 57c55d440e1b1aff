"""``seqlab serve``: an OpenAI-compatible HTTP server over a continuous-batching engine.

``scheduler`` (the engine: slots, chunked prefill, per-request sampling) needs only torch; ``app`` and ``server``
need the optional ``serve`` extra (starlette, uvicorn) and are imported by whoever starts a server.
"""
from seqlab.serve.scheduler import Engine, Event, QueueFullError, Request

__all__ = ["Engine", "Event", "QueueFullError", "Request"]
