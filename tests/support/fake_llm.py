"""FakeLLM: a scripted stand-in for the model, for tests and the benchmark.

It answers like a well-behaved model (one observation per scope, updated as memories arrive;
memories whose text starts with "skip:" are skipped), waits a fixed latency, and records every
call. A `behaviour` hook can override an answer or raise, to script slow, failing or bad models.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raylane.actors.consolidation.prompt import read_request

# Gets the request's JSON object; returns an answer text to send instead, or None for the
# default answer; may raise to make the call fail.
Behaviour = Callable[[dict[str, Any]], "str | None"]


@dataclass
class FakeCall:
    request: dict[str, Any]
    started: float
    finished: float = math.nan
    answer: str | None = None
    error: str | None = None
    response_format: dict | None = None

    @property
    def tag_sets(self) -> set[tuple[str, ...]]:
        return {tuple(m["tags"]) for m in self.request["memories"]}

    @property
    def memory_ids(self) -> list[int]:
        return [int(m["id"]) for m in self.request["memories"]]

    @property
    def observation_ids(self) -> list[int]:
        return [int(o["id"]) for o in self.request["observations"]]


def default_answer(request: dict[str, Any]) -> dict[str, Any]:
    """Fold the batch into the scope's first observation, or create one if there is none."""
    memories = request["memories"]
    skip = [m["id"] for m in memories if m["text"].startswith("skip:")]
    keep = [m for m in memories if not m["text"].startswith("skip:")]
    actions: list[dict[str, Any]] = [{"action": "skip", "memory_ids": skip}] if skip else []
    if keep:
        text = "; ".join(m["text"] for m in keep)
        ids = [m["id"] for m in keep]
        observations = request["observations"]
        if observations:
            first = observations[0]
            actions.append(
                {
                    "action": "update",
                    "observation_id": first["id"],
                    "memory_ids": ids,
                    "text": f"{first['text']}; {text}",
                }
            )
        else:
            actions.append({"action": "create", "memory_ids": ids, "text": text})
    return {"actions": actions}


@dataclass
class FakeLLM:
    latency: float = 0.0
    behaviour: Behaviour | None = None
    calls: list[FakeCall] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def complete(self, messages: list[dict], *, response_format: dict | None = None) -> str:
        call = FakeCall(
            read_request(messages), started=time.monotonic(), response_format=response_format
        )
        self.calls.append(call)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency)
            scripted = self.behaviour(call.request) if self.behaviour else None
            call.answer = (
                scripted if scripted is not None else json.dumps(default_answer(call.request))
            )
            return call.answer
        except Exception as exc:
            call.error = repr(exc)
            raise
        finally:
            self.in_flight -= 1
            call.finished = time.monotonic()
