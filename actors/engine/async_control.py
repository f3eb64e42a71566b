"""`AsyncEngineControl`: the RL control plane of one `AsyncLLMEngine` — pause and resume, weight
updates, sleep and weight checks (the trainer protocols) — and the gate that holds new requests
while it is paused."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from raylane.actors.engine.errors import EnginePaused

if TYPE_CHECKING:
    from raylane.actors.engine.llm_engine import LLMEngine
    from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput
    from raylane.actors.models.weights import TensorSpec

PAUSE_MODES = ("abort", "wait", "keep", "retract")


class AsyncEngineControl:
    """`AsyncLLMEngine`'s control methods (its base class): `_paused` is the pause mode (None:
    running), `_resumed` is set while running, `_num_held` counts the requests waiting for it."""

    engine: LLMEngine
    max_paused_requests: int
    _paused: str | None
    _resumed: asyncio.Event
    _num_held: int

    def _fan_out(self, outputs: list[EngineCoreOutput]) -> None:
        raise NotImplementedError  # AsyncLLMEngine's

    def _start(self) -> None:
        raise NotImplementedError  # AsyncLLMEngine's

    def check_health(self) -> None:
        raise NotImplementedError  # AsyncLLMEngine's

    async def abort(self, request_ids: str | list[str] | None) -> list[RequestOutput]:
        raise NotImplementedError  # AsyncLLMEngine's

    # --- pause, resume and weight updates (the RL control plane) ------------------------------

    @property
    def paused_mode(self) -> str | None:
        return self._paused

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def pause(self, mode: str = "keep") -> None:
        """Stop generating. New requests wait for `resume` (past `max_paused_requests`
        waiting, `EnginePaused`). Requests in flight, by `mode`:
        "abort": end now with their partial output (finish reason "abort");
        "wait": run to the end (returns once they have);
        "keep": freeze with their KV, continue after resume;
        "retract": free their KV; after resume they re-prefill prompt + generated tokens,
        under the weights of that time.
        Calling it again applies the new mode to what is still in flight (idempotent)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: {mode!r} is not one of {list(PAUSE_MODES)}")
        self._paused = mode
        self._resumed.clear()
        # a step in flight (the step loop may be awaiting it) is folded in first
        self._fan_out(self.engine.drain())
        if mode == "abort":
            await self.abort(list(self.engine.requests))
        elif mode == "retract":
            self.engine.retract_all()
        elif mode == "wait":
            while self.engine.has_unfinished_requests() and self._paused == "wait":
                self.check_health()  # a dead step loop would never finish them
                await asyncio.sleep(0.005)  # the step loop keeps running them

    async def resume(self) -> None:
        """Generate again: kept requests continue, retracted ones re-prefill, queued ones are
        admitted (idempotent). RuntimeError while a weight update is half loaded; ValueError
        while asleep."""
        if self.engine.upkeep.sleeping:
            raise ValueError("the engine is asleep: wake it up (wake_up) before resuming")
        if self.engine.weight_update_open:
            raise RuntimeError(
                "a weight update is half loaded: finish it (or send it again) before resuming"
            )
        self._paused = None
        self._resumed.set()
        if self.engine.has_unfinished_requests():
            self._start()

    def begin_weight_update(self, specs: list[TensorSpec] | None) -> None:
        """Check an update's manifest on every rank; the engine must be paused with nothing
        running (any pause mode; "wait" once it returned)."""
        if self._paused is None or (
            self._paused == "wait" and self.engine.has_unfinished_requests()
        ):
            raise RuntimeError("pause the engine before updating its weights")
        if self.engine.upkeep.weights_released:
            raise ValueError("the weights sleep (level 2): wake_up before updating them")
        self.engine.begin_weight_update(specs)

    def load_weight_bucket(self, bucket) -> int:
        return self.engine.load_weight_bucket(bucket)

    def finish_weight_update(self, version: int | None = None) -> int:
        """Switch to the new weights; requests past their max_weight_lag end as "stale"."""
        self.engine.finish_weight_update(version)
        self._fan_out(self.engine.drain())  # the requests it ended as "stale"
        return self.engine.weight_version

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    # --- sleep and weight checks (the trainer protocols) ----------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache of every rank, and at level 2 the weights too; the engine must be
        paused with nothing running (the control plane pauses it in mode "abort" first)."""
        if level not in (1, 2):
            raise ValueError(f"level: {level!r} is not 1 or 2")
        if self._paused is None or self.engine.has_unfinished_requests():
            raise ValueError("sleep: pause the engine (mode 'abort' or 'wait') first")
        self._fan_out(self.engine.drain())
        self.engine.upkeep.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep released: the weights ("weights" among `tags`, or no tags), the
        KV cache ("kv_cache", or no tags). The engine stays paused until resumed."""
        self.engine.upkeep.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.upkeep.sleeping

    def weight_checksums(self) -> dict[str, str]:
        self._fan_out(self.engine.drain())
        return self.engine.upkeep.weight_checksums()

    def reset_weights(self, seed: int = 0) -> None:
        self._fan_out(self.engine.drain())
        self.engine.upkeep.reset_weights(seed)

    async def _admitted(self) -> None:
        """Wait while paused; bounded, so a long pause cannot pile up requests without end."""
        if self._paused is None:
            return
        if self._num_held >= self.max_paused_requests:
            raise EnginePaused(
                f"the engine is paused and {self._num_held} requests already "
                "wait for it to resume; retry later"
            )
        self._num_held += 1
        try:
            while self._paused is not None:
                await self._resumed.wait()
        finally:
            self._num_held -= 1
        self.check_health()
