"""Engine statistics for Prometheus, kept as plain numbers so replicas can ship snapshots.

Names and buckets follow vLLM's metrics so dashboards port by a prefix change; the HTTP layer
turns snapshots from every replica into `raylane:*` families.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

from raylane.actors.engine.spec.metrics import SpecStats

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


class StepTimer:
    """Laps of one engine step: `mark(name)` records the seconds since the previous mark."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


class StepTimes:
    """Where step time goes, summed over steps, for `python -m benchmarks step`.

    The engine's own laps (schedule, plan, postprocess) plus the runner's (prepare, forward,
    sample; `collectives` is the part of forward rank 0 spent in all-reduce / all-gather) and
    the executor's transport: `dispatch` is from the engine sending the plan to the
    runner starting on it, `return` from the runner finishing to the engine holding the result
    (the clocks agree across processes of one node: perf_counter is CLOCK_MONOTONIC).
    """

    PARTS = (
        "schedule",
        "plan",
        "dispatch",
        "prepare",
        "forward",
        "collectives",
        "sample",
        "return",
        "postprocess",
    )

    def __init__(self) -> None:
        self.steps = 0
        self.totals = dict.fromkeys(self.PARTS, 0.0)
        self.total_execute = 0.0
        self._runner_free_at = 0.0  # when the runner finished the step before

    def add(self, timer: StepTimer, runner: dict[str, float]) -> None:
        self.steps += 1
        laps: dict[str, float] = {
            **timer.laps,
            **{
                k: runner[k] for k in ("prepare", "forward", "collectives", "sample") if k in runner
            },
        }
        if "sent_at" in runner and "started_at" in runner:
            # async scheduling sends a plan while the runner is busy: its wait in the queue
            # is not transport
            ready = max(runner["sent_at"], self._runner_free_at)
            laps["dispatch"] = max(0.0, runner["started_at"] - ready)
            laps["return"] = runner["received_at"] - runner["finished_at"]
            self._runner_free_at = runner["finished_at"]
        for name, seconds in laps.items():
            if name in self.totals:
                self.totals[name] += seconds
        self.total_execute += timer.laps.get("execute", 0.0)

    def per_step_ms(self) -> dict[str, float]:
        steps = max(1, self.steps)
        return {name: 1000 * total / steps for name, total in self.totals.items()}


class EngineStats:
    """Counters and histograms the engine updates as it steps."""

    def __init__(self):
        self.step_times = StepTimes()
        self.steps_planned_ahead = 0  # launched while the step before was in flight (async)
        self.grammar_skips = 0  # rows that sat out a step: their grammar mask was late
        self.graph_replays = 0  # decode and verify steps replayed from a graph (eager on CPU)
        self.verify_graph_replays = 0  # of them, speculative verify steps (graph_runner.py)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.spec = SpecStats()  # speculative decoding (sized by the engine's config)
        self.finished: Counter[str] = Counter()
        self.histograms = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(LATENCY_BUCKETS),
            "request_queue_time_seconds": Histogram(LATENCY_BUCKETS),
        }

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    # speculative decoding, under vLLM's names
    @property
    def spec_decode_num_drafts(self) -> int:
        return self.spec.num_drafts

    @property
    def spec_decode_num_draft_tokens(self) -> int:
        return self.spec.num_draft_tokens

    @property
    def spec_decode_num_accepted_tokens(self) -> int:
        return self.spec.num_accepted_tokens

    @property
    def spec_decode_num_accepted_tokens_per_pos(self) -> list[int]:
        return list(self.spec.accepted_per_pos)

    # --- a request's milestones (`Request`: its times are stamped here) ----------------------

    def scheduled(self, request, num_prompt_tokens: int, now: float) -> None:
        """Counted once, the first time the request is scheduled."""
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            self.prompt_tokens += num_prompt_tokens
            self.observe("request_queue_time_seconds", now - request.arrival_time)

    def token(self, request, now: float) -> None:
        self.generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
            self.observe("time_to_first_token_seconds", now - request.arrival_time)
        elif request.params.n == 1:
            self.observe("inter_token_latency_seconds", now - request.last_token_time)
        request.last_token_time = now

    def request_finished(self, request, now: float) -> None:
        self.finished[request.seqs[0].finish_reason] += 1
        self.observe("e2e_request_latency_seconds", now - request.arrival_time)

    def snapshot(
        self, scheduler, block_manager, weight_version: int = 0, paused: bool = False
    ) -> dict:
        return {
            "gauges": {
                "num_requests_running": len(scheduler.running),
                "num_requests_waiting": len(scheduler.waiting),
                "kv_cache_usage_perc": block_manager.usage(),
                "weight_version": weight_version,
                "paused": int(paused),
            },
            "counters": {
                "steps": self.step_times.steps,
                "steps_planned_ahead": self.steps_planned_ahead,
                "grammar_skips": self.grammar_skips,
                "graph_replays": self.graph_replays,
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "num_preemptions": scheduler.num_preemptions,
                "prefix_cache_queries": block_manager.num_queries,
                "prefix_cache_hits": block_manager.num_hits,
            },
            "spec_decode": self.spec.snapshot(),
            "finished": dict(self.finished),
            "histograms": {name: h.snapshot() for name, h in self.histograms.items()},
        }
