"""A multi-turn session as the rollout client sees it: turns in, a merged training sample out.

The server records every turn token-in/token-out; the agent sends the whole conversation each
turn, as to any OpenAI chat endpoint, and the session appends only what is new.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raylane.client.rollout import SessionTurn
from raylane.client.wire import sampling_params
from raylane.router.samples import TrainingSample

if TYPE_CHECKING:
    from raylane.client.transport import Transport


class Session:
    """`await client.session()`; `async with` deletes it on exit."""

    def __init__(self, transport: Transport, session_id: str):
        self.transport = transport
        self.session_id = session_id

    async def chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        lora_version: int | None = None,
        **sampling: Any,
    ) -> SessionTurn:
        """One turn: `messages` is the whole conversation so far, ending with the new user
        (or tool) message; `sampling` takes the `SamplingParams` fields. `lora_version`: that
        version of the adapter the session was opened on (`metadata={"lora": name}`; a version
        no longer held is a 409, `ClientError` over HTTP, `LoRAVersionGone` in the cluster)."""
        params = sampling_params(sampling)
        return await self.transport.session_chat(
            self.session_id, list(messages), params, tools, lora_version
        )

    async def sample(self, max_seq_len: int | None = None) -> TrainingSample:
        """The turns merged into one training sample (tokens, loss mask, logprobs, ...)."""
        return await self.transport.session_sample(self.session_id, max_seq_len)

    async def describe(self) -> dict:
        return await self.transport.describe_session(self.session_id)

    async def delete(self) -> None:
        await self.transport.delete_session(self.session_id)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.delete()
