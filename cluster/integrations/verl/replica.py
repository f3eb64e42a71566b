"""`RaylaneReplica`: the `RolloutReplica` verl's registry builds for
`actor_rollout_ref.rollout.name=raylane` (imported only once verl is: it subclasses verl's).

raylane runs its own engine replicas and balances requests over them, so verl's replica is a
front to a running cluster: `init_standalone` launches one `ServerActor` (verl's server handle)
and no workers, and verl's modes that share the trainer's processes or GPUs (hybrid,
colocated) are refused. Options come from `engine_kwargs.raylane` (verl's place for a
backend's own): `address` (the cluster's HTTP address, served with `--trainer-api`; without
it the actor runs inside raylane's Ray cluster and reaches it over handles), `api_key`,
`admin_key`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from raylane.integrations.verl.server import ServerActor, ServerDefaults
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

REFUSED = "raylane runs its own engines: use verl's standalone rollout (hybrid_engine=False)"


class RaylaneReplica(RolloutReplica):
    async def init_standalone(self) -> None:
        """No resource pool: the cluster's engines are raylane's (no GPU of verl's used)."""
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def init_hybrid(self, worker_group: Any) -> None:
        raise NotImplementedError(REFUSED)

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        raise NotImplementedError(REFUSED)

    async def init_colocated(self, resource_pool: Any) -> None:
        raise NotImplementedError(REFUSED)

    def get_ray_class_with_init_args(self) -> Any:
        raise NotImplementedError(REFUSED)

    async def launch_servers(self) -> None:
        options = dict(self.config.engine_kwargs.get("raylane") or {})
        address = options.get("address")
        defaults = ServerDefaults.from_rollout_config(self.config, self.replica_rank)
        name = f"raylane_server_{self.replica_rank}_0{self.name_suffix}"
        actor: Any = ray.remote(ServerActor)  # a handle's methods are untyped
        server = actor.options(name=name, num_cpus=0, max_concurrency=self.max_concurrency).remote(
            address, defaults, options.get("api_key"), options.get("admin_key")
        )
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server
        # verl's load balancer keys servers by address: a name where there is no address
        self._server_address = _address(address) if address else name

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        """As verl's vLLM replica: the answer of the server that had the request."""
        answers: list[dict[str, Any]] = await asyncio.gather(
            *(s.abort_request.remote(request_id) for s in self.servers)
        )
        return next((a for a in answers if a["aborted"]), answers[0])


def _address(url: str) -> str:
    """host:port, as verl's replicas give theirs."""
    return url.split("//", 1)[-1].rstrip("/")
