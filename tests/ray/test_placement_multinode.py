"""Shard-group placement across machines, simulated with `ray.cluster_utils.Cluster`: a head
with no CPUs (it runs the Router) and two 2-CPU worker nodes. This module makes its own Ray
cluster and shares it with no other module.

The Router places the engine replicas (router/replica_set.py) and the app's builder hands it
their spec, so the placement is checked without Serve's controller, proxy and ingress: on a
loaded 2-core machine they took minutes to start beside three raylets and four engine
processes, and add nothing to where the replicas go."""

from __future__ import annotations

import pytest
from raylane.router.names import NAMESPACE

from tests.ray.conftest import free_port, wait_registered
from tests.ray.test_serve_tp import REPLICA_CLASS, alive_actors, shard_groups

SMALL_STORE = 100 * 2**20
pytestmark = pytest.mark.own_ray_cluster


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster
    from raylane import launch

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "object_store_memory": SMALL_STORE,
        },
    )
    workers = [cluster.add_node(num_cpus=2, object_store_memory=SMALL_STORE) for _ in range(2)]
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    cluster.wait_for_nodes()
    yield {node.node_id for node in workers}
    launch.shutdown()
    cluster.shutdown()


def config(model_dir: str, **engine):
    from raylane.config import ClusterConfig

    return ClusterConfig(
        model=model_dir,
        served_model_name="tiny",
        replicas=2,
        torch_threads=1,
        port=free_port(),
        engine={"num_kv_blocks": 64, **engine},
    )


def test_a_replica_bigger_than_any_node_fails_before_deploying(two_nodes, tiny_llama_dir):
    from raylane import launch
    from raylane.actors.engine import EngineConfig, LLMEngine

    big = {"tensor_parallel_size": 2, "shard_resources": {"CPU": 1.5}}
    with pytest.raises(ValueError, match=r"CPU: needs 3\.01, the largest node has 2"):
        launch.deploy(config(tiny_llama_dir, **big))
    assert alive_actors("ServeController") == []  # nothing was started
    # the offline engine, placing its own group, refuses the same way
    with pytest.raises(ValueError, match=r"CPU: needs 3, the largest node has 2"):
        LLMEngine(EngineConfig(model=tiny_llama_dir, **big))


def test_groups_stay_on_one_node_and_replicas_spread(two_nodes, tiny_llama_dir):
    import ray
    from raylane.serve import build_application

    build_application(config(tiny_llama_dir, tensor_parallel_size=2))  # the Router deploys
    wait_registered(ray, 2)  # both replicas loaded their shards, wherever Ray put them
    replicas = {row.name: row.address.node_id.hex() for row in alive_actors(REPLICA_CLASS)}
    groups = shard_groups()
    assert sorted(map(len, groups.values())) == [2, 2]
    for name, shards in groups.items():  # a group never spans nodes; it sits with its replica
        assert {s.address.node_id.hex() for s in shards} == {replicas[name]}
    # Ray places each STRICT_PACK group on the least-used node that fits it, so the second
    # replica goes to the other node
    assert set(replicas.values()) == two_nodes
