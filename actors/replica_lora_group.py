"""An engine replica's part in an adapter-only update over the trainer's collective group.

The trainer is rank 0 of a gloo group (SGLang's and vLLM's scheme); each engine replica is one
rank (not one per shard: an adapter is small, so the replica receives it whole and the engine
hands each rank its slices, as with an HTTP bucket). What arrives goes into the engine's open
adapter update (`begin_lora_update`, checked on every rank first), which the control plane
commits on every replica or none. The waits on the trainer run on a worker thread, so the
replica's event loop keeps answering meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any


class ReplicaLoRAGroup:
    """`ReplicaLoRA`'s collective verbs (its `_loras` is where the engine's adapter verbs are)."""

    _loras: Any
    _lora_groups: dict[str, Any] | None = None

    async def join_lora_group(self, info: dict, rank: int) -> int:
        """Join the trainer's adapter group as `rank`; waits until the whole group is in."""
        import torch
        from raylane.actors.runner.group_info import GroupInfo
        from raylane.actors.runner.weight_group import join_group

        group = GroupInfo(**info)
        if group.trainer_last:
            raise ValueError("trainer_last: adapter groups take the trainer as rank 0")
        await self.leave_lora_group(group.group_name)
        joined = await asyncio.to_thread(join_group, group, rank, torch.device("cpu"))
        if self._lora_groups is None:
            self._lora_groups = {}
        self._lora_groups[group.group_name] = joined
        return rank

    async def receive_lora(self, group_name: str, specs: list[dict]) -> int:
        """Receive the adapter's tensors (whole, in `specs`' order, one broadcast each) into
        the engine's open adapter update; how many arrived."""
        group = (self._lora_groups or {}).get(group_name)
        if group is None:
            raise ValueError(f"group_name: no adapter group {group_name!r} was joined")
        tensors = await asyncio.to_thread(_receive, group, specs)
        return self._loras.load_lora_bucket(tensors)

    async def leave_lora_group(self, group_name: str | None = None) -> None:
        """Leave one adapter group (None: every one)."""
        groups = self._lora_groups or {}
        for name in list(groups) if group_name is None else [group_name]:
            group = groups.pop(name, None)
            if group is not None:
                group.close()


def _receive(group: Any, specs: list[dict]) -> dict[str, Any]:
    import torch
    from raylane.actors.models.weights import TensorSpec, torch_dtype

    out = {}
    for spec in map(TensorSpec.from_dict, specs):
        tensor = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
        group.broadcast(tensor)
        out[spec.name] = tensor
    return out
