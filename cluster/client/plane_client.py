"""`PlaneClient`: the rollout client's control verbs over a control plane (`ControlBackend`):
the Router's, reached through its actor handle (`RayTransport`), or one in this process (a
`local_backend`'s). Pause and resume, sleep and wake-up, aborts, the prefix cache and the
weight update's manifest and commit, written once; `RayTransport` is one, and verl's adapter
(`raylane.integrations.verl`) drives a cluster with one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raylane.client.rollout import Rollout, from_request_output

if TYPE_CHECKING:
    from raylane.session_server.backend import ControlBackend


class PlaneClient:
    def __init__(self, control: ControlBackend) -> None:
        self.control = control

    async def pause(self, mode: str) -> None:
        await self.control.pause(mode)

    async def resume(self) -> None:
        await self.control.resume()

    async def sleep(self, level: int) -> None:
        await self.control.sleep(level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self.control.wake_up(tags)

    async def weight_version(self) -> int:
        return await self.control.weight_version()

    async def weight_label(self) -> str | None:
        return await self.control.weight_label(None)

    async def begin_update(self, version: int, spec_dicts: list[dict]) -> str:
        return await self.control.begin_update(version, spec_dicts)

    async def commit_update(self, update_id: str) -> int:
        return await self.control.commit_update(update_id)

    async def abort(self, request_ids: list[str] | None) -> list[Rollout]:
        """None: every request."""
        wanted = None if request_ids is None else list(request_ids)
        outs = await self.control.abort(wanted)
        return [r for out in outs for r in from_request_output(out)]

    async def flush_cache(self) -> None:
        await self.control.flush_cache()
