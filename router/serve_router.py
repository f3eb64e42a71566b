"""A Ray Serve request router that delivers each request to the replica the Router chose.

The ingress asks the Router actor for a replica id and passes it as the `target_replica`
keyword of the deployment call; this hook, running inside the caller, hands Serve that replica.
When the target is gone (restarted, removed), a request falls back to the least-queued
candidates. A control call (pause, a weight bucket, ...; see router/control.py) must reach its
own replica, never another one in its place: it waits up to `CONTROL_GRACE_S` for the caller's
handle to learn of its target (a handle the Router just received knows no replica yet), and
only then falls back.

Serve gives a chosen replica to a pending request by its own rule, which here must respect the
targets: FIFOMixin hands it to the oldest pending request (two calls in flight to two targets
could swap replicas: seen, a weight update's finish reached one replica twice and the other
never), and the default matches the internal request id, which every call made while serving
one HTTP request shares (one of them would wait forever). `_fulfill_next_pending_request`
below hands it to the request it was chosen for, else the oldest request it may serve; it
uses the same private parts of RequestRouter that FIFOMixin does (Ray 2.60).
"""

from __future__ import annotations

import time

from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

IMPORT_PATH = "raylane.router.serve_router:TargetedRequestRouter"
CONTROL_METHODS = frozenset(
    {
        "pause",
        "resume",
        "weight_version",
        "begin_weight_update",
        "load_weight_bucket",
        "finish_weight_update",
        "abort",
        "flush_cache",
        "arm_fault",
    }
)
CONTROL_GRACE_S = 30.0


class TargetedRequestRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = _target(pending_request) if pending_request else None
        if target is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
            if _must_wait(pending_request):
                # none now: Serve retries (with backoff) as its replica list updates
                pending_request.routing_context.should_backoff = True
                return []
        queue = self._replica_queue_len_cache.get
        return [sorted(candidate_replicas, key=lambda r: queue(r.replica_id) or 0)]

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: RequestMetadata | None = None
    ) -> None:
        pending = [p for p in self._pending_requests_to_fulfill if not p.future.done()]
        known = {r.replica_id.unique_id for r in self._replicas_list}
        chosen_for = [p for p in pending if p.metadata is request_metadata]
        for request in chosen_for + pending:
            if _may_serve(request, replica.replica_id.unique_id, known):
                self._pending_requests_to_fulfill.remove(request)
                self._cancel_routing_task_for_pending_request(request)
                self._record_queue_wait_time(request)
                request.future.set_result(replica)
                self._remove_pending_request_from_indices(request)
                return


def _target(request: PendingRequest) -> str | None:
    return request.kwargs.get("target_replica")


def _must_wait(request: PendingRequest) -> bool:
    return (
        request.metadata.call_method in CONTROL_METHODS
        and time.time() - request.created_at < CONTROL_GRACE_S
    )


def _may_serve(request: PendingRequest, replica_id: str, known: set[str]) -> bool:
    """The replica is the request's target, or any replica will do: it has none, or its
    target is unknown here and it may fall back."""
    target = _target(request)
    if target is None or target == replica_id:
        return True
    return target not in known and not _must_wait(request)
