"""The Ray executor: a group of `ModelShard` actors, one per tensor-parallel rank, on one node.

Ray starts, places, calls (weight loads, health pings) and kills the shards. The per-step
dispatch (plan to every shard, rank 0's result back) goes over a loopback socket per shard
instead of a Ray call, chosen by measurement on the 2-core dev machine (round trip with a no-op
forward, median / p90 microseconds, 2.4 KB plan, 0.6 KB result, machine shared at load 4-16):

    world size                          1           2            3
    pickle in process (the floor)       33 / 33     -            -
    loopback socket per shard (ours)    51 / 54     92 / 130     131 / 200
    Ray compiled graph (shm channels)   193 / 271   337 / 495    446 / 690
    Ray actor call per shard            729 / 813   1111 / 1398  1668 / 2222
    Ray call to rank 0 + gloo bcast     -           1178 / 2769  1326 / 2338

A small gloo all_reduce costs 300 us (2 ranks) to 2100 us (3 ranks on 2 cores), so only the
socket and compiled-graph paths stay under half a millisecond above the collectives. Compiled
graphs were rejected because their channel reads spin: every shard and the engine burn 35-99%
of a core while idle, which a 2-core server cannot spare. When the engine runs on another node
than its shards (an offline engine on a head node), steps fall back to Ray actor calls.

Every shard's reply is watched, not only rank 0's: a rank that dies or raises mid-step leaves
its peers waiting in a collective, so the first failure anywhere kills the whole group at once
and the step raises ExecutorError (no hang); the engine then reports itself unhealthy and its
owner (a Serve replica) is replaced.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from raylane.actors.executor.base import ExecutorError, result_or_step_failed
from raylane.actors.executor.placement import ShardPlacement, place_shards, shard_bundle
from raylane.actors.executor.ray_calls import ensure_ray, gather
from raylane.actors.executor.step_channel import ShardFailed, StepChannels
from raylane.actors.models.weights import Payload
from raylane.actors.runner.config import RunnerConfig, RunnerInfo
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.shard import ModelShard

START_TIMEOUT_S = 600.0  # loading a big model slice on a slow disk
HEALTH_TIMEOUT_S = 60.0  # a busy node can be slow to answer; a dead shard fails at once


class RayExecutor:
    def __init__(self, config: RunnerConfig, shard_resources: dict[str, float] | None = None):
        import ray

        ensure_ray()
        self.world_size = config.tensor_parallel_size
        bundle = shard_bundle(
            shard_resources, config.device, ray.cluster_resources().get("GPU", 0) > 0
        )
        self._error: BaseException | None = None
        self.channels: StepChannels | None = None
        self._serving: list | None = None  # the shards' serve_steps calls, while they run
        self._collector = ThreadPoolExecutor(1, thread_name_prefix="raylane-step-collector")
        self._last: Future | None = None  # the newest step submitted
        self._rpcs = 0  # collective_rpc calls in flight (on another thread: a weight receive)
        self.placement: ShardPlacement | None = place_shards(bundle, self.world_size)
        self.shards = self._spawn(config, bundle)
        self.info = self._start()

    # --- start-up -----------------------------------------------------------------------------

    def _spawn(self, config: RunnerConfig, bundle: dict[str, float]) -> list:
        import ray
        import torch

        # the ranks split this process's thread budget (one per core is the fastest on CPU)
        threads = max(1, torch.get_num_threads() // self.world_size)
        actor = ray.remote(ModelShard)
        return [
            actor.options(
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                resources=_custom(bundle),
                max_restarts=0,
                scheduling_strategy=self._placement().strategy(rank),
            ).remote(config, rank, self.world_size, threads)
            for rank in range(self.world_size)
        ]

    def _start(self) -> RunnerInfo:
        import ray

        try:
            port = ray.get(self.shards[0].pick_port.remote(), timeout=START_TIMEOUT_S)
            infos = self._gather([s.start.remote(port) for s in self.shards], START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        if any(info != infos[0] for info in infos):
            self.shutdown()
            raise ExecutorError(f"shards disagree on the model: {infos}")
        try:
            self.channels = self._open_channels()
        except BaseException:
            self.shutdown()
            raise
        return infos[0]

    def _open_channels(self) -> StepChannels | None:
        """Step sockets when this process shares the shards' node, else None (Ray calls)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        nodes = self._gather([s.node_id.remote() for s in self.shards], START_TIMEOUT_S)
        if any(node != here for node in nodes):
            return None
        endpoints = self._gather(
            [s.open_step_channel.remote() for s in self.shards], START_TIMEOUT_S
        )
        return StepChannels(endpoints)

    # --- the protocol -------------------------------------------------------------------------

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        """Send the plan to every shard now; the future's result is read on the collector
        thread, in order (a shard takes its next plan off the socket as soon as it is done
        with the one before)."""
        self._raise_if_down()
        sent = time.perf_counter()
        channels = self.channels
        if channels is None:
            refs = [s.execute.remote(plan) for s in self.shards]
            wait = lambda: self._gather(refs, kill_on_error=True)[0]  # noqa: E731
        else:
            if self._serving is None:  # the shards' main threads take steps from the channel
                self._serving = [s.serve_steps.remote() for s in self.shards]
            self._on_channel(channels.send, plan)
            wait = lambda: self._on_channel(channels.collect_step, None)  # noqa: E731
        future = self._collector.submit(self._collect, wait, plan.step_id, sent)
        self._last = future
        return future

    def execute(self, plan: StepPlan) -> StepResult:
        return self.submit(plan).result()

    def _collect(self, wait, step_id: int, sent: float) -> StepResult:
        result = result_or_step_failed(wait(), f"step {step_id} failed")
        result.timings.update(sent_at=sent, received_at=time.perf_counter())
        return result

    def _quiesce(self) -> None:
        """Wait out the steps in flight (their futures report their own errors)."""
        if self._last is not None:
            wait([self._last])
            self._last = None

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `ModelRunner.<method>` on every rank; answers in rank order. An exception the
        method raises comes back as itself (the group stays up); a dead rank kills the group."""
        self._raise_if_down()
        self._quiesce()
        self._release_channel()
        self._rpcs += 1  # a long one (a weight receive) must not read as a dead shard
        try:
            return self._gather([s.rpc.remote(method, *args, **kwargs) for s in self.shards])
        finally:
            self._rpcs -= 1

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        import ray

        # once into the object store, read by every rank (each keeps only its slice)
        ref = ray.put(list(weights))
        self.collective_rpc("load_weights", ref)

    def load_weight_bucket(self, bucket: Payload | dict[str, Any]) -> None:
        import ray

        self.collective_rpc("weights.load_bucket", ray.put(bucket))  # stored once, read by all

    def check_health(self, ping: bool = True) -> None:
        """Raise ExecutorError when the group is down; with `ping`, unless every rank answers
        (a shard that died while idle is seen here, not only by the next step). A ping is
        answered on the shard's Ray thread, beside a step running on its channel thread."""
        self._raise_if_down()
        if not ping or self._rpcs or (self._last is not None and not self._last.done()):
            return  # a step or call in flight reports a dead shard itself
        if self._serving is not None:  # the shards take no Ray call while serving steps
            self._on_channel(self._channels().command, "ping")
        else:
            self._gather(
                [s.ping.remote() for s in self.shards], HEALTH_TIMEOUT_S, kill_on_error=True
            )

    def _channels(self) -> StepChannels:
        if self.channels is None:  # serving steps means they were opened
            raise ExecutorError("the shards' step channels are not open")
        return self.channels

    def _placement(self) -> ShardPlacement:
        if self.placement is None:
            raise ExecutorError("the executor is shut down")
        return self.placement

    def _on_channel(self, call, arg):
        try:
            return call(arg)
        except ShardFailed as e:
            if self._error is not None:  # the other thread failed the group first (a rank's
                # error on collect), closing the sockets this call then found closed: that
                # error is the cause, not this call's EBADF
                raise ExecutorError(f"a shard failed: {self._error}") from self._error
            self._fail(e)
            raise ExecutorError(f"a shard failed: {e}") from e

    def _release_channel(self) -> None:
        """End the shards' serve_steps calls so they take Ray calls again."""
        if self._serving is None:
            return
        self._on_channel(self._channels().command, "release")
        serving, self._serving = self._serving, None
        self._gather(serving, HEALTH_TIMEOUT_S, kill_on_error=True)

    def _raise_if_down(self) -> None:
        if self._error is not None:
            raise ExecutorError(f"the shard group is down: {self._error}") from self._error

    def shutdown(self) -> None:
        """Kill every shard and remove the placement group we made (idempotent)."""
        self._error = self._error or ExecutorError("the executor was shut down")
        self._kill()
        self._collector.shutdown(wait=False)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._kill()

    def _kill(self) -> None:
        import ray

        shards, self.shards = getattr(self, "shards", []), []
        placement, self.placement = self.placement, None
        if self.channels is not None:
            self.channels.close()
            self.channels = None
        self._serving = None
        if not ray.is_initialized():
            return
        for shard in shards:
            ray.kill(shard, no_restart=True)
        if placement is not None:
            placement.release()

    # --- waiting on every rank ----------------------------------------------------------------

    def _gather(
        self, refs: list, timeout_s: float | None = None, kill_on_error: bool = False
    ) -> list:
        """Wait for every rank (`ray_calls.gather`); a dead rank ends the group."""
        return gather(refs, self._fail, timeout_s, kill_on_error)


def _custom(bundle: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
