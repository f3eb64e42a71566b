"""The protocol `RolloutClient` drives: one request or control call at a time, over HTTP
(`HttpTransport`) or Ray handles (`RayTransport`). Retries, timeouts, bucketing and fan-out live
in the client, so both transports stay thin and behave the same."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.client.rollout import Rollout, SessionTurn
from raylane.router.samples import TrainingSample


class Transport(Protocol):
    """Errors: `ValueError` for bad input, `raylane.client.errors.Busy` when no replica can
    take the request now, `PermissionError` for a missing or wrong admin key."""

    can_abort: bool  # abort() can reach the engines (HTTP: an admin key was given)

    async def generate(
        self,
        prompt: list[int] | str,
        params: SamplingParams,
        request_id: str,
        routing_key: str | None,
        lora: str | None = None,
    ) -> list[Rollout]:
        """The finished request (on adapter `lora`, if named), one rollout per sample;
        cancelling the call aborts it."""
        ...

    async def tokenize(self, text: str | None, messages: list[dict] | None) -> list[int]:
        """The served model's ids for `text` (special tokens added, as /generate does) or for
        chat `messages` (the chat template, with the generation prompt)."""
        ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def sleep(self, level: int) -> None:
        """Pause in mode "abort" and free every replica's KV cache (level 1 or 2)."""
        ...

    async def wake_up(self, tags: list[str] | None) -> None:
        """Restore what `sleep` freed ("kv_cache", "weights"; None: both) and resume."""
        ...

    async def weight_version(self) -> int: ...

    async def weight_label(self) -> str | None:
        """The label a trainer protocol committed the current version with, if any."""
        ...

    async def begin_update(self, version: int, spec_dicts: list[dict]) -> str: ...

    def stage_bucket(self, payload: np.ndarray) -> Any:
        """What `load_bucket` sends for one bucket in safetensors layout (`pack_bucket`'s uint8
        array; blocking: the client calls it off the event loop, while the previous bucket
        travels). It must copy the bucket out: the array is reused for the next one."""
        ...

    async def load_bucket(self, update_id: str, staged: Any) -> int: ...

    async def commit_update(self, update_id: str) -> int: ...

    async def abort(self, request_ids: list[str]) -> list[Rollout]: ...

    async def flush_cache(self) -> None: ...

    async def create_session(self, metadata: dict | None) -> str: ...

    async def session_chat(
        self,
        session_id: str,
        messages: list[dict],
        params: SamplingParams,
        tools: list[dict] | None,
        lora_version: int | None = None,
    ) -> SessionTurn: ...

    async def session_sample(self, session_id: str, max_seq_len: int | None) -> TrainingSample: ...

    async def describe_session(self, session_id: str) -> dict: ...

    async def delete_session(self, session_id: str) -> None: ...

    async def close(self) -> None: ...
