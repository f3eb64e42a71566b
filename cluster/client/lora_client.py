"""`RolloutClient`'s adapter verbs: load, unload and list LoRA adapters, and the adapter-only
update (`update_lora`): only the adapter's tensors, under PEFT's names, as one transaction on
every replica (the manifest checked everywhere first, then buckets, then the commit; on any
failure the update is dropped and every replica keeps the old version)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from raylane.actors.models.weights import DEFAULT_BUCKET_BYTES, iter_buckets, pack_bucket, specs_of

if TYPE_CHECKING:
    import torch


class LoRAClient:
    transport: Any  # a Transport with the adapter verbs (client/lora_transports.py)

    async def load_lora(
        self, name: str, path: str, *, pinned: bool = False, replace: bool = False
    ) -> None:
        """Register adapter `name` from the PEFT directory `path` on every replica
        (`replace`: a new version of a name already loaded; `pinned`: never evicted)."""
        await self.transport.load_lora(name, path, pinned, replace)

    async def unload_lora(self, name: str) -> None:
        """Remove adapter `name` everywhere (its requests in flight finish first)."""
        await self.transport.unload_lora(name)

    async def list_loras(self) -> list[dict]:
        """The adapters served: {"name", "path", "version", ...} each."""
        return await self.transport.list_loras()

    async def update_lora(
        self,
        name: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> int:
        """Send adapter `name`'s new tensors (PEFT's names, e.g. from
        `peft.get_peft_model_state_dict` with the `base_model.model.` prefix, as in
        adapter_model.safetensors) as its next version, `version` its label. Requests in
        flight finish on the version they started on. Returns the adapter's new version."""
        named = list(named_tensors)
        if not named:
            raise ValueError("update_lora: no tensors given")
        specs = [s.to_dict() for s in specs_of(named)]
        update_id = await self.transport.begin_lora_update(name, specs)
        try:
            for bucket in iter_buckets(named, bucket_bytes):
                staged = self.transport.stage_bucket(pack_bucket(bucket))
                await self.transport.load_lora_bucket(update_id, staged)
            return await self.transport.commit_lora_update(update_id, version)
        except BaseException:
            with contextlib.suppress(Exception):  # the update's own error is the one to see
                await self.transport.abort_lora_update(update_id)
            raise
