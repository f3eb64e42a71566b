"""A Ray Serve request router that delivers each request to the replica the Router chose.

The ingress asks the Router actor for a replica id and passes it as the `target_replica`
keyword of the deployment call; this hook, running inside the caller, hands Serve that replica.
When the target is gone (restarted, removed), it falls back to the least-queued candidates.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

IMPORT_PATH = "router.serve_router:TargetedRequestRouter"


class TargetedRequestRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("target_replica") if pending_request else None
        if target is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
        queue = self._replica_queue_len_cache.get
        return [sorted(candidate_replicas, key=lambda r: queue(r.replica_id) or 0)]
