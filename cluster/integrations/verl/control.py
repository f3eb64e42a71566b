"""What verl's rollout server asks of the cluster besides generation: pause and resume, sleep
and wake-up, aborts and the prefix cache. `PlaneControl` calls the control plane (the Router's
inside the cluster, or an in-process one); `RoutesControl` calls the same verbs over HTTP
through vLLM's RL routes, which a cluster serves with `--trainer-api`."""

from __future__ import annotations

from typing import Any, Protocol

import httpx
from raylane.client.http_transport import checked
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
    def __init__(self, plane: ControlBackend) -> None:
        self.plane = plane

    async def ready(self) -> None:
        await self.plane.weight_version()

    async def pause(self, mode: str) -> None:
        await self.plane.pause(mode)

    async def resume(self) -> None:
        await self.plane.resume()

    async def sleep(self, level: int) -> None:
        await self.plane.sleep(level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self.plane.wake_up(tags)

    async def flush_cache(self) -> None:
        await self.plane.flush_cache()

    async def abort(self, request_ids: list[str] | None) -> int:
        return len({out.request_id for out in await self.plane.abort(request_ids)})


class RoutesControl:
    """vLLM's RL routes of a raylane cluster at `url`; `key`: its admin key when it has one
    (state-changing routes need it), else its API key, else none (a private network)."""

    def __init__(self, url: str, key: str | None = None) -> None:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=None)

    async def ready(self) -> None:
        answer = await self.http.get("/is_paused")
        if answer.status_code == 404:
            raise ValueError(f"{self.http.base_url} serves no trainer routes: serve --trainer-api")
        checked(answer)

    async def pause(self, mode: str) -> None:
        await self._post("/pause", params={"mode": mode, "clear_cache": "false"})

    async def resume(self) -> None:
        await self._post("/resume")

    async def sleep(self, level: int) -> None:
        await self._post("/sleep", params={"level": level})

    async def wake_up(self, tags: list[str] | None) -> None:
        await self._post("/wake_up", params={} if tags is None else {"tags": tags})

    async def flush_cache(self) -> None:
        await self._post("/reset_prefix_cache")

    async def abort(self, request_ids: list[str] | None) -> int:
        answer = await self._post("/abort_requests", json={"request_ids": request_ids})
        return int(answer.json()["aborted"])

    async def close(self) -> None:
        await self.http.aclose()

    async def _post(self, path: str, **kwargs: Any) -> httpx.Response:
        return checked(await self.http.post(path, **kwargs))
