"""An engine that fails under load: its in-flight requests end with a clear 5xx body, and the
endpoint keeps serving (issue 14).

Two replicas of the tiny Llama, three clients in a loop. (a) A forward fault injected into one
replica's engine fails only the requests of that step (500, code "request_failed"); the replica
stays registered and serves on. (b) A replica actor killed outright: every request meanwhile is
200 or 503 (never another 5xx, never a hang), and the Router brings a replacement up.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
from raylane.router.actor import NAMESPACE, ROUTER_NAME

from tests.ray.conftest import keys_owned, wait_for, wait_healthy
from tests.ray.replica_helpers import replica_actor
from tests.support.faults import arm_replica_fault


@dataclass
class Load:
    """Clients posting short completions in a loop until stopped; records every outcome."""

    url: str
    clients: int = 3
    codes: list[int] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # the bodies of the non-200 answers
    broken: list[str] = field(default_factory=list)  # transport errors (a hang times out)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Load:
        self.threads = [
            threading.Thread(target=self._client, args=(i,)) for i in range(self.clients)
        ]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self.stop.is_set():
                body = {
                    "model": "tiny",
                    "prompt": f"client {i} request {n}",
                    "max_tokens": 4,
                    "temperature": 0,
                }
                n += 1
                try:
                    resp = client.post(f"{self.url}/v1/completions", json=body)
                except httpx.HTTPError as e:
                    self.broken.append(repr(e))
                    continue
                self.codes.append(resp.status_code)
                if resp.status_code != 200:
                    self.errors.append(resp.json())


def completion(url: str, key: str | None = None) -> httpx.Response:
    headers = {"x-routing-key": key} if key else {}
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def test_forward_fault_fails_its_requests_and_the_replica_serves_on(served, ray_cluster):
    url, _ = served
    ray = ray_cluster
    ids = wait_healthy(ray, 2)
    with Load(url) as load:
        time.sleep(1.0)
        assert set(load.codes) == {200}, load.errors
        ray.get(arm_replica_fault(replica_actor(ray, ids[0]), "forward", 2), timeout=60)
        wait_for(lambda: 500 in load.codes, 30, "a request failed by the injected fault")
        time.sleep(1.0)
    assert not load.broken, load.broken
    assert set(load.codes) == {200, 500}, load.codes
    for body in load.errors:
        assert body["error"]["code"] == "request_failed", body
        assert body["error"]["type"] == "server_error", body
        assert "injected fault in forward" in body["error"]["message"], body
    assert load.codes.count(500) <= 2 * load.clients  # only the two faulty steps' requests
    assert wait_healthy(ray, 2) == ids  # still registered, not replaced
    for key in keys_owned(ids, 2):  # the faulty replica included
        resp = completion(url, key)
        assert resp.status_code == 200, resp.text


def test_killed_replica_fails_cleanly_and_is_replaced(served, ray_cluster):
    url, _ = served
    ray = ray_cluster
    ids = wait_healthy(ray, 2)
    victim_id = ids[0]
    with Load(url) as load:
        time.sleep(1.0)
        ray.kill(replica_actor(ray, victim_id), no_restart=True)
        time.sleep(4.0)
    assert not load.broken, load.broken  # no hang, no dropped connection
    assert set(load.codes) <= {200, 503}, load.errors
    assert 200 in load.codes
    for body in load.errors:
        assert body["error"]["code"] == "replica_failed", body

    def replaced() -> bool:
        healthy = _healthy_ids(ray)
        return len(healthy) == 2 and victim_id not in healthy

    wait_for(replaced, 120, "the Router to replace the killed replica", poll_s=1.0)
    for key in keys_owned(wait_healthy(ray, 2), 2):
        resp = completion(url, key)
        assert resp.status_code == 200, resp.text


def _healthy_ids(ray) -> list[str]:
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return sorted(r["replica_id"] for r in ray.get(router.replicas.remote()) if r["healthy"])
