"""verl's rollout contract over raylane: `RaylaneRolloutServer` is the server handle verl's agent
loop calls (`generate(prompt_ids, sampling_params, request_id, ...)` -> token ids, log probs,
routed experts, stop reason; `wake_up`, `sleep`, `clear_kv_cache`, `abort_all_requests`,
`resume`), and `RaylaneReplica` the `RolloutReplica` verl's registry builds for
`actor_rollout_ref.rollout.name=raylane` (registered on import when verl is importable).

>>> server = RaylaneRolloutServer.in_cluster()   # inside the Ray cluster raylane serves
>>> out = await server.generate([1, 2, 3], {"temperature": 1.0, "logprobs": True}, "req-0")
>>> out.token_ids, out.log_probs, out.stop_reason
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from raylane.client import RolloutClient
from raylane.session_server.backend import ControlBackend

log = logging.getLogger(__name__)

# raylane's finish reasons as verl's stop reasons ("completed", "aborted"; None: unknown)
STOP_REASONS = {"stop": "completed", "length": "completed", "abort": "aborted", "stale": "aborted"}


@dataclass
class TokenOutput:
    """verl's `TokenOutput` fields, for when verl is not installed (else its own class)."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None  # int32 [prompt + output - 1, moe_layers, top_k]
    stop_reason: str | None = None
    num_preempted: int | None = None


class RaylaneRolloutServer:
    """The calls verl makes on a rollout server, over a `RolloutClient` (generation) and a
    `ControlBackend` (pause, sleep, aborts: the Router's control plane, or an in-process one).
    `max_tokens`: what a request without its own may generate (verl's response length)."""

    def __init__(self, client: RolloutClient, control: ControlBackend, max_tokens: int | None):
        self.client = client
        self.control = control
        self.max_tokens = max_tokens

    @classmethod
    def in_cluster(cls, max_tokens: int | None = None) -> RaylaneRolloutServer:
        """Over Ray handles, inside the cluster `raylane serve` runs."""
        import ray
        from raylane.router.actor import NAMESPACE, ROUTER_NAME
        from raylane.serve_backend import router_control

        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        return cls(RolloutClient.in_cluster(), router_control(router), max_tokens)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        priority: int = 0,
        **_: Any,
    ) -> Any:
        """One sample of `prompt_ids`. verl's `logprobs` (a switch) returns each token's raw
        logprob; other fields are `SamplingParams`' (vLLM's names)."""
        if image_data is not None or video_data is not None:
            raise ValueError("image_data / video_data: multimodal prompts are not served here")
        params = dict(sampling_params)
        wants_logprobs = bool(params.pop("logprobs", False))
        params.setdefault("max_tokens", params.pop("max_new_tokens", self.max_tokens))
        (out,) = await self.client.generate(
            list(prompt_ids),
            request_id=request_id,
            logprobs=0 if wants_logprobs else None,
            **params,
        )
        return token_output(
            token_ids=list(out.token_ids),
            log_probs=list(out.logprobs) if wants_logprobs and out.logprobs is not None else None,
            routed_experts=out.routed_experts,
            stop_reason=STOP_REASONS.get(out.finish_reason or ""),
        )

    async def wake_up(self) -> None:
        await self.control.wake_up(None)

    async def sleep(self) -> None:
        await self.control.sleep(1)

    async def clear_kv_cache(self) -> None:
        await self.control.flush_cache()

    async def abort_all_requests(self) -> None:
        await self.control.abort(None)

    async def abort_request(self, request_id: str) -> None:
        await self.control.abort([request_id])

    async def pause(self, mode: str = "keep") -> None:
        await self.control.pause(mode)

    async def resume(self) -> None:
        await self.control.resume()


def token_output(**fields: Any) -> Any:
    """verl's own `TokenOutput` when verl imports, else the stand-in with the same fields."""
    try:
        from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput
    except ImportError:
        return TokenOutput(**fields)
    return VerlTokenOutput(**fields)


def register() -> bool:
    """Register `RaylaneReplica` with verl's `RolloutReplicaRegistry` as "raylane"; False when
    verl is not importable."""
    try:
        from verl.workers.rollout.replica import RolloutReplicaRegistry
    except ImportError:
        return False
    RolloutReplicaRegistry.register("raylane", _replica_class)
    return True


def _replica_class() -> type:
    from verl.workers.rollout.replica import RolloutReplica

    class RaylaneReplica(RolloutReplica):
        """A verl replica served by raylane: the cluster is already running (standalone),
        so launching it starts one server actor over the cluster's Router."""

        def get_ray_class_with_init_args(self):
            raise NotImplementedError("raylane runs its own replicas: use standalone mode")

        async def launch_servers(self) -> None:
            import ray

            actor = ray.remote(num_cpus=0)(InClusterServer)
            handle = actor.remote(self.config.response_length)
            self.servers = [handle]
            self._server_handle = handle
            self._server_address = None  # token in / token out only

    return RaylaneReplica


class InClusterServer(RaylaneRolloutServer):
    """The server as a Ray actor of its own, connected to the cluster it runs in."""

    def __init__(self, max_tokens: int | None = None):
        built = RaylaneRolloutServer.in_cluster(max_tokens)
        super().__init__(built.client, built.control, max_tokens)


register()
