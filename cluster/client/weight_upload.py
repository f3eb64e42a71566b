"""A weight update as the rollout client sends it, over either transport: the manifest, then
buckets of safetensors bytes (the next one packed while the previous one travels), then the
commit."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

import numpy as np
from raylane.actors.models.weights import iter_buckets, pack_bucket, specs_of
from raylane.client.transport import Transport
from tqdm import tqdm

if TYPE_CHECKING:
    import torch


class WeightUpload:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._scratch: np.ndarray | None = None  # where weight buckets are packed

    async def send(
        self,
        named: list[tuple[str, torch.Tensor]],
        version: int,
        bucket_bytes: int,
        progress: bool,
    ) -> int:
        """`RolloutClient.update_weights`: one transaction; the new version."""
        specs = [s.to_dict() for s in specs_of(named)]
        update_id = await self.transport.begin_update(version, specs)
        with tqdm(
            total=sum(t.numel() * t.element_size() for _, t in named),
            unit="B",
            unit_scale=True,
            desc=f"weights v{version}",
            disable=not progress,
        ) as bar:
            await self._send_buckets(update_id, iter_buckets(named, bucket_bytes), bar)
        return await self.transport.commit_update(update_id)

    async def _send_buckets(self, update_id: str, buckets, bar: tqdm) -> None:
        sending: asyncio.Future | None = None
        try:
            for bucket in buckets:
                staged = await asyncio.to_thread(self._stage, bucket)
                if sending is not None:
                    await sending
                sending = asyncio.ensure_future(self.transport.load_bucket(update_id, staged))
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                sending.add_done_callback(functools.partial(_advance, bar, size))
                del staged
            if sending is not None:
                await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()

    def _stage(self, bucket: list[tuple[str, torch.Tensor]]) -> Any:
        # one bucket is staged at a time and staging copies it out (into the object store, or
        # into the HTTP body), so one scratch buffer serves every bucket
        packed = pack_bucket(bucket, self._scratch)
        if packed.base is None:  # the scratch was too small: keep the larger buffer
            self._scratch = packed
        return self.transport.stage_bucket(packed)


def _advance(bar: tqdm, num_bytes: int, _sent: asyncio.Future) -> None:
    bar.update(num_bytes)
