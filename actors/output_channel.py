"""A replica's outputs for one caller process, batched per engine step.

Streaming every request over its own Serve call costs a Ray message per token per request; at
32 streams on this 2-core machine that overhead took about a quarter of the engine's throughput
(measured: the same requests with only their final output shipped ran 1.2x faster). A caller
(an ingress, the Router, the in-cluster rollout client) instead opens one channel per replica
(`EngineReplica.open_channel`) and submits its requests onto it (`EngineReplica.submit`): each
step's new outputs of all of them travel as one batch of `(request_id, item)` pairs, where the
item is the engine's own delta (`EngineCoreOutput`: what the request gained in the step, the
prompt only on its first) or the exception that ended the request. `router/replica_channels.py`
is the caller's side.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from raylane.actors.engine.request_stream import RequestStream


class ChannelClosed(RuntimeError):
    """The output channel a request was submitted on is not open on this replica."""


class OutputChannel:
    def __init__(self) -> None:
        self.closed = False
        self._items: list[tuple[str, Any]] = []
        self._ready = asyncio.Event()
        self._streams: dict[str, RequestStream] = {}

    @property
    def num_held(self) -> int:
        """Requests admitted on this channel that have not ended."""
        return len(self._streams)

    def start(self, stream: RequestStream) -> None:
        """Forward an admitted request's outputs into this channel until it ends: the engine
        hands each one over as it fans a step out (`RequestStream.forward`), with no task per
        request waking on this replica's event loop."""
        if self.closed:
            stream.close()
            raise ChannelClosed("the output channel closed while the request was admitted")
        self._streams[stream.request_id] = stream
        stream.forward(self._put)

    async def batches(self) -> AsyncIterator[list[tuple[str, Any]]]:
        """Everything forwarded since the last batch, as soon as there is something. Every
        request woken by one engine step is forwarded before this wakes, so a step's outputs
        leave together."""
        while not self.closed:
            await self._ready.wait()
            self._ready.clear()
            items, self._items = self._items, []
            yield items

    def close(self) -> None:
        """Abort every request still running on the channel (its caller is gone) and end
        `batches`."""
        self.closed = True
        self._ready.set()
        for stream in list(self._streams.values()):
            stream.close()
        self._streams.clear()

    def _put(self, request_id: str, item: Any) -> None:
        """`item`: the request's delta, or the exception that ended it (RequestFailed, or the
        step loop died): the caller raises it."""
        self._items.append((request_id, item))
        self._ready.set()
        if isinstance(item, Exception) or item.finished:
            self._streams.pop(request_id, None)
