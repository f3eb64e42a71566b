"""The caller's side of the replicas' output channels (actors/output_channel.py): one channel per
engine replica per process, opened on first use and shared by every request this process sends
there, so a step's outputs arrive as one Ray message instead of one per request.

`ReplicaChannels.stream` is one request on one replica: submit it on the replica's channel, then
rebuild its cumulative outputs from the deltas the channel delivers. Leaving early aborts it on
the replica. When a channel's call fails (the replica died), every request on it raises. A
channel idle for `IDLE_CLOSE_S` is closed, so a replica being stopped is not kept waiting.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from raylane.actors.engine.output_delta import DeltaDecoder
from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.replica_calls import HandleCalls, unwrapped

# a channel with no request for this long is closed: it is an ongoing request on its replica,
# and Serve waits for those (up to its graceful-shutdown timeout) before stopping a replica
IDLE_CLOSE_S = 2.0


class ChannelLost(RuntimeError):
    """The channel's call to its replica ended: the replica died or was replaced."""


class ReplicaChannels:
    def __init__(self, handle: Any) -> None:
        self.handle = handle  # the engine deployment's DeploymentHandle
        self._calls = HandleCalls(handle)
        self._channels: dict[str, asyncio.Task] = {}  # chosen replica id -> its _Channel
        self._loop: asyncio.AbstractEventLoop | None = None

    async def stream(
        self, replica_id: str, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request on `replica_id` (where the deployment's request
        router sends it: another replica if that one is gone). A ValueError (bad input),
        EnginePaused or RequestFailed raised there arrives as itself."""
        channel = await self._channel(replica_id)
        queue = channel.subscribe(request_id)
        finished = submitted = False
        try:
            await self._calls(
                channel.replica_id, "submit", prompt_ids, params, request_id, channel.id
            )
            submitted = True
            decoder = DeltaDecoder()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                out = decoder.decode(item)
                finished = out.finished
                yield out
        finally:
            channel.unsubscribe(request_id)
            if submitted and not finished and not channel.lost:
                self.handle.abort.remote([request_id], target_replica=channel.replica_id)

    async def _channel(self, replica_id: str) -> _Channel:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # channels (and their tasks) belong to one event loop
            self._loop, self._channels = loop, {}
        opening = self._channels.get(replica_id)
        if opening is None or (
            opening.done()
            and (opening.cancelled() or opening.exception() is not None or opening.result().lost)
        ):
            # its own task: a request that leaves while it opens does not cancel it for others
            opening = loop.create_task(_Channel.open(self.handle, replica_id))
            self._channels[replica_id] = opening
        channel = await asyncio.shield(opening)
        if channel.replica_id != replica_id:
            # the request router sent it elsewhere (the target is gone, or this handle does not
            # know it yet): serve this request there, but file the channel under the replica it
            # reached, so the next request for `replica_id` tries that replica again
            if self._channels.get(replica_id) is opening:
                del self._channels[replica_id]
            self._channels.setdefault(channel.replica_id, opening)
        return channel


class _Channel:
    def __init__(self, channel_id: str, replica_id: str) -> None:
        self.id = channel_id
        self.replica_id = replica_id  # where the call landed
        self.lost = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._idle: asyncio.TimerHandle | None = None

    @classmethod
    async def open(cls, handle: Any, replica_id: str) -> _Channel:
        channel_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        stream = handle.options(stream=True).open_channel.remote(
            channel_id, target_replica=replica_id
        )
        try:
            landed = await stream.__anext__()  # the replica's id
        except Exception as e:
            stream.cancel()
            raise unwrapped(e) from None
        channel = cls(channel_id, landed)
        channel._task = asyncio.get_running_loop().create_task(channel._pump(stream))
        return channel

    def subscribe(self, request_id: str) -> asyncio.Queue:
        if self.lost:
            raise ChannelLost(f"the output channel to replica {self.replica_id} is lost")
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        if not self._queues and not self.lost and self._idle is None:
            self._idle = asyncio.get_running_loop().call_later(IDLE_CLOSE_S, self._close_idle)

    def _close_idle(self) -> None:
        self._idle = None
        if not self._queues:
            self.lost = True  # the next request opens a new one
            self._task.cancel()

    async def _pump(self, stream: Any) -> None:
        error: BaseException = ChannelLost(f"replica {self.replica_id} closed the output channel")
        try:
            async for batch in stream:
                for request_id, item in batch:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:
            error = ChannelLost(
                f"the output channel to replica {self.replica_id} failed: {type(e).__name__}: {e}"
            )
        finally:
            self.lost = True
            for queue in self._queues.values():
                queue.put_nowait(error)
