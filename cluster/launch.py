"""Start (or join) Ray with safe local defaults and run the Serve application."""

from __future__ import annotations

import os
import time
import urllib.request

# Safe local defaults: bind to loopback, no auth tokens, no usage reporting.
for _key, _value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                     ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_key, _value)

APP_NAME = "raylane"


def start_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace="raylane")
    else:
        # address="local": always a fresh cluster, never one someone else started
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 namespace="raylane", log_to_driver=False)


def deploy(config, model_dir: str | None = None) -> str:
    """Deploy the application on the running Ray cluster; returns the base URL. With a
    `consolidation:` section, then start the consolidation actor against that URL.

    ValueError, before anything is deployed, when no node can hold one engine replica (and,
    after, when the consolidation database cannot be reached)."""
    from ray import serve

    from cluster.consolidation import start_consolidation
    from cluster.serve import build_application, served_model_name

    app = build_application(config, model_dir)
    serve.start(http_options={"host": config.host, "port": config.port})
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
