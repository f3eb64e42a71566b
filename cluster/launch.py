"""Start (or join) Ray with safe local defaults and run the Serve application."""

from __future__ import annotations

import contextlib
import os
import socket

from raylane.router.names import NAMESPACE

# Safe local defaults: bind to loopback, no auth tokens, no usage reporting.
for _key, _value in (
    ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
    ("RAY_AUTH_MODE", "disabled"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
):
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
    # the log monitor looks for new log files every 5 s instead of globbing the session's log
    # folder every 0.1 s (it burned 0.7% of one core on an idle cluster, 0.3% with this)
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "1",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    # the raylet's own timers at 1 s instead of 100-250 ms: the global-GC check, the OOM
    # monitor's memory reads (Ray kills a task over its memory threshold up to 1 s later), idle
    # worker reaping, the object manager's pull/push retries (one node: no transfers) and the
    # disk-full check; the dashboard agent's node report (for a dashboard a local cluster does
    # not start) every 60 s instead of 5 s and its raylet liveness check every 2 s instead of
    # 0.4 s. An idle `raylane serve` went from 7.0 to 6.0 CPU s a minute (docs/benchmarks.md).
    "RAY_raylet_check_gc_period_milliseconds": "1000",
    "RAY_memory_monitor_refresh_ms": "1000",
    "RAY_kill_idle_workers_interval_ms": "1000",
    "RAY_object_manager_timer_freq_ms": "1000",
    "RAY_local_fs_monitor_interval_ms": "1000",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "RAY_DASHBOARD_AGENT_CHECK_PARENT_INTERVAL_S": "2",
}


def start_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join `address`, or start a fresh local cluster (its workers at nice 0 and its background
    loops slowed: `WORKER_PRIORITY_ENV`, `CONTROL_PLANE_ENV`)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace=NAMESPACE)
        return
    env = {
        key: value
        for key, value in {**WORKER_PRIORITY_ENV, **CONTROL_PLANE_ENV}.items()
        if key not in os.environ
    }
    with _environment(env):  # read by the raylet, whose workers (Serve's actors) inherit it
        # address="local": always a fresh cluster, never one someone else started
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            namespace=NAMESPACE,
            log_to_driver=False,
        )


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


def check_port_free(host: str, port: int) -> None:
    """ValueError naming the port when another program listens on it: the server raylane
    starts there would otherwise never come up, or another one would answer in its place."""
    from raylane.listener import bind_socket

    try:
        bind_socket(host, port).close()
    except OSError as e:
        raise ValueError(
            f"cannot listen on {host}:{port} ({e.strerror}): stop what holds "
            f"it or pick another port (--port)"
        ) from e


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
    from raylane.consolidation import start_consolidation
    from raylane.listener import wait_healthy
    from raylane.serve import build_application, served_model_name

    config = config.resolved()
    if config.ray_address is None:  # this machine's port: say it is taken before deploying
        check_port_free(config.host, config.port)
    app = build_application(config, model_dir)
    if config.direct_ingress:  # the ingress replica answers on config.port itself
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{config.host}:{config.port}"
    wait_healthy(url, api_keys=config.api_keys)
    # after the health check: the actor's first pass asks this endpoint at once
    start_consolidation(config, url, served_model_name(config))
    return url


def shutdown() -> None:
    import ray
    from ray import serve
    from raylane.consolidation import stop_consolidation
    from raylane.router.names import NAMESPACE, ROUTER_NAME

    try:  # first: its LLM calls go to the endpoint stopped below
        stop_consolidation()
    except Exception:  # nothing to stop
        pass
    try:
        serve.shutdown()
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        # its replicas are detached actors: they would outlive it
        ray.get(router.stop_replicas.remote(), timeout=60)
        ray.kill(router)
    except Exception:  # nothing to stop
        pass
    ray.shutdown()
