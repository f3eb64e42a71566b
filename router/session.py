"""A session's record and its registry's options: what the registry, its store and the routes
share (router/sessions.py holds the registry itself)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from raylane.actors.engine.outputs import CompletionOutput, EngineCoreOutput
from raylane.router.errors import SessionModelMismatch
from raylane.router.messages import Message
from raylane.router.trajectory import Trajectory

SAMPLE_MODES = ("merged",)


@dataclass(frozen=True)
class SessionConfig:
    max_rollback_steps: int = 1  # generated turns one request may discard
    drop_blobs: bool = True  # False keeps every turn's blob: O(turns x prefix), for benchmarks
    sample_mode: str = "merged"  # one sample per session
    ttl_s: float | None = 3600.0  # a session unused this long is dropped (None: never)
    max_sessions: int | None = 10_000  # live sessions; past it the least recently used goes

    def __post_init__(self) -> None:
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError("SessionConfig.ttl_s must be > 0 seconds, or None")
        if self.max_sessions is not None and (
            not isinstance(self.max_sessions, int) or self.max_sessions < 1
        ):
            raise ValueError("SessionConfig.max_sessions must be an int >= 1, or None")
        if not isinstance(self.max_rollback_steps, int) or self.max_rollback_steps < 0:
            raise ValueError("SessionConfig.max_rollback_steps must be an int >= 0")
        if self.sample_mode == "per_turn":
            raise ValueError(
                "SessionConfig.sample_mode='per_turn' would need every turn's "
                "routed-expert blob, O(turns x prefix) memory; the registry keeps "
                "only the newest max_rollback_steps + 1 — use 'merged'"
            )
        if self.sample_mode not in SAMPLE_MODES:
            raise ValueError(f"SessionConfig.sample_mode must be one of {SAMPLE_MODES}")

    @property
    def blob_window(self) -> int | None:
        """Records that keep their blobs: the newest, plus one per rollback step allowed."""
        return self.max_rollback_steps + 1 if self.drop_blobs else None


@dataclass
class Session:
    id: str
    metadata: dict[str, Any]
    created_at: float = field(default_factory=time.time)
    trajectory: Trajectory = field(default_factory=Trajectory)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    deleted: bool = False
    last_used: float = 0.0  # the registry's clock
    model: str | None = None  # the served model that made it (None: not recorded)

    def continue_with(self, model: str | None) -> None:
        """Check that `model` (None: unknown, no check) may continue this stored session; one
        stored before sessions recorded their model is taken to be `model`'s, and records it.

        Raises `SessionModelMismatch`: its ids follow its own model's chat template and
        tokenizer, so another model would silently continue a conversation it cannot read."""
        if self.model is None:
            self.model = model
        elif model is not None and self.model != model:
            raise SessionModelMismatch(self.id, self.model, model)

    def describe(self) -> dict[str, Any]:
        """JSON-ready: metadata, the conversation and the records (without blobs)."""
        traj = self.trajectory
        return {
            "session_id": self.id,
            "created_at": self.created_at,
            "metadata": self.metadata,
            "model": self.model,
            "num_turns": len(traj),
            "num_tokens": traj.num_tokens,
            "messages": traj.messages(),
            "records": [r.to_dict() for r in traj.records],
        }


@dataclass(frozen=True)
class TurnResult:
    """A turn in progress (`message` None) or committed (`message` set, the last one yielded)."""

    output: CompletionOutput  # cumulative; no routed-expert blob (the record keeps it)
    weight_version: int  # the engine's when it produced this output
    prompt_len: int  # ids the model saw as this turn's prompt
    rolled_back: int  # generated turns this request discarded
    message: Message | None = None  # the assistant message stored for the reply
    turn: int | None = None  # the record's index in the session


@dataclass(frozen=True)
class TurnDelta:
    """What a turn's generation added, as it goes: `delta` is the engine's own (one choice;
    the prompt ids on the first, the replay blobs on the finished one). The last one, the
    finished delta, comes with the `committed` result."""

    delta: EngineCoreOutput
    prompt_len: int  # ids the model saw as this turn's prompt
    rolled_back: int  # generated turns this request discarded (0 until the commit says)
    committed: TurnResult | None = None
