"""How many times one streamed request crosses processes on the real serving path: the ingress's
request path (`ReplicaRequests`, run here, in the test's process, on the served app's Router and
replicas), counting every Ray actor call this process makes while the request runs.

Once the process holds the replica table and the replica's output channel (both opened by the
first request, then kept), a request is one call (`submit`: ingress -> replica, and its answer)
plus its outputs on the already open channel (replica -> ingress): no call to the Router, none
per token."""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import aclosing
from unittest import mock

import pytest


@pytest.fixture
def backend(served, ray_cluster, tiny_llama_dir):
    from raylane.router.names import NAMESPACE, ROUTER_NAME
    from raylane.router.replica_requests import ReplicaRequests
    from raylane.serve_backend import router_view

    router = ray_cluster.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    view = router_view(router, 256)
    view.refresh_s = 3600.0  # the background refresh is not per request: keep it out of the count
    return ReplicaRequests(view)


def count_calls():
    """A patch that counts this process's actor calls by method name."""
    from ray.actor import ActorMethod

    calls: Counter[str] = Counter()
    real = ActorMethod._remote

    def counted(self, *args, **kwargs):
        calls[self._method_name] += 1
        return real(self, *args, **kwargs)

    return calls, mock.patch.object(ActorMethod, "_remote", counted)


async def stream_one(requests, request_id: str, max_tokens: int) -> int:
    from raylane.actors.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = 0
    async with aclosing(requests.generate([5, 6, 7, 8], params, request_id, "hops")) as stream:
        async for _ in stream:
            outputs += 1
    return outputs


def test_a_streamed_request_is_one_call_to_its_replica_and_none_per_token(backend):
    async def main():
        await stream_one(backend, "warm", 4)  # fetches the table, opens the channel
        counts = {}
        for max_tokens in (4, 24):
            calls, patch = count_calls()
            with patch:
                outputs = await stream_one(backend, f"hops-{max_tokens}", max_tokens)
            assert outputs >= 2  # streamed: several outputs arrived
            counts[max_tokens] = dict(calls)
        return counts

    counts = asyncio.run(main())
    # ingress -> replica (submit), replica -> ingress (its outputs on the open channel)
    assert counts[4] == {"submit": 1}, counts
    assert counts[24] == counts[4]  # six times the tokens, not one call more
