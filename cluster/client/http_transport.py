"""The rollout client over HTTP: `/generate`, `/tokenize`, the `/sessions` routes, the
`/admin/` routes (which take the admin key; weight buckets travel as raw safetensors bytes), and
vLLM's `/sleep` and `/wake_up` (served with `--trainer-api`)."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.client.errors import from_status
from raylane.client.lora_transports import HttpLoRA
from raylane.client.rollout import Rollout, SessionTurn, from_generate_item, unfloor
from raylane.client.wire import chat_body, generate_body
from raylane.router.samples import TrainingSample

_SAFETENSORS = "application/safetensors"


class HttpTransport(HttpLoRA):
    """The adapter verbs are `HttpLoRA`'s (client/lora_transports.py)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        admin_key: str | None = None,
        connect_timeout_s: float = 30.0,
    ):
        self.api_key = api_key
        self.admin_key = admin_key
        self.can_abort = admin_key is not None
        # no read timeout: a generation takes as long as it takes (the client bounds it)
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    # --- generation -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: list[int] | str,
        params: SamplingParams,
        request_id: str,
        routing_key: str | None,
        lora: str | None = None,
    ) -> list[Rollout]:
        ids = await self.tokenize(prompt, None) if isinstance(prompt, str) else list(prompt)
        body = generate_body(ids, params, request_id, routing_key)
        if lora is not None:
            body["lora_path"] = lora  # SGLang's field: the adapter's name
            if getattr(lora, "version", None) is not None:  # a LoRAName: one of its versions
                body["lora_version"] = lora.version  # type: ignore[attr-defined]
        answer = (await self._post("/generate", body)).json()
        items = answer if isinstance(answer, list) else [answer]
        return [from_generate_item(item, ids, request_id) for item in items]

    async def tokenize(self, text: str | None, messages: list[dict] | None) -> list[int]:
        body = {"prompt": text} if messages is None else {"messages": messages}
        return (await self._post("/tokenize", body)).json()["tokens"]

    # --- control (admin routes) -------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        await self._post("/admin/pause", {"mode": mode}, admin=True)

    async def resume(self) -> None:
        await self._post("/admin/resume", None, admin=True)

    async def weight_version(self) -> int:
        resp = await self._request("GET", "/admin/weight_version", admin=True)
        return int(resp.json()["weight_version"])

    async def weight_label(self) -> str | None:
        resp = await self._request("GET", "/admin/weight_version", admin=True)
        return resp.json().get("weight_label")

    async def begin_update(self, version: int, spec_dicts: list[dict]) -> str:
        body = {"version": version, "tensors": spec_dicts}
        return (await self._post("/admin/update_weights/begin", body, admin=True)).json()[
            "update_id"
        ]

    def stage_bucket(self, payload: np.ndarray) -> bytes:
        return payload.tobytes()  # the body: safetensors bytes

    async def load_bucket(self, update_id: str, staged: bytes) -> int:
        resp = await self._request(
            "POST",
            f"/admin/update_weights/{update_id}/bucket",
            admin=True,
            content=staged,
            headers={"content-type": "application/octet-stream"},
        )
        return int(resp.json()["tensors"])

    async def commit_update(self, update_id: str) -> int:
        resp = await self._post(f"/admin/update_weights/{update_id}/commit", None, admin=True)
        return int(resp.json()["weight_version"])

    async def abort(self, request_ids: list[str]) -> list[Rollout]:
        resp = await self._post("/admin/abort", {"request_ids": list(request_ids)}, admin=True)
        return [from_generate_item(item) for item in resp.json()["outputs"]]

    async def flush_cache(self) -> None:
        await self._post("/admin/flush_cache", None, admin=True)

    # vLLM's RL routes (a cluster served with --trainer-api): sleep has no /admin/ route. They
    # take the admin key when the server has one, else the API key.

    async def sleep(self, level: int) -> None:
        await self._trainer_post("/sleep", params={"level": level})

    async def wake_up(self, tags: list[str] | None) -> None:
        await self._trainer_post("/wake_up", params={} if tags is None else {"tags": tags})

    # --- sessions ---------------------------------------------------------------------------

    async def create_session(self, metadata: dict | None) -> str:
        return (await self._post("/sessions", {"metadata": metadata})).json()["session_id"]

    async def session_chat(
        self,
        session_id: str,
        messages: list[dict],
        params: SamplingParams,
        tools: list[dict] | None,
        lora_version: int | None = None,
    ) -> SessionTurn:
        body = chat_body(messages, params, tools)
        if lora_version is not None:  # of the session's adapter
            body["lora_version"] = lora_version
        resp = await self._post(f"/sessions/{session_id}/v1/chat/completions", body)
        return _session_turn(resp.json())

    async def session_sample(self, session_id: str, max_seq_len: int | None) -> TrainingSample:
        resp = await self._request(
            "POST",
            f"/sessions/{session_id}/samples",
            json={"max_seq_len": max_seq_len},
            headers={"accept": _SAFETENSORS},
        )
        return TrainingSample.from_safetensors(resp.content)

    async def describe_session(self, session_id: str) -> dict:
        return (await self._request("GET", f"/sessions/{session_id}")).json()

    async def delete_session(self, session_id: str) -> None:
        await self._request("DELETE", f"/sessions/{session_id}")

    async def close(self) -> None:
        await self.http.aclose()

    # --- the wire ---------------------------------------------------------------------------

    async def _post(self, path: str, body: Any, admin: bool = False) -> httpx.Response:
        return await self._request("POST", path, admin=admin, json=body)

    async def _trainer_post(self, path: str, **kwargs: Any) -> httpx.Response:
        admin = self.admin_key is not None
        return await self._request("POST", path, admin=admin, **kwargs)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        admin: bool = False,
        headers: dict[str, str] | None = None,
        **kwargs,
    ) -> httpx.Response:
        key = self.admin_key if admin else self.api_key
        headers = dict(headers or {})
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return checked(await self.http.request(method, path, headers=headers, **kwargs))


def checked(resp: httpx.Response) -> httpx.Response:
    """`resp`, or the client's error for its status (`from_status`) when it is one."""
    if resp.status_code >= 400:
        raise from_status(resp.status_code, _body(resp))
    return resp


def _body(resp: httpx.Response) -> object:
    try:
        return resp.json()
    except ValueError:
        return resp.text


def _session_turn(answer: dict) -> SessionTurn:
    choice = answer["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return SessionTurn(
        message=choice["message"],
        text=choice["message"].get("content") or "",
        token_ids=[int(t) for t in choice.get("token_ids") or []],
        logprobs=[unfloor(e["logprob"]) for e in content],
        finish_reason=choice.get("finish_reason"),
        weight_version=int(answer.get("weight_version") or 0),
    )
