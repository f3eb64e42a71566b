"""The caller's side of the replicas' output channels (actors/output_channel.py): one channel per
engine replica per process, opened on first use and shared by every request this process sends
there, so a step's outputs arrive as one Ray message instead of one per request.

`ReplicaChannels.stream` is one request on one replica: submit it on the replica's channel, then
yield the engine's deltas (`EngineCoreOutput`) as the channel delivers them. Leaving early aborts
it on the replica. When a channel's call fails (the replica died), every request on it raises. A
channel idle for `IDLE_CLOSE_S` is closed, so a replica being stopped is not kept waiting.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from raylane.actors.engine.outputs import EngineCoreOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.leases import RENEW_S, LeaseRenewals
from raylane.actors.output_channel import ChannelClosed
from raylane.router.errors import unwrapped

# a channel with no request for this long is closed (it holds a call open on its replica); long
# enough that a steady trickle of requests reuses it instead of opening one per request
IDLE_CLOSE_S = 30.0


class ChannelLost(RuntimeError):
    """The channel's call to its replica ended: the replica died or was replaced."""


class ChannelLapsed(ChannelLost):
    """The replica closed the channel because this process stopped renewing it (its event loop
    did not run for the replica's lease): the replica is fine, the requests on it are aborted."""


class ReplicaChannels:
    def __init__(self) -> None:
        self._channels: dict[str, asyncio.Task] = {}  # replica id -> its _Channel
        self._loop: asyncio.AbstractEventLoop | None = None
        # one loop tells every replica this process has a channel to that it is alive; a
        # replica closes a channel not renewed within its CHANNEL_LEASE_S (actors/replica.py)
        self._leases = LeaseRenewals(RENEW_S)

    async def stream(
        self,
        replica_id: str,
        handle: Any,
        prompt_ids: list[int] | str,  # text: the engine tokenizes it
        params: SamplingParams,
        request_id: str,
        lora: str | None = None,  # the adapter's name (None: the base model)
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """The engine's deltas for one request on replica `replica_id` (`handle`: its actor
        handle). A ValueError (bad input), EnginePaused or RequestFailed raised there arrives
        as itself."""
        submit = (prompt_ids, params, request_id, lora)
        channel, queue = await self._submit(replica_id, handle, *submit)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            channel.unsubscribe(request_id)
            if not finished and not channel.lost:
                handle.abort.remote([request_id])

    async def _submit(
        self,
        replica_id: str,
        handle: Any,
        prompt_ids: list[int] | str,
        params: SamplingParams,
        request_id: str,
        lora: str | None = None,
    ) -> tuple[_Channel, asyncio.Queue]:
        """Submit the request on this process's channel to the replica: the channel and the
        request's queue on it. A channel the replica closed before this process noticed (its
        lease lapsed: this process's event loop did not run for `CHANNEL_LEASE_S`, e.g. a
        trainer's `run_until_complete` between batches) is opened again, once; the replica
        admitted nothing on it."""
        channel = await self._channel(replica_id, handle)
        try:
            return channel, await _submitted(channel, handle, prompt_ids, params, request_id, lora)
        except ChannelClosed:
            channel.drop(_lapsed(replica_id))  # so did any other request still on it
        channel = await self._channel(replica_id, handle)
        return channel, await _submitted(channel, handle, prompt_ids, params, request_id, lora)

    def channel_id(self, replica_id: str) -> str | None:
        """The id of the open channel to `replica_id`, if there is one."""
        channel = _opened(self._channels.get(replica_id))
        return None if channel is None else channel.id

    async def _channel(self, replica_id: str, handle: Any) -> _Channel:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # channels (and their tasks) belong to one event loop
            self._loop, self._channels = loop, {}
            self._leases = LeaseRenewals(self._leases.renew_s)
        opening = self._channels.get(replica_id)
        if opening is None or (opening.done() and _opened(opening) is None):
            # its own task: a request that leaves while it opens does not cancel it for others
            opening = loop.create_task(_Channel.open(handle, replica_id, self._leases))
            self._channels[replica_id] = opening
        return await asyncio.shield(opening)


async def _submitted(
    channel: _Channel,
    handle: Any,
    prompt_ids: list[int] | str,
    params: SamplingParams,
    request_id: str,
    lora: str | None = None,
) -> asyncio.Queue:
    """Submit the request on `channel`: its queue there. What the replica raised arrives as
    itself; a failed or cancelled submit leaves no queue behind."""
    queue = channel.subscribe(request_id)
    try:
        on = () if lora is None else (lora,)  # the base model: the verb's plain form
        await handle.submit.remote(prompt_ids, params, request_id, channel.id, *on)
    except BaseException as e:
        channel.unsubscribe(request_id)
        raise (unwrapped(e) if isinstance(e, Exception) else e) from None
    return queue


def _opened(opening: asyncio.Task | None) -> _Channel | None:
    """The channel `opening` opened, while it is open (None: still opening, failed or lost)."""
    if opening is None or not opening.done() or opening.cancelled():
        return None
    if opening.exception() is not None or opening.result().lost:
        return None
    return opening.result()


class _Channel:
    def __init__(self, channel_id: str, replica_id: str) -> None:
        self.id = channel_id
        self.replica_id = replica_id
        self.lost = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._leases: LeaseRenewals | None = None  # renewing this channel's lease while open
        self._dropped: ChannelLost | None = None  # why `drop` closed it, if it said

    @classmethod
    async def open(cls, handle: Any, replica_id: str, leases: LeaseRenewals) -> _Channel:
        channel_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        stream = handle.open_channel.options(num_returns="streaming").remote(channel_id)
        try:
            await (await stream.__anext__())  # the replica's id: the channel is open
        except Exception as e:
            _cancel(stream)
            raise unwrapped(e) from None
        channel = cls(channel_id, replica_id)
        loop = asyncio.get_running_loop()
        channel._task = loop.create_task(channel._pump(stream))
        channel._leases = leases
        leases.hold(channel_id, replica_id, lambda ids: handle.renew.remote(ids))
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
            self.drop()

    def drop(self, why: ChannelLost | None = None) -> None:
        """Stop using this channel (the next request opens a new one) and close it; requests
        still on it fail with `why`."""
        self.lost = True
        self._dropped = why
        if self._task is not None:
            self._task.cancel()

    async def _pump(self, stream: Any) -> None:
        error: BaseException = ChannelLost(f"the output channel to replica {self.replica_id} ended")
        try:
            async for ref in stream:
                for request_id, item in await ref:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
            # the call ends without an error only when the replica closed the channel by lease
            error = _lapsed(self.replica_id)
        except asyncio.CancelledError:
            _cancel(stream)
            error = self._dropped or error
            raise
        except Exception as e:
            error = ChannelLost(
                f"the output channel to replica {self.replica_id} failed: {type(e).__name__}: {e}"
            )
        finally:
            self.lost = True
            if self._leases is not None:
                self._leases.release(self.id)
            for queue in self._queues.values():
                queue.put_nowait(error)


def _lapsed(replica_id: str) -> ChannelLapsed:
    return ChannelLapsed(
        f"replica {replica_id} closed the output channel: this process did not renew it in "
        f"time (was its event loop blocked?)"
    )


def _cancel(stream: Any) -> None:
    import ray

    ray.cancel(stream)  # ends the replica's open_channel call, which closes the channel there
