"""The rollout client inside the Ray cluster: no HTTP hop.

Generation chooses a replica on this process's copy of the Router's replica table, then streams
from that engine replica through its actor handle (as the HTTP ingress does,
`cluster/serve_backend.py`); control calls go to the Router's control plane, which reaches every
replica; weight buckets are put in the object store once and every replica fetches the same
object.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import numpy as np
from raylane.actors.engine.errors import EnginePaused, RequestFailed
from raylane.actors.engine.output_accumulator import OutputAccumulator
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.client.errors import Busy, ClientError, NoReplica
from raylane.client.lora_transports import PlaneLoRA
from raylane.client.plane_client import PlaneClient
from raylane.client.rollout import Rollout, SessionTurn, from_request_output
from raylane.router.errors import ReplicaFailed, ReplicasBusy, call_router
from raylane.router.generator import RequestTurnGenerator
from raylane.router.replica_requests import ReplicaRequests
from raylane.router.samples import TrainingSample


class RayTransport(PlaneLoRA, PlaneClient):
    """The control verbs are `PlaneClient`'s, on the Router's control plane."""

    can_abort = True

    def __init__(
        self,
        router: Any,
        model: str | None = None,
        return_routed_experts: bool = False,
        capacity: int = 256,
        return_indexer_topk: bool = False,
    ):
        from raylane.serve_backend import router_control, router_view

        self.router = router  # the Router actor's handle
        super().__init__(router_control(router, _unwrap))  # its control plane
        self.requests = ReplicaRequests(router_view(router, capacity))
        self.model = model  # the served HF directory: its tokenizer and chat template
        self.sessions = (
            None
            if model is None
            else _router_sessions(
                router, model, return_routed_experts, self.requests, return_indexer_topk
            )
        )
        self._tokenizer = None

    @classmethod
    def connect(
        cls,
        app_name: str,
        model: str | None = None,
        return_routed_experts: bool = False,
        return_indexer_topk: bool = False,
    ) -> RayTransport:
        """The Router of a running app (`ray.init(address=...)` first when outside the
        cluster). `model`: the HF directory the app serves (its chat template builds session
        turns). `app_name` is kept for callers; a cluster has one Router."""
        import ray
        from raylane.router.names import NAMESPACE, ROUTER_NAME

        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        return cls(router, model, return_routed_experts, return_indexer_topk=return_indexer_topk)

    async def generate(
        self,
        prompt: list[int] | str,
        params: SamplingParams,
        request_id: str,
        routing_key: str | None,
        lora: str | None = None,
    ) -> list[Rollout]:
        final = OutputAccumulator()  # the engine's deltas, folded into the final output
        try:
            stream = self.requests.generate(prompt, params, request_id, routing_key, lora)
            async with aclosing(stream):
                async for out in stream:
                    final.add(out)
        except (ReplicasBusy, ReplicaFailed) as e:
            raise Busy(e.status, str(e), e.error_type, None, e.code) from e
        except EnginePaused as e:  # its paused queue is full: worth retrying
            raise Busy(503, str(e), "server_error", None, "engine_paused") from e
        except RequestFailed as e:  # a step it was in failed; the replica serves on
            raise ClientError(500, str(e), "server_error", None, "request_failed") from e
        return from_request_output(final.output())

    async def tokenize(self, text: str | None, messages: list[dict] | None) -> list[int]:
        tokenizer = self._tokenizer_of_model()
        if messages is None:
            return list(tokenizer.encode(text, add_special_tokens=True))
        # as the HTTP layer renders a chat (session_server/prompts.py)
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))

    def _tokenizer_of_model(self):
        if self.model is None:
            raise ValueError(
                "tokenize needs the served model: RolloutClient.in_cluster(model=HF_DIR)"
            )
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self._tokenizer

    # --- control (the Router's control plane) -----------------------------------------------

    def stage_bucket(self, payload: np.ndarray) -> Any:
        import ray

        # stored once for every replica; a numpy array, so a replica on this node reads it in
        # place from shared memory (bytes would be copied out on every get)
        return ray.put(payload)

    async def load_bucket(self, update_id: str, staged: Any) -> int:
        # a list, so the Router forwards the reference without fetching the bytes itself
        return await self.control.load_bucket(update_id, [staged])

    # --- sessions (the Router hosts them) ---------------------------------------------------

    def _sessions(self):
        if self.sessions is None:
            raise ValueError(
                "sessions need the served model: RolloutClient.in_cluster(model=HF_DIR)"
            )
        return self.sessions

    async def create_session(self, metadata: dict | None) -> str:
        return await self._sessions().create(metadata)

    async def session_chat(
        self,
        session_id: str,
        messages: list[dict],
        params: SamplingParams,
        tools: list[dict] | None,
        lora_version: int | None = None,
    ) -> SessionTurn:
        last = None
        async with aclosing(
            self._sessions().chat_stream(
                session_id, messages, params, tools=tools, lora_version=lora_version
            )
        ) as turn:
            async for result in turn:
                last = result
        assert last is not None  # chat_stream ends with the committed result or raises
        out = last.output
        return SessionTurn(
            message=last.message,
            text=out.text,
            token_ids=list(out.token_ids),
            logprobs=list(out.logprobs or []),
            finish_reason=out.finish_reason,
            weight_version=last.weight_version,
        )

    async def session_sample(self, session_id: str, max_seq_len: int | None) -> TrainingSample:
        return await self._sessions().sample(session_id, max_seq_len)

    async def describe_session(self, session_id: str) -> dict:
        return await self._sessions().describe(session_id)

    async def delete_session(self, session_id: str) -> None:
        await self._sessions().delete(session_id)

    async def close(self) -> None:
        self.requests.view.close()  # the handles belong to the cluster


def _router_sessions(
    router: Any, model: str, routed: bool, requests: ReplicaRequests, picks: bool = False
):
    from raylane.router.session_host import SessionSetup
    from raylane.serve_backend import RouterSessions

    # NOTE: must equal the ingress's setup (same model dir, same routed-experts flag), else
    # the Router takes it for a redeployed model and rebuilds its registry
    setup = SessionSetup(model, return_routed_experts=routed, return_indexer_topk=picks)
    return RouterSessions(router, setup, RequestTurnGenerator(requests, routed, picks))


async def _unwrap(ref: Any) -> Any:
    """The Router's answer (`call_router`); a Router that is down is `NoReplica`."""
    return await call_router(ref, down=NoReplica)
