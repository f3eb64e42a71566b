"""A local Ray cluster with the raylane Serve application on a free loopback port."""

from __future__ import annotations

import os
import socket

import pytest

for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                   ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(key, value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from cluster import launch

    launch.start_ray(num_cpus=2)
    yield ray
    launch.shutdown()


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_llama_dir):
    """Two engine replicas of the tiny Llama behind the HTTP ingress; yields (url, config)."""
    from cluster import launch
    from cluster.config import ClusterConfig

    config = ClusterConfig(model=tiny_llama_dir, served_model_name="tiny", replicas=2,
                           port=free_port(), torch_threads=1,
                           engine={"num_kv_blocks": 256, "max_num_seqs": 32})
    url = launch.deploy(config)
    yield url, config
