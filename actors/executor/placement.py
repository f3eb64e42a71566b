"""Where a shard group runs: one placement-group bundle per rank, all on one node.

Outside Ray Serve the executor makes its own STRICT_PACK placement group. Inside a Serve replica
that asked for `placement_group_bundles` (bundle 0 is the replica's own, then one per rank) the
shards take bundles 1..N of the replica's group, so a replica and its shards are placed, and
freed, together; no placement group is ever nested in another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REPLICA_BUNDLE = {"CPU": 0.01}  # the Serve replica's own bundle (it runs no model)
DEFAULT_CPU_SHARD = {"CPU": 0.1}  # fractional: ranks share the cores of a CPU node
DEFAULT_GPU_SHARD = {"GPU": 1.0}


def shard_bundle(
    resources: dict[str, float] | None, device: str, cluster_has_gpus: bool
) -> dict[str, float]:
    """The Ray resources of one rank's bundle: as configured, else one GPU on a GPU device and a
    tenth of a CPU on a CPU one."""
    if resources:
        return {k: float(v) for k, v in resources.items()}
    gpu = device.startswith("cuda") or (device == "auto" and cluster_has_gpus)
    return dict(DEFAULT_GPU_SHARD if gpu else DEFAULT_CPU_SHARD)


def replica_bundles(shard: dict[str, float], world_size: int) -> list[dict[str, float]]:
    """A Serve replica's `placement_group_bundles` for a shard group: the replica's own bundle,
    then one per rank (the layout `place_shards` expects inside a replica)."""
    return [dict(REPLICA_BUNDLE)] + [dict(shard) for _ in range(world_size)]


def total(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            out[key] = out.get(key, 0.0) + value
    return out


def check_fits_one_node(
    bundles: list[dict[str, float]], nodes: list[dict[str, Any]], what: str
) -> None:
    """ValueError naming the shortfall when no alive node could hold all `bundles` at once.

    `nodes` as `ray.nodes()` returns them (their total resources, not what is free now: a
    group that fits a node's total waits for running work instead of failing).
    """
    need = total(bundles)
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", n.get("alive", False))]
    if any(all(res.get(k, 0.0) >= v for k, v in need.items()) for res in alive):
        return
    wanted = ", ".join(f"{v:g} {k}" for k, v in sorted(need.items()))
    best = {k: max((res.get(k, 0.0) for res in alive), default=0.0) for k in need}
    short = ", ".join(
        f"{k}: needs {need[k]:g}, the largest node has {best[k]:g}"
        for k in sorted(need)
        if best[k] < need[k]
    )
    raise ValueError(
        f"{what} needs {wanted} on one node (a tensor-parallel group never spans "
        f"nodes), but no node has that much ({short or 'not all at once'}); lower "
        f"tensor_parallel_size or the per-shard resources, or add bigger nodes"
    )


@dataclass
class ShardPlacement:
    """The placement group the ranks run in and the bundle of rank 0."""

    group: Any  # ray.util.placement_group.PlacementGroup
    first_bundle: int
    owned: bool  # made by the executor (so it removes it) or the Serve replica's

    def strategy(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.first_bundle + rank,
            placement_group_capture_child_tasks=False,
        )

    def release(self) -> None:
        if self.owned:
            from ray.util import remove_placement_group

            remove_placement_group(self.group)


def place_shards(
    bundle: dict[str, float], world_size: int, timeout_s: float = 300.0
) -> ShardPlacement:
    """Reuse the current Serve replica's placement group when it was made for the shards,
    else make a STRICT_PACK group of `world_size` bundles and wait until it is placed."""
    import ray
    from ray.util import get_current_placement_group, placement_group

    current = get_current_placement_group()
    if current is not None:
        _check_replica_group(current.bundle_specs, bundle, world_size)
        return ShardPlacement(current, 1, owned=False)
    bundles = [dict(bundle) for _ in range(world_size)]
    check_fits_one_node(bundles, ray.nodes(), f"tensor_parallel_size={world_size}")
    group = placement_group(bundles, strategy="STRICT_PACK", name="")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util import remove_placement_group

        remove_placement_group(group)
        raise RuntimeError(
            f"the {world_size} shards ({bundle} each) found no room on one node "
            f"within {timeout_s:.0f} s: other work holds the resources"
        ) from None
    return ShardPlacement(group, 0, owned=True)


def _check_replica_group(
    specs: list[dict[str, float]], bundle: dict[str, float], world_size: int
) -> None:
    """ValueError unless bundles 1..world_size of the current group each hold one shard: a
    shard asking for more than its bundle has would wait forever instead of starting."""
    if len(specs) < world_size + 1:
        raise ValueError(
            f"the current placement group has {len(specs)} bundles; "
            f"tensor_parallel_size={world_size} needs {world_size + 1} "
            "(the replica's, then one per shard)"
        )
    for index in range(1, world_size + 1):
        if any(specs[index].get(k, 0.0) < v for k, v in bundle.items() if v > 0):
            raise ValueError(
                f"bundle {index} of the current placement group ({specs[index]}) "
                f"cannot hold a shard needing {bundle}; deploy the replica with "
                "placement_group_bundles=replica_bundles(shard, world_size)"
            )
