"""verl's rollout contract over raylane (verl 0.9's `verl.workers.rollout.replica`).

- `RaylaneRolloutServer` answers the calls verl makes on a rollout server's Ray handle:
  `generate(prompt_ids, sampling_params, request_id, ...)` -> verl's `TokenOutput` (token ids,
  log probs, routed experts, stop reason), `abort_all_requests` / `resume_generation`,
  `abort_request`, `sleep` / `wake_up`, `clear_kv_cache`, `release_kv_cache` /
  `resume_kv_cache`, `set_global_steps`, `get_server_address`.
- `RaylaneReplica` (`replica.py`) is the `RolloutReplica` verl's registry builds for
  `actor_rollout_ref.rollout.name=raylane`: raylane runs its own engines, so it serves in
  verl's standalone mode only, one server actor per replica over a running raylane cluster
  (over HTTP at `engine_kwargs.raylane.address`, else over Ray handles inside the cluster).

verl imports this module through its `verl.plugins` entry point (pyproject.toml), which
registers the replica; importing it registers it too. verl is an optional dependency: without
it this module imports, `register()` answers False and the server cannot build its outputs.

>>> server = RaylaneRolloutServer.over_http("http://raylane:8000", ServerDefaults(1024))
>>> out = await server.generate([1, 2, 3], {"temperature": 1.0, "logprobs": True}, "req-0")
>>> out.token_ids, out.log_probs, out.stop_reason
"""

from __future__ import annotations

from raylane.integrations.verl.control import PlaneControl, RoutesControl
from raylane.integrations.verl.server import (
    STOP_REASONS,
    RaylaneRolloutServer,
    ServerDefaults,
)

NAME = "raylane"  # actor_rollout_ref.rollout.name

__all__ = [
    "NAME",
    "STOP_REASONS",
    "PlaneControl",
    "RaylaneRolloutServer",
    "RoutesControl",
    "ServerDefaults",
    "register",
]


def register() -> bool:
    """Register `RaylaneReplica` with verl's `RolloutReplicaRegistry` as "raylane"; False when
    verl is not importable."""
    try:
        from verl.workers.rollout.replica import RolloutReplicaRegistry
    except ImportError:
        return False
    RolloutReplicaRegistry.register(NAME, _load_replica)
    return True


def _load_replica() -> type:
    from raylane.integrations.verl.replica import RaylaneReplica

    return RaylaneReplica


register()
