"""Driving backend streams for one HTTP request: fan-in, deltas, SSE, and disconnects.

A backend stream is the engine's own deltas (`EngineCoreOutput`): a streamed response turns each
into SSE chunks as it comes (`ChoiceCursor`, `PromptSeen`: O(new tokens) per step, no
cumulative rebuild); only a non-streaming response folds them into cumulative outputs
(`final_outputs`).

Every backend iterator is closed (`aclosing`) when the response ends for any reason — a finished
stream, an error, or a client that went away (Starlette cancels the body iterator; a task waiting
on the backend is cancelled) — so the engine aborts the request and frees its blocks.
"""

from raylane.session_server.streaming.cursor import ChoiceCursor, Delta, PromptSeen
from raylane.session_server.streaming.fan_in import Indexed, start
from raylane.session_server.streaming.response import final_outputs, primed, sse_response

__all__ = [
    "ChoiceCursor",
    "Delta",
    "Indexed",
    "PromptSeen",
    "final_outputs",
    "primed",
    "sse_response",
    "start",
]
