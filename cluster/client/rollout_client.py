"""`RolloutClient`: what an RL trainer drives the cluster with, over HTTP or in the cluster."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from raylane.actors.models.weights import DEFAULT_BUCKET_BYTES
from raylane.actors.replica_lora import versioned
from raylane.client.errors import Busy
from raylane.client.fanout import Branch, aggregate, branch_prompts, branch_seeds
from raylane.client.lora_client import LoRAClient
from raylane.client.rollout import Rollout
from raylane.client.session import Session
from raylane.client.transport import Transport
from raylane.client.weight_upload import WeightUpload
from raylane.client.wire import sampling_params

if TYPE_CHECKING:
    import torch

Prompt = list[int] | str


class RolloutClient(LoRAClient):
    """Generate, pause/resume, update weights, abort, sessions and fan-out, with one API.

    >>> async with RolloutClient("http://127.0.0.1:8000", admin_key="k") as client:
    ...     outs = await client.generate([1, 2, 3], max_tokens=16, n=4, seed=7)
    >>> client = RolloutClient.in_cluster()  # inside Ray: handles, no HTTP hop

    `generate` waits as long as the generation takes unless given a `timeout` (seconds; the
    constructor's is the default). When every replica is busy or none is ready (429/503), the
    call is retried with backoff for up to `busy_timeout_s` before `Busy` is raised.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout: float | None = None,
        *,
        busy_timeout_s: float = 300.0,
        transport: Transport | None = None,
    ):
        if transport is None:
            if base_url is None:
                raise ValueError("give base_url (HTTP) or use RolloutClient.in_cluster()")
            from raylane.client.http_transport import HttpTransport

            transport = HttpTransport(base_url, api_key, admin_key)
        self.transport = transport
        self.timeout = timeout
        self.busy_timeout_s = busy_timeout_s
        self._weights = WeightUpload(transport)

    @classmethod
    def in_cluster(
        cls,
        app_name: str | None = None,
        *,
        model: str | None = None,
        return_routed_experts: bool = False,
        timeout: float | None = None,
        busy_timeout_s: float = 300.0,
        return_indexer_topk: bool = False,
    ) -> RolloutClient:
        """A client over Ray handles (call `ray.init(address=..., namespace="raylane")` first
        when not already inside the cluster). `model`: the served HF directory, needed only
        by `session()` (with the app's `return_routed_experts` and `return_indexer_topk`)."""
        from raylane.client.ray_transport import RayTransport
        from raylane.launch import APP_NAME

        transport = RayTransport.connect(
            app_name or APP_NAME, model, return_routed_experts, return_indexer_topk
        )
        return cls(timeout=timeout, busy_timeout_s=busy_timeout_s, transport=transport)

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.transport.close()

    # --- generation -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        *,
        timeout: float | None = None,
        routing_key: str | None = None,
        request_id: str | None = None,
        lora: str | None = None,
        lora_version: int | None = None,
        **sampling: Any,
    ) -> list[Rollout]:
        """One `Rollout` per sample. `sampling` takes the `SamplingParams` fields (each
        token's logprob is returned unless `logprobs=None`); requests with the same
        `routing_key` go to the same replica; `lora` names the adapter to run on,
        `lora_version` one of its versions (default: the newest; one no longer held is a
        409 `ClientError` over HTTP, the engine's `LoRAVersionGone` in the cluster)."""
        params = sampling_params(sampling)
        request_id = request_id or f"rl-{uuid.uuid4().hex}"
        lora = versioned(lora, lora_version)
        on = {} if lora is None else {"lora": lora}  # every transport takes the base form
        call = self._retry_busy(
            lambda: self.transport.generate(prompt, params, request_id, routing_key, **on)
        )
        timeout = self.timeout if timeout is None else timeout
        return await (call if timeout is None else asyncio.wait_for(call, timeout))

    async def tokenize(
        self, text: str | None = None, *, messages: list[dict] | None = None
    ) -> list[int]:
        """The served model's token ids for `text` (as `generate` would encode it) or for chat
        `messages` (rendered with the chat template and the generation prompt)."""
        if (text is None) == (messages is None):
            raise ValueError("tokenize: give exactly one of text and messages")
        return await self.transport.tokenize(text, messages)

    async def _retry_busy(self, call):
        deadline = time.monotonic() + self.busy_timeout_s
        delay = 0.05
        while True:
            try:
                return await call()
            except Busy:
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)

    # --- control ----------------------------------------------------------------------------

    async def pause(self, mode: str = "keep") -> None:
        """Pause every replica; `mode` is "abort", "wait", "keep" or "retract" (see
        `AsyncLLMEngine.pause`). Requests sent meanwhile wait for `resume`."""
        await self.transport.pause(mode)

    async def resume(self) -> None:
        await self.transport.resume()

    async def sleep(self, level: int = 1) -> None:
        """Free every replica's KV cache (at level 2, also the weights, which `wake_up` loads
        again); requests in flight end (finish reason "abort") and new ones wait. Over HTTP
        the cluster must serve the trainer API (`--trainer-api`: vLLM's /sleep)."""
        await self.transport.sleep(level)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what `sleep` freed: `tags` "kv_cache" and/or "weights" (None: both); the
        engines resume once their KV caches are back."""
        await self.transport.wake_up(None if tags is None else list(tags))

    async def weight_version(self) -> int:
        return await self.transport.weight_version()

    async def weight_label(self) -> str | None:
        """The label the current version was committed with through vLLM's or SGLang's
        routes (`finish_weight_update {"weight_version": "step-42"}`), None if none was
        given. `weight_version()` stays raylane's integer, which grows with every commit."""
        return await self.transport.weight_label()

    async def flush_cache(self) -> None:
        await self.transport.flush_cache()

    async def abort(self, request_ids: Sequence[str]) -> list[Rollout]:
        """End the requests now; their partial outputs (finish reason "abort")."""
        return await self.transport.abort(list(request_ids))

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        progress: bool = False,
    ) -> int:
        """Send new weights (HF checkpoint names, e.g. `model.named_parameters()`) as one
        transaction: the manifest first (a bad name or shape fails it before any weight
        changes), then buckets of at most `bucket_bytes` (one bigger tensor travels alone),
        then the commit, which switches every replica to `version`. The engines are paused
        for it when they are not already. Returns the new version.

        At most two buckets are held at once: the next one is encoded while one travels.
        `progress` shows a bar of the bytes sent."""
        named = list(named_tensors)
        if not named:
            raise ValueError("update_weights: no tensors given")
        return await self._weights.send(named, version, bucket_bytes, progress)

    # --- sessions ---------------------------------------------------------------------------

    async def session(self, metadata: dict | None = None) -> Session:
        """A new multi-turn session (`chat(...)` turns, then `sample()`)."""
        return Session(self.transport, await self.transport.create_session(metadata))

    # --- fan-out ----------------------------------------------------------------------------

    async def fork(
        self,
        prefix: Prompt,
        k: int,
        *,
        suffixes: Sequence[Prompt] | None = None,
        routing_key: str | None = None,
        warm: bool = True,
        timeout: float | None = None,
        **sampling: Any,
    ) -> list[Branch]:
        """k branches on one prefix (each prefix + `suffixes[i]` when given), started together.

        They share a routing key, so they run on one replica, where the prefix's KV blocks
        are shared through the prefix cache and the scheduler batches them. `warm` first runs
        the prefix alone (one token): blocks are cached once computed, so branches that
        arrive in one step would otherwise each compute the prefix. A `seed` becomes seed + i
        for branch i."""
        prompts = branch_prompts(prefix, k, suffixes, sampling)
        sampling_params(sampling)  # a bad field fails here, not in k tasks
        key = routing_key or f"fork-{uuid.uuid4().hex}"
        if warm:
            await self.generate(
                prefix,
                routing_key=key,
                max_tokens=1,
                temperature=0.0,
                logprobs=None,
                timeout=timeout,
            )
        seeds = branch_seeds(sampling.pop("seed", None), k)
        return [
            self._branch(i, p, key, timeout, {**sampling, "seed": seeds[i]})
            for i, p in enumerate(prompts)
        ]

    def _branch(
        self, index: int, prompt: Prompt, key: str, timeout: float | None, sampling: dict
    ) -> Branch:
        request_id = f"branch-{uuid.uuid4().hex}"
        task = asyncio.ensure_future(
            self.generate(
                prompt, routing_key=key, timeout=timeout, request_id=request_id, **sampling
            )
        )
        return Branch(index, request_id, prompt, task)

    async def release(self, branch: Branch) -> None:
        """Stop a branch now and free its KV blocks (no-op when it finished)."""
        branch.released = True
        if branch.task.done():
            return
        branch.task.cancel()  # closes its request, which aborts it on the engine
        if self.transport.can_abort:  # and abort it by id, in case it had not started yet
            with contextlib.suppress(Exception):
                await self.transport.abort([branch.request_id])
        await asyncio.gather(branch.task, return_exceptions=True)

    async def gather(
        self, branches: Sequence[Branch], fail_fast: bool = True
    ) -> list[Rollout | BaseException]:
        """Every branch's sample, in order. `fail_fast`: the first error releases the
        siblings still running and is raised; otherwise errors take their branch's place."""
        released = [b.index for b in branches if b.released]
        if released:
            raise ValueError(f"gather: branches {released} were released")
        if not fail_fast:
            results = await asyncio.gather(*(b.task for b in branches), return_exceptions=True)
            return [r[0] if isinstance(r, list) else r for r in results]
        try:
            for next_done in asyncio.as_completed([b.task for b in branches]):
                await next_done
        except BaseException:
            await asyncio.gather(*(self.release(b) for b in branches if not b.done()))
            raise
        return [b.task.result()[0] for b in branches]

    aggregate = staticmethod(aggregate)
