"""One local Ray cluster for the whole test session.

Starting Ray costs seconds of CPU on a 2-core machine, so every module that can share a cluster
shares one: `start()` starts it on first use (or again after a module that needed a cluster of
its own shut it down), and `stop_apps()` runs after each module, stopping what the module
deployed (Serve apps, the Router and its replicas, the consolidation actor) while Ray stays up.
"""

from __future__ import annotations

import os
from unittest import mock

ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
NUM_CPUS = 2
starts = 0  # how many times this session started Ray (reported at the end of the run)


def set_env() -> None:
    """Ray's settings for a test machine (a user's own values win)."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)


def start():
    """The shared cluster, started if Ray is not up: `launch.start_ray`'s local defaults (no
    dashboard, workers at nice 0, slowed background loops), `NUM_CPUS` CPUs."""
    global starts
    import ray
    from raylane import launch

    set_env()
    if not ray.is_initialized():
        launch.start_ray(num_cpus=NUM_CPUS)
        starts += 1
    return ray


def stop_apps() -> None:
    """Everything `launch.shutdown()` stops, except Ray itself: whatever the launcher starts,
    its shutdown knows how to stop, so this reuses it rather than a copy of its steps."""
    import ray
    from raylane import launch

    if not ray.is_initialized():  # the module shut the cluster down itself
        return
    with mock.patch.object(ray, "shutdown"):
        launch.shutdown()


def leave_shared() -> None:
    """For a module that needs a cluster of its own (other CPUs, other environment, Serve's
    proxies started differently): shut the shared one down; the next module starts it again."""
    import ray
    from raylane import launch

    if ray.is_initialized():
        launch.shutdown()
