"""`RaylaneRolloutServer`: the rollout server verl's agent loop and replicas call, over a
`RolloutClient` (generation) and a `Control` (pause, sleep, aborts), answering what verl's own
vLLM server answers (verl 0.9's `vLLMHttpServer`): its `TokenOutput`, its abort summaries, its
parking of requests while generation is aborted for a weight sync."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from raylane.client import RolloutClient
from raylane.integrations.verl.control import Control, PlaneControl, RoutesControl

# raylane's finish reasons as verl's stop reasons ("completed", "aborted"; None: unknown)
STOP_REASONS = {"stop": "completed", "length": "completed", "abort": "aborted", "stale": "aborted"}


@dataclass(frozen=True)
class ServerDefaults:
    """What verl's `RolloutConfig` sets for every request a server takes."""

    response_length: int | None = None  # max_tokens of a request that gives none
    prompt_length: int | None = None  # with response_length: a multi-turn request's budget
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    routed_experts: bool = False  # enable_rollout_routing_replay
    seed: int | None = None  # full_determinism: the config's seed + the replica's rank
    free_cache_engine: bool = True  # False: sleep() keeps the KV cache

    @classmethod
    def from_rollout_config(cls, config: Any, replica_rank: int = 0) -> ServerDefaults:
        """From verl's `RolloutConfig` (the fields verl's own server reads)."""
        full = bool(getattr(config, "full_determinism", False))
        return cls(
            response_length=config.response_length,
            prompt_length=config.prompt_length,
            repetition_penalty=float(getattr(config, "repetition_penalty", 1.0)),
            ignore_eos=bool(getattr(config, "ignore_eos", False)),
            routed_experts=bool(getattr(config, "enable_rollout_routing_replay", False)),
            seed=replica_rank + config.seed if full else None,
            free_cache_engine=bool(getattr(config, "free_cache_engine", True)),
        )

    def sampling(self, given: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        """`SamplingParams` fields for one request, as verl's vLLM server fills them: its
        `logprobs` switch becomes "each token's logprob", `max_new_tokens` is SGLang's name."""
        params = dict(given)
        if "max_tokens" not in params:
            params["max_tokens"] = params.pop("max_new_tokens", None) or self.max_tokens(prompt_len)
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        params.setdefault("repetition_penalty", self.repetition_penalty)
        params.setdefault("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            params.setdefault("seed", self.seed)
        if self.routed_experts:
            params["return_routed_experts"] = True
        return params

    def max_tokens(self, prompt_len: int) -> int | None:
        if self.response_length is None:
            return None
        budget = self.response_length
        if self.prompt_length is not None:  # later turns of a conversation get what is left
            budget = min(budget, self.prompt_length + self.response_length - prompt_len)
        return max(1, budget)


class RaylaneRolloutServer:
    """The calls verl makes on a rollout server. `url`: the cluster's HTTP address, which
    `get_server_address` answers (verl's OpenAI clients and its load balancer use it)."""

    def __init__(
        self,
        client: RolloutClient,
        control: Control,
        defaults: ServerDefaults | None = None,
        url: str | None = None,
    ) -> None:
        self.client = client
        self.control = control
        self.defaults = defaults or ServerDefaults()
        self.url = url
        self.global_steps: int | None = None
        self._running: set[str] = set()
        self._rejecting = False  # abort_all_requests(reject_request=True) until resumed

    @classmethod
    def over_http(
        cls,
        url: str,
        defaults: ServerDefaults | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
    ) -> RaylaneRolloutServer:
        """A cluster served with `--trainer-api` at `url` (vLLM's RL routes steer it)."""
        client = RolloutClient(url, api_key=api_key)
        return cls(client, RoutesControl(url, admin_key or api_key), defaults, url)

    @classmethod
    def in_cluster(
        cls, defaults: ServerDefaults | None = None, url: str | None = None
    ) -> RaylaneRolloutServer:
        """Over Ray handles, inside the cluster `raylane serve` runs."""
        from raylane.client.ray_transport import RayTransport
        from raylane.launch import APP_NAME

        transport = RayTransport.connect(APP_NAME)  # generation and control, one client
        return cls(RolloutClient(transport=transport), PlaneControl(transport), defaults, url)

    async def launch_server(self) -> None:
        """Raises unless the cluster answers (and, over HTTP, serves the trainer routes)."""
        await self.control.ready()

    def get_server_address(self) -> tuple[str, int]:
        if self.url is None:
            raise ValueError("no HTTP address: give engine_kwargs.raylane.address")
        parts = urlsplit(self.url if "//" in self.url else f"http://{self.url}")
        return parts.hostname or "", parts.port or 80

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,  # NOTE: raylane schedules first come, first served
        kv_transfer_params: dict | None = None,
    ) -> Any:
        """One sample of `prompt_ids` as verl's `TokenOutput`."""
        media = (image_data, video_data, audio_data, mm_processor_kwargs or None)
        if any(x is not None for x in media):
            raise ValueError("image_data / video_data / audio_data: text prompts only")
        if kv_transfer_params is not None:
            raise ValueError("kv_transfer_params: prefill/decode disaggregation is not served")
        if self._rejecting:  # the replica left rotation: verl re-routes an aborted output
            return self._output([], None, None, "aborted")
        params = self.defaults.sampling(sampling_params, len(prompt_ids))
        self._running.add(request_id)
        try:
            (out,) = await self.client.generate(list(prompt_ids), request_id=request_id, **params)
        finally:
            self._running.discard(request_id)
        return self._output(
            list(out.token_ids),
            out.logprobs if params["logprobs"] is not None else None,
            out.routed_experts,  # int32 [prompt + output - 1, moe_layers, top_k]
            STOP_REASONS.get(out.finish_reason or ""),
            num_cached_tokens=out.num_cached_tokens,
        )

    def _output(self, ids, log_probs, experts, stop_reason, **extra: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        return TokenOutput(
            token_ids=ids,
            log_probs=log_probs,
            routed_experts=experts,
            stop_reason=stop_reason,
            extra_fields={"global_steps": self.global_steps, **extra},
        )

    # --- generation control: what a weight sync wraps itself in -------------------------------

    async def abort_all_requests(
        self, reset_prefix_cache: bool = True, reject_request: bool = False
    ) -> dict[str, Any]:
        """End what runs (partial outputs, stop reason "aborted") and hold what comes until
        `resume_generation`; `reject_request`: answer what comes as aborted instead."""
        self._rejecting = reject_request
        ids = sorted(self._running)
        await self.control.pause("abort")
        if reset_prefix_cache:
            await self.control.flush_cache()
        return {"aborted_count": len(ids), "request_ids": ids}

    async def resume_generation(self) -> None:
        await self.control.resume()
        self._rejecting = False

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        aborted = await self.control.abort([request_id]) > 0
        if aborted and reset_prefix_cache:
            await self.control.flush_cache()
        return {"aborted": aborted, "request_id": request_id}

    async def wait_for_requests_to_drain(self) -> None:
        while self._running:
            await asyncio.sleep(0.05)

    # --- memory: sleep frees the KV cache (raylane's weights are its own; they stay) ----------

    async def sleep(self) -> None:
        if self.defaults.free_cache_engine:
            await self.control.sleep(1)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.control.wake_up(tags)

    async def release_kv_cache(self) -> None:
        await self.sleep()

    async def resume_kv_cache(self) -> None:
        if self.defaults.free_cache_engine:
            await self.control.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        await self.control.flush_cache()

    # --- bookkeeping ------------------------------------------------------------------------

    async def set_global_steps(self, global_steps: int) -> None:
        """The trainer's step of the weights served, reported in each output's extra_fields."""
        self.global_steps = global_steps

    async def start_profile(self, **_: Any) -> None:
        """verl's profiler hooks: raylane has none to drive (a no-op, as verl's own servers
        are when profiling is off)."""

    async def stop_profile(self) -> None:
        """See `start_profile`."""


class ServerActor(RaylaneRolloutServer):
    """The server as a Ray actor of its own: over HTTP at `url`, else in the cluster."""

    def __init__(
        self,
        url: str | None,
        defaults: ServerDefaults,
        api_key: str | None = None,
        admin_key: str | None = None,
    ) -> None:
        if url is None:
            built = RaylaneRolloutServer.in_cluster(defaults)
        else:
            built = RaylaneRolloutServer.over_http(url, defaults, api_key, admin_key)
        super().__init__(built.client, built.control, defaults, url)
