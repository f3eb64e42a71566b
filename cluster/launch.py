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
# Ray's and Serve's background loops, slowed or off on a local cluster. Every wake-up of them
# preempts one of the replica's lock-step OpenMP threads and so stalls both: an idle `raylane
# serve` burned 12% of one core (Serve's controller alone 3%), with these 7%, and `bench serve`
# kept 74-75% of the offline engine instead of 69% (78-80% instead of 74-75% with direct
# ingress; 2 cores, one hour).
# A user's own setting of any of them wins.
CONTROL_PLANE_ENV = {
    # Serve's controller reconciles every 0.5 s instead of 0.1 s (a dead replica is seen by
    # then; health checks run every 10 s anyway)
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Ray's own metrics pipeline: raylane's /metrics is built from the engines' snapshots
    "RAY_enable_metrics_collection": "0",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "10000",
    # task events feed the dashboard's state API, which a local cluster does not start
    "RAY_task_events_report_interval_ms": "0",
    # one node: the raylet's resource reports to the GCS have no one to inform sooner
    "RAY_raylet_report_resources_period_milliseconds": "1000",
}


def start_ray(address: str | None = None, num_cpus: int | None = None,
              direct_ingress_port: int | None = None) -> None:
    """Join `address`, or start a fresh local cluster (its workers at nice 0 and its background
    loops slowed: `WORKER_PRIORITY_ENV`, `CONTROL_PLANE_ENV`); with `direct_ingress_port`, one
    whose Serve ingress replica serves HTTP on that port itself (`direct_ingress_env`)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        if direct_ingress_port is not None:
            raise ValueError("direct ingress needs the local cluster raylane starts")
        ray.init(address=address, namespace="raylane")
        return
    env = {key: value for key, value in {**WORKER_PRIORITY_ENV, **CONTROL_PLANE_ENV}.items()
           if key not in os.environ}
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
