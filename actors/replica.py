"""An engine replica: one AsyncLLMEngine in a plain Ray actor that the Router creates and owns
(router/replica_set.py), and replaces when `check_health` fails or the actor dies. It registers
with the Router and heartbeats while it can serve, so the Router's replica table always reflects
the replicas that can serve. Callers reach it through its actor handle, which the Router's table
carries.

At tensor_parallel_size > 1 the replica owns its group of `ModelShard` actors (in the replica's
placement group): a shard that dies fails the requests in flight (the executor raises, the
engine loop fails every waiter), and from then on the heartbeat reports the replica failed and
`check_health` raises, so the Router replaces the replica and, with it, the whole shard group.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.leases import LEASE_S, LeaseTable
from raylane.actors.output_channel import ChannelClosed, OutputChannel
from raylane.actors.replica_control import ReplicaControl
from raylane.actors.replica_lora import adapter

logger = logging.getLogger(__name__)

# a caller renews its open channels (router/replica_channels.py, actors/leases.py); one not
# renewed for this long is closed and its requests aborted: its caller died (Ray does not end an
# actor call whose caller is gone)
CHANNEL_LEASE_S = LEASE_S


class EngineReplica(ReplicaControl):
    """An engine in a Ray actor: its output channels and requests here, its control verbs
    those of `ReplicaControl` (driven by router/control.py, one replica at a time)."""

    def __init__(
        self,
        engine_options: dict,
        router=None,
        torch_threads: int | None = None,
        replica_id: str | None = None,
        heartbeat_s: float = 1.0,
    ):
        import torch
        from raylane.actors.engine.async_engine import AsyncLLMEngine
        from raylane.actors.engine.config import EngineConfig
        from raylane.actors.engine.llm_engine import LLMEngine

        if torch_threads:
            torch.set_num_threads(torch_threads)
        options = dict(engine_options)
        self._lora_modules = options.pop("lora_modules", [])  # loaded by `start`
        super().__init__(AsyncLLMEngine(LLMEngine(EngineConfig(**options))))
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.router = router
        self._heartbeat_s = heartbeat_s
        self._heartbeat_task: asyncio.Task | None = None
        self._channels: dict[str, OutputChannel] = {}
        self._leases = LeaseTable()  # the open channels' leases, by channel id
        self._admitted = 0  # requests submitted since start (the Router's "routed" count)

    async def start(self) -> None:
        """Register with the Router and start heartbeating (idempotent)."""
        modules, self._lora_modules = self._lora_modules, []
        await self.load_lora_modules(modules)  # before it serves: `--lora-modules`
        if self.router is None or self._heartbeat_task is not None:
            return
        await self.router.admit.remote(self.replica_id)  # the cluster's adapters, registered
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            # a replica whose engine died stops being routed to before the Router replaces it
            try:
                if self._serving():
                    await self.router.heartbeat.remote(
                        self.replica_id,
                        self.engine.weight_version,
                        self.engine.num_requests,
                        self._admitted,
                        {cid: ch.num_held for cid, ch in self._channels.items() if ch.num_held},
                        self._adapters_in_slots(),
                        self._lora_versions(),
                    )
                else:
                    await self.router.report_failure.remote(self.replica_id)
            except Exception as e:  # the Router restarts; keep trying
                logger.warning("heartbeat to the Router failed: %s", e)
            self.close_lapsed_channels()
            await asyncio.sleep(self._heartbeat_s)

    def _adapters_in_slots(self) -> list[str] | None:
        """The LoRA adapters this engine holds in a slot (None without LoRA): the Router
        prefers a replica that holds a request's adapter among equally loaded ones."""
        if not self.engine.engine.config.enable_lora:
            return None
        return [a.name for a in self._loras.list_loras() if a.loaded]

    def _lora_versions(self) -> dict[str, list[int]] | None:
        """Per adapter, the versions this engine holds (None without LoRA): the Router sends a
        request that asks for a version where it is held."""
        if not self.engine.engine.config.enable_lora:
            return None
        return self.engine.engine.loras.held_versions()

    def _serving(self) -> bool:
        try:
            self._check_engine()
        except RuntimeError:  # ExecutorError is one
            return False
        return True

    def _check_engine(self) -> None:
        """Raise when the step loop died or the runners are down (no remote call)."""
        self.engine.check_health()
        self.engine.engine.check_health(ping=False)

    async def open_channel(
        self,
        channel_id: str,
    ) -> AsyncIterator[Any]:
        """A caller's output channel (actors/output_channel.py): first this replica's id (the
        caller learns where the call landed), then per-step batches of the outputs of the
        requests it submits on `channel_id`. Leaving it aborts those still running."""
        channel = OutputChannel()
        self._channels[channel_id] = channel
        self._leases.grant(channel_id)
        try:
            yield self.replica_id
            async for batch in channel.batches():
                yield batch
        finally:
            if self._channels.get(channel_id) is channel:
                del self._channels[channel_id]
                self._leases.drop(channel_id)
            channel.close()

    async def renew(self, channel_ids: list[str]) -> None:
        """The caller of these channels is alive (see CHANNEL_LEASE_S)."""
        self._leases.renew(channel_ids)

    def close_lapsed_channels(self, lease_s: float = CHANNEL_LEASE_S) -> None:
        """Close the channels whose caller stopped renewing them, aborting their requests."""
        for channel_id in self._leases.lapsed(lease_s):
            logger.warning("output channel %s lapsed: its caller is gone", channel_id)
            self._leases.drop(channel_id)
            self._channels[channel_id].close()

    async def submit(
        self,
        prompt_ids: list[int] | str,  # text: the engine tokenizes it
        params: SamplingParams,
        request_id: str,
        channel_id: str,
        lora: str | None = None,  # the adapter's name (None: the base model)
    ) -> None:
        """Admit a request whose outputs go out on the caller's open channel `channel_id`. Bad
        input (ValueError) and a paused engine's full queue (EnginePaused) raise here; abort
        it with `abort([request_id])`."""
        channel = self._channels.get(channel_id)
        if channel is None:
            raise ChannelClosed(
                f"no output channel {channel_id!r} is open on replica {self.replica_id}"
            )
        stream = await self.engine.add_request(prompt_ids, params, request_id, **adapter(lora))
        channel.start(stream)
        self._admitted += 1

    async def stats(self) -> dict:
        return self.engine.stats_snapshot()

    async def check_health(self) -> None:
        """The Router's health check: raising makes it replace this replica."""
        await self.start()
        self._check_engine()
        # every shard answers a ping: one that died while no request ran is seen here, not by
        # the next request. NOTE: blocks the loop one round trip (~1 ms)
        self.engine.engine.check_health(ping=True)

    def __del__(self) -> None:
        # a graceful stop: free the shard group now (the Router then removes the placement
        # group, which would also end the shards)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.engine.shutdown()
