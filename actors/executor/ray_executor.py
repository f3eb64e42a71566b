"""The Ray executor: a group of `ModelShard` actors, one per tensor-parallel rank, on one node.

Dispatch (engine -> every shard -> rank 0's result back) is a plain actor call per shard per
step; see DISPATCH below for the measurements behind that choice. Every shard's reply is watched,
not only rank 0's: a rank that dies or raises mid-step leaves its peers waiting in a collective,
so the first failure anywhere kills the whole group at once and the step raises ExecutorError
(no hang); the engine then reports itself unhealthy and its owner (a Serve replica) is replaced.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from actors.executor.base import ExecutorError
from actors.executor.placement import ShardPlacement, place_shards, shard_bundle
from actors.runner.config import RunnerConfig, RunnerInfo
from actors.runner.plan import StepPlan, StepResult
from actors.shard import ModelShard

DISPATCH = """(filled in from measurements)"""

START_TIMEOUT_S = 600.0  # loading a big model slice on a slow disk


class RayExecutor:
    def __init__(self, config: RunnerConfig, shard_resources: dict[str, float] | None = None):
        import ray

        ensure_ray()
        self.world_size = config.tensor_parallel_size
        bundle = shard_bundle(shard_resources, config.device,
                              ray.cluster_resources().get("GPU", 0) > 0)
        self._error: BaseException | None = None
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
        return [actor.options(num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0),
                              resources=_custom(bundle), max_restarts=0,
                              scheduling_strategy=self.placement.strategy(rank))
                .remote(config, rank, self.world_size, threads)
                for rank in range(self.world_size)]

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
        return infos[0]

    # --- the protocol -------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        self.check_health()
        sent = time.perf_counter()
        results = self._gather([s.execute.remote(plan) for s in self.shards], kill_on_error=True)
        result = results[0]
        result.timings.update(sent_at=sent, received_at=time.perf_counter())
        return result

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `ModelRunner.<method>` on every rank; answers in rank order. An exception the
        method raises comes back as itself (the group stays up); a dead rank kills the group."""
        self.check_health()
        return self._gather([s.rpc.remote(method, *args, **kwargs) for s in self.shards])

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        import ray

        # once into the object store, read by every rank (each keeps only its slice)
        ref = ray.put(list(weights))
        self.collective_rpc("load_weights", ref)

    def check_health(self) -> None:
        if self._error is not None:
            raise ExecutorError(f"the shard group is down: {self._error}") from self._error

    def shutdown(self) -> None:
        """Kill every shard and remove the placement group we made (idempotent)."""
        self._error = self._error or ExecutorError("the executor was shut down")
        self._kill()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._kill()

    def _kill(self) -> None:
        import ray

        shards, self.shards = getattr(self, "shards", []), []
        placement, self.placement = self.placement, None
        if not ray.is_initialized():
            return
        for shard in shards:
            ray.kill(shard, no_restart=True)
        if placement is not None:
            placement.release()

    # --- waiting on every rank ----------------------------------------------------------------

    def _gather(self, refs: list, timeout_s: float | None = None,
                kill_on_error: bool = False) -> list:
        """Wait for every rank; the first failure anywhere raises at once."""
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        try:
            while pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, pending = ray.wait(pending, num_returns=1, timeout=left)
                if not ready:
                    raise TimeoutError(f"shards did not answer within {timeout_s:.0f} s")
                ray.get(ready)  # raises a failed rank's error while its peers still wait
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            if kill_on_error:
                self._fail(e)
                raise ExecutorError(f"a shard failed mid-step: {e.cause!r}") from e
            _drain(refs)  # the same error on the other ranks: read it, or Ray logs it as unhandled
            raise e.as_instanceof_cause() from None
        except (ray.exceptions.RayActorError, TimeoutError) as e:
            self._fail(e)
            raise ExecutorError(f"a shard died: {e}") from e


def ensure_ray() -> None:
    """Connect to `RAY_ADDRESS` if set, else start a light local Ray (never someone else's)."""
    import ray

    if ray.is_initialized():
        return
    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                 log_to_driver=False)


def _drain(refs: list) -> None:
    import ray

    for ref in refs:
        try:
            ray.get(ref)
        except Exception:  # noqa: S110 (the first error is the one raised)
            pass


def _custom(bundle: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
