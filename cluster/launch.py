"""Start (or join) Ray with safe local defaults and run the Serve application."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.request

# Safe local defaults: bind to loopback, no auth tokens, no usage reporting.
for _key, _value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                     ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_key, _value)

APP_NAME = "raylane"
# Ray starts its workers at nice 15, below the driver, GCS and raylet: on a busy machine every
# wake-up of those (and of a load generator) preempts the engine replica, whose OpenMP threads
# run in lock-step, so one preempted thread stalls both. At nice 0 with everything else, `bench
# serve` kept 81% of the offline engine's tok/s against 64-68% (2 cores, direct ingress, same
# hour). Only the replica at nice 0 was worse: the ingress and proxy starved (TTFT 3 s).
WORKER_PRIORITY_ENV = {"RAY_worker_niceness": "0"}


def start_ray(address: str | None = None, num_cpus: int | None = None,
              direct_ingress_port: int | None = None) -> None:
    """Join `address`, or start a fresh local cluster; with `direct_ingress_port`, one whose
    Serve ingress replica serves HTTP on that port itself (`direct_ingress_env`)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        if direct_ingress_port is not None:
            raise ValueError("direct ingress needs the local cluster raylane starts")
        ray.init(address=address, namespace="raylane")
        return
    env = dict(WORKER_PRIORITY_ENV)
    if direct_ingress_port is not None:
        env.update(direct_ingress_env(direct_ingress_port))
    with _environment(env):  # read by the raylet, whose workers (Serve's actors) inherit it
        # address="local": always a fresh cluster, never one someone else started
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 namespace="raylane", log_to_driver=False)


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's direct ingress on one node: the ingress replica runs the HTTP server on
    `port` (the only port in its range), so a streamed token goes replica -> client instead of
    replica -> proxy actor -> client (measured: the proxy and the ingress's side of that hop
    took ~0.7 ms of CPU each per token). No load balancer sits in front, so a released port
    needs no quarantine or draining period."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def deploy(config, model_dir: str | None = None) -> str:
    """Deploy the application on the running Ray cluster; returns the base URL. With a
    `consolidation:` section, then start the consolidation actor against that URL.

    ValueError, before anything is deployed, when no node can hold one engine replica (and,
    after, when the consolidation database cannot be reached)."""
    from ray import serve

    from cluster.consolidation import start_consolidation
    from cluster.serve import build_application, served_model_name

    app = build_application(config, model_dir)
    # with direct ingress the ingress replica takes config.port; Serve still starts a proxy
    # on the head node, which then listens on a spare port
    proxy_port = free_port(config.host) if config.direct_ingress else config.port
    serve.start(http_options={"host": config.host, "port": proxy_port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{config.host}:{config.port}"
    wait_healthy(url, api_keys=config.api_keys)
    # after the health check: the actor's first pass asks this endpoint at once
    start_consolidation(config, url, served_model_name(config))
    return url


def wait_healthy(url: str, timeout_s: float = 300.0, api_keys=()) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")


def shutdown() -> None:
    import ray
    from ray import serve

    from cluster.consolidation import stop_consolidation
    from router.actor import NAMESPACE, ROUTER_NAME

    try:  # first: its LLM calls go to the endpoint stopped below
        stop_consolidation()
    except Exception:  # nothing to stop
        pass
    try:
        serve.shutdown()
        ray.kill(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))
    except Exception:  # nothing to stop
        pass
    ray.shutdown()
