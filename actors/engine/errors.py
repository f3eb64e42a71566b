"""Engine errors the layers above map to responses (HTTP status, client exceptions)."""

from __future__ import annotations


class EnginePaused(RuntimeError):
    """The engine is paused and its queue of requests waiting for a resume is full (HTTP 503)."""


class RequestFailed(RuntimeError):
    """A step the request was in raised; the engine ended it and serves on (HTTP 500)."""


class WeightTransferFailed(RuntimeError):
    """Receiving over the trainer's group failed (the trainer left, a timeout): the update was
    rolled back on every rank, which left their groups (the trainer must init one again)."""
