"""An engine replica: one AsyncLLMEngine inside a Ray Serve replica.

The Serve deployment (made in cluster/serve.py) restarts it when `check_health` fails or its
actor dies. It registers with the Router and heartbeats while it can serve, so the Router's
replica table always reflects the replicas that can serve.

At tensor_parallel_size > 1 the replica owns its group of `ModelShard` actors (in the replica's
placement group): a shard that dies fails the requests in flight (the executor raises, the
engine loop fails every waiter), and from then on the heartbeat reports the replica failed and
`check_health` raises, so Serve replaces the replica and, with it, the whole shard group.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.output_channel import ChannelClosed, OutputChannel

logger = logging.getLogger(__name__)


class EngineReplica:
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
        self.engine = AsyncLLMEngine(LLMEngine(EngineConfig(**engine_options)))
        self.replica_id = replica_id or _serve_replica_id()
        self.router = router
        self._heartbeat_s = heartbeat_s
        self._heartbeat_task: asyncio.Task | None = None
        self._channels: dict[str, OutputChannel] = {}

    async def start(self) -> None:
        """Register with the Router and start heartbeating (idempotent)."""
        if self.router is None or self._heartbeat_task is not None:
            return
        await self.router.register.remote(self.replica_id)
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            # a replica whose engine died stops being routed to before Serve replaces it
            try:
                if self._serving():
                    await self.router.heartbeat.remote(
                        self.replica_id, self.engine.weight_version, self.engine.num_requests
                    )
                else:
                    await self.router.report_failure.remote(self.replica_id)
            except Exception as e:  # the Router restarts; keep trying
                logger.warning("heartbeat to the Router failed: %s", e)
            await asyncio.sleep(self._heartbeat_s)

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
        target_replica: str | None = None,
    ) -> AsyncIterator[Any]:
        """A caller's output channel (actors/output_channel.py): first this replica's id (the
        caller learns where the call landed), then per-step batches of the outputs of the
        requests it submits on `channel_id`. Leaving it aborts those still running."""
        channel = OutputChannel()
        self._channels[channel_id] = channel
        try:
            yield self.replica_id
            async for batch in channel.batches():
                yield batch
        finally:
            if self._channels.get(channel_id) is channel:
                del self._channels[channel_id]
            channel.close()

    async def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        channel_id: str,
        target_replica: str | None = None,
    ) -> None:
        """Admit a request whose outputs go out on the caller's open channel `channel_id`. Bad
        input (ValueError) and a paused engine's full queue (EnginePaused) raise here; abort
        it with `abort([request_id])`."""
        channel = self._channels.get(channel_id)
        if channel is None:
            raise ChannelClosed(
                f"no output channel {channel_id!r} is open on replica {self.replica_id}"
            )
        channel.start(await self.engine.add_request(prompt_ids, params, request_id))

    async def stats(self, target_replica: str | None = None) -> dict:
        return self.engine.stats_snapshot()

    # --- the RL control plane (driven by router/control.py, one replica at a time) ------------

    async def pause(self, mode: str, target_replica: str | None = None) -> None:
        await self.engine.pause(mode)

    async def resume(self, target_replica: str | None = None) -> None:
        await self.engine.resume()

    async def weight_version(self, target_replica: str | None = None) -> int:
        return self.engine.weight_version

    async def begin_weight_update(
        self,
        specs: list[dict],
        target_replica: str | None = None,
    ) -> None:
        from raylane.actors.models.weights import TensorSpec

        self.engine.begin_weight_update([TensorSpec.from_dict(d) for d in specs])

    async def load_weight_bucket(self, bucket, target_replica: str | None = None) -> int:
        """`bucket`: safetensors bytes, or `[ObjectRef]` of them (stored once for every
        replica; the list keeps callers in between from fetching it)."""
        if isinstance(bucket, list):
            bucket = await bucket[0]
        return self.engine.load_weight_bucket(bucket)

    async def finish_weight_update(
        self, version: int | None = None, target_replica: str | None = None
    ) -> int:
        return self.engine.finish_weight_update(version)

    async def abort(
        self,
        request_ids: list[str],
        target_replica: str | None = None,
    ) -> list[RequestOutput]:
        return await self.engine.abort(request_ids)

    async def flush_cache(self, target_replica: str | None = None) -> None:
        self.engine.flush_cache()

    async def arm_fault(
        self,
        stage: str,
        times: int = 1,
        target_replica: str | None = None,
    ) -> None:
        """Test hook: this replica's next `times` engine steps raise at `stage`
        (`LLMEngine.arm_fault`); their requests fail, the engine serves on."""
        self.engine.engine.arm_fault(stage, times)

    async def check_health(self) -> None:
        """Serve's health hook: raising makes the controller replace this replica."""
        await self.start()
        self._check_engine()
        # every shard answers a ping: one that died while no request ran is seen here, not by
        # the next request. NOTE: blocks the loop one round trip (~1 ms)
        self.engine.engine.check_health(ping=True)

    def __del__(self) -> None:
        # Serve calls this on a graceful stop: free the shard group now (Serve then removes the
        # placement group, which would also end the shards)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.engine.shutdown()


def _serve_replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id
