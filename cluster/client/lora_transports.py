"""The rollout client's adapter verbs on each transport: over HTTP (vLLM's load/unload routes,
`/v1/models`, and the `/admin/update_lora` bucket routes, which take the admin key) and over a
control plane (`PlaneLoRA`: the Router's, in the cluster; its buckets go through the object
store once for every replica)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import httpx
    from raylane.session_server.backend import ControlBackend


class HttpLoRA:
    """`HttpTransport`'s adapter verbs."""

    async def _post(self, path: str, body: Any, admin: bool = False) -> httpx.Response:
        raise NotImplementedError  # HttpTransport's

    async def _request(
        self,
        method: str,
        path: str,
        *,
        admin: bool = False,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        raise NotImplementedError  # HttpTransport's

    async def load_lora(self, name: str, path: str, pinned: bool, replace: bool) -> None:
        if pinned:  # SGLang's route says pinned; vLLM's says load_inplace
            resp = await self._post(
                "/load_lora_adapter",
                {"lora_name": name, "lora_path": path, "pinned": True},
                admin=True,
            )
            if not resp.json()["success"]:
                raise ValueError(resp.json()["error_message"])
            return
        body = {"lora_name": name, "lora_path": path, "load_inplace": replace}
        await self._post("/v1/load_lora_adapter", body, admin=True)

    async def unload_lora(self, name: str) -> None:
        await self._post("/v1/unload_lora_adapter", {"lora_name": name}, admin=True)

    async def list_loras(self) -> list[dict]:
        cards = (await self._request("GET", "/v1/models")).json()["data"]
        return [
            {"name": c["id"], "path": c["root"], "version": c.get("lora_version")}
            for c in cards
            if c.get("parent") is not None
        ]

    async def begin_lora_update(self, name: str, spec_dicts: list[dict]) -> str:
        body = {"lora_name": name, "tensors": spec_dicts}
        resp = await self._post("/admin/update_lora/begin", body, admin=True)
        return resp.json()["update_id"]

    async def load_lora_bucket(self, update_id: str, staged: bytes) -> int:
        resp = await self._request(
            "POST",
            f"/admin/update_lora/{update_id}/bucket",
            admin=True,
            content=staged,
            headers={"content-type": "application/octet-stream"},
        )
        return int(resp.json()["tensors"])

    async def commit_lora_update(self, update_id: str, version: int | str | None) -> int:
        path = f"/admin/update_lora/{update_id}/commit"
        return int((await self._post(path, {"version": version}, admin=True)).json()["version"])

    async def abort_lora_update(self, update_id: str) -> None:
        await self._post(f"/admin/update_lora/{update_id}/abort", None, admin=True)


class PlaneLoRA:
    """The adapter verbs over a control plane (`RayTransport`'s: the Router's)."""

    control: ControlBackend

    async def load_lora(self, name: str, path: str, pinned: bool, replace: bool) -> None:
        await self.control.load_lora(name, path, pinned, replace)

    async def unload_lora(self, name: str) -> None:
        await self.control.unload_lora(name)

    async def list_loras(self) -> list[dict]:
        return await self.control.list_loras()

    async def begin_lora_update(self, name: str, spec_dicts: list[dict]) -> str:
        return await self.control.begin_lora_update(name, spec_dicts)

    async def load_lora_bucket(self, update_id: str, staged: Any) -> int:
        if isinstance(staged, np.ndarray):  # an in-process plane takes the bytes themselves
            return await self.control.load_lora_bucket(update_id, staged.tobytes())
        # a list, so the Router forwards the reference without fetching the bytes itself
        return await self.control.load_lora_bucket(update_id, [staged])

    async def commit_lora_update(self, update_id: str, version: int | str | None) -> int:
        return await self.control.commit_lora_update(update_id, version)

    async def abort_lora_update(self, update_id: str) -> None:
        await self.control.abort_lora_update(update_id)
