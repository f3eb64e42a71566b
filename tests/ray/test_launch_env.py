"""A local cluster's workers run at nice 0 with Ray's and Serve's background loops slowed
(`launch.WORKER_PRIORITY_ENV`, `launch.CONTROL_PLANE_ENV`), a user's own setting wins, and the
driver's environment is left as it was."""

from __future__ import annotations

import os

import psutil
import pytest
from raylane import launch

from tests.support import ray_cluster as shared_ray

USER_KEY = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
pytestmark = pytest.mark.own_ray_cluster


@pytest.fixture(scope="module")
def worker_env():
    import ray

    shared_ray.leave_shared()  # this module's cluster starts with its own environment
    os.environ[USER_KEY] = "0.25"
    try:
        launch.start_ray(num_cpus=1)
        env = dict(os.environ)

        @ray.remote(num_cpus=0)
        def probe() -> tuple[int, dict[str, str]]:
            return os.nice(0), dict(os.environ)

        raylets = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
        assert len(raylets) == 1, raylets
        yield env, ray.get(probe.remote()), raylets[0].environ()
    finally:
        os.environ.pop(USER_KEY)
        launch.shutdown()


def test_workers_get_the_priority_and_the_slowed_loops(worker_env):
    _, (niceness, env), raylet_env = worker_env
    assert niceness == 0
    for key, value in launch.CONTROL_PLANE_ENV.items():
        if key != USER_KEY:
            assert env.get(key) == value, key
            # the raylet reads its own timers (RAY_raylet_*, RAY_memory_monitor_*, ...) from
            # its environment at start, and starts the dashboard agent with it
            assert raylet_env.get(key) == value, key


def test_a_users_own_setting_wins_and_the_driver_keeps_its_environment(worker_env):
    driver, (_, env), _ = worker_env
    assert env[USER_KEY] == "0.25"
    assert driver[USER_KEY] == "0.25"
    for key in (*launch.CONTROL_PLANE_ENV, *launch.WORKER_PRIORITY_ENV):
        if key != USER_KEY:
            assert key not in driver, key
