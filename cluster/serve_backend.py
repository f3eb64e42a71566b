"""The HTTP layer's `EngineBackend` over the Router actor and the Serve engine replicas."""

from __future__ import annotations

import asyncio

from actors.engine.sampling_params import SamplingParams
from session_server.backend import ModelInfo, QueueFull, ReplicaFailed


class ServeBackend:
    """Ask the Router for a replica, then stream from that replica directly."""

    def __init__(self, replicas, router, tokenizer, info: ModelInfo):
        self.replicas = replicas  # DeploymentHandle of the engine replicas
        self.router = router
        self.tokenizer = tokenizer
        self.info = info

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       routing_key: str | None = None):
        replica_id = await self._choose(routing_key)
        stream = self.replicas.options(stream=True).generate.remote(
            prompt_ids, params, request_id, target_replica=replica_id)
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield out
        except ValueError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            cause = _user_error(e)
            if cause is not None:
                raise cause from None
            self.router.report_failure.remote(replica_id)
            raise ReplicaFailed(f"engine replica failed while serving the request: "
                                f"{type(e).__name__}") from e
        finally:
            if not finished:
                stream.cancel()  # aborts the request on the replica, freeing its blocks
            self.router.done.remote(replica_id)

    async def _choose(self, routing_key: str | None) -> str:
        replica_id = await self.router.choose.remote(routing_key)
        if replica_id is None:
            if not await self.router.ready.remote():
                raise ReplicaFailed("no engine replica is ready")
            raise QueueFull(retry_after=1.0)
        return replica_id

    async def ready(self) -> bool:
        return await self.router.ready.remote()

    async def stats(self) -> list[dict]:
        ids = [r["replica_id"] for r in await self.router.replicas.remote() if r["healthy"]]
        calls = [self.replicas.stats.remote(target_replica=rid) for rid in ids]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]


def _user_error(error: Exception) -> ValueError | None:
    """A ValueError raised in the replica (bad input) arrives wrapped; unwrap it."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    return None
