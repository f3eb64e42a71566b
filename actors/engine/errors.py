"""Engine errors the layers above map to responses (HTTP status, client exceptions)."""

from __future__ import annotations


class EnginePaused(RuntimeError):
    """The engine is paused and its queue of requests waiting for a resume is full (HTTP 503)."""


class RequestFailed(RuntimeError):
    """A step the request was in raised; the engine ended it and serves on (HTTP 500)."""
