"""What verl's rollout server asks of the cluster besides generation: pause and resume, sleep
and wake-up, aborts and the prefix cache, through the rollout client's control verbs.
`PlaneControl` calls a control plane (the Router's inside the cluster, or an in-process one)
through the client's `PlaneClient`; `RoutesControl` calls the same verbs over HTTP through
vLLM's RL routes, which a cluster serves with `--trainer-api` (verl's clusters run them without
an admin key, so without the client's /admin/ routes: sleep and wake-up are the client's)."""

from __future__ import annotations

from typing import Any, Protocol

import httpx
from raylane.client.http_transport import HttpTransport, checked
from raylane.client.plane_client import PlaneClient
from raylane.session_server.backend import ControlBackend


class Control(Protocol):
    async def ready(self) -> None: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def sleep(self, level: int) -> None: ...

    async def wake_up(self, tags: list[str] | None) -> None: ...

    async def flush_cache(self) -> None: ...

    async def abort(self, request_ids: list[str] | None) -> int:
        """End these requests (None: every one); how many were running."""
        ...


class PlaneControl:
    """`Control` over a control plane, through the client's `PlaneClient` (`plane`: a
    `ControlBackend`, or a `PlaneClient` such as a `RayTransport`)."""

    def __init__(self, plane: ControlBackend | PlaneClient) -> None:
        self.client = plane if isinstance(plane, PlaneClient) else PlaneClient(plane)

    async def ready(self) -> None:
        await self.client.weight_version()

    async def pause(self, mode: str) -> None:
        await self.client.pause(mode)

    async def resume(self) -> None:
        await self.client.resume()

    async def sleep(self, level: int) -> None:
        await self.client.sleep(level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self.client.wake_up(tags)

    async def flush_cache(self) -> None:
        await self.client.flush_cache()

    async def abort(self, request_ids: list[str] | None) -> int:
        return len({out.request_id for out in await self.client.abort(request_ids)})


class RoutesControl:
    """vLLM's RL routes of a raylane cluster at `url`; `key`: its admin key when it has one
    (state-changing routes need it), else its API key, else none (a private network)."""

    def __init__(self, url: str, key: str | None = None) -> None:
        self.client = HttpTransport(url, api_key=key, admin_key=key)
        self.http = self.client.http
        self.headers = {} if key is None else {"Authorization": f"Bearer {key}"}

    async def ready(self) -> None:
        answer = await self.http.get("/is_paused", headers=self.headers)
        if answer.status_code == 404:
            raise ValueError(f"{self.http.base_url} serves no trainer routes: serve --trainer-api")
        checked(answer)

    async def pause(self, mode: str) -> None:
        await self._post("/pause", params={"mode": mode, "clear_cache": "false"})

    async def resume(self) -> None:
        await self._post("/resume")

    async def sleep(self, level: int) -> None:
        await self.client.sleep(level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self.client.wake_up(tags)

    async def flush_cache(self) -> None:
        await self._post("/reset_prefix_cache")

    async def abort(self, request_ids: list[str] | None) -> int:
        answer = await self._post("/abort_requests", json={"request_ids": request_ids})
        return int(answer.json()["aborted"])

    async def close(self) -> None:
        await self.client.close()

    async def _post(self, path: str, **kwargs: Any) -> httpx.Response:
        return checked(await self.http.post(path, headers=self.headers, **kwargs))
