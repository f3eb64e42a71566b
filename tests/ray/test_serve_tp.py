"""Tensor-parallel engine replicas: each replica (an actor the Router owns) has a group of
ModelShard actors in its own placement group; a shard that dies takes its replica down cleanly
and the Router brings up a replica with a fresh group."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from raylane.router.actor import NAMESPACE, ROUTER_NAME

from tests.ray.conftest import free_port, keys_owned, wait_for
from tests.ray.test_serve_cli import _wait_for

REPLICA_CLASS = "EngineReplica"


# --- the cluster's actors, read from the GCS (the state API needs the dashboard) --------------


def alive_actors(class_name: str) -> list:
    """ActorTableData rows of the ALIVE actors of `class_name`."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    rows = state._connect_and_get_accessor().get_actor_table(None, "ALIVE")
    rows = [gcs_pb2.ActorTableData.FromString(row) for row in rows]
    return [row for row in rows if row.class_name == class_name]


def shard_groups() -> dict[str, list]:
    """Replica actor name -> its ModelShard rows (those in the replica's placement group)."""
    replicas = {row.placement_group_id: row.name for row in alive_actors(REPLICA_CLASS)}
    groups: dict[str, list] = {name: [] for name in replicas.values()}
    for shard in alive_actors("ModelShard"):
        assert shard.placement_group_id in replicas, "a shard outside every replica's group"
        groups[replicas[shard.placement_group_id]].append(shard)
    return groups


def kill_shard(row) -> None:
    """SIGKILL a shard's process, as a crash would (shards are unnamed: this driver holds no
    handle to `ray.kill`). The pid is one this module's cluster started for that shard."""
    with open(f"/proc/{row.pid}/cmdline", "rb") as f:
        assert b"ModelShard" in f.read(), "not a shard process"
    os.kill(row.pid, signal.SIGKILL)


def healthy_replicas(ray) -> set[str]:
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return {r["replica_id"] for r in ray.get(router.replicas.remote()) if r["healthy"]}


# --- `raylane serve --tensor-parallel-size 3` on the embedded SmolLM2 ------------------------


@pytest.mark.slow
def test_cli_tp3_smollm2_equals_offline_tp1(ray_cluster, smollm2_dir):
    from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "raylane")
    address = ray_cluster.get_runtime_context().gcs_address  # join this module's cluster
    proc = subprocess.Popen(
        [
            exe,
            "serve",
            "--tensor-parallel-size",
            "3",
            "--port",
            str(port),
            "--served-model-name",
            "smol",
            "--ray-address",
            address,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(proc, "raylane is serving", timeout_s=300)
        groups = shard_groups()
        assert [len(shards) for shards in groups.values()] == [3]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        prompt = "The capital of France is"
        served = (
            client.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0)
            .choices[0]
            .text
        )
        # how Kubernetes stops a pod (test_serve_cli stops its server with Ctrl-C)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the CLI's shutdown takes the shard group along
    wait_for(lambda: not alive_actors("ModelShard"), 60, "the shards to go")
    engine = LLMEngine(EngineConfig(model=smollm2_dir))
    ref = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    engine.shutdown()
    assert served.strip() and served == ref[0].outputs[0].text


# --- two replicas of a tiny model at TP=2 on the 2-CPU cluster -------------------------------


@pytest.fixture(scope="module")
def served_tp(ray_cluster, tiny_llama_dir):
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        replicas=2,
        port=free_port(),
        torch_threads=1,
        engine={"num_kv_blocks": 512, "max_num_seqs": 32, "tensor_parallel_size": 2},
    )
    url = launch.deploy(config)
    wait_for(lambda: len(healthy_replicas(ray_cluster)) == 2, 120, "both replicas")
    return url


def generate(url: str, ids: list[int], key: str, max_new: int = 8) -> httpx.Response:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(f"{url}/generate", json=body, headers={"x-routing-key": key}, timeout=180)


def test_two_tp2_replicas_each_own_a_shard_group(served_tp, tiny_llama_dir):
    from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

    groups = shard_groups()
    assert sorted(len(shards) for shards in groups.values()) == [2, 2]
    # the detached Router lives outside every replica's group (it would die with the replica)
    assert [row.placement_group_id for row in alive_actors("Router")] == [b""]
    replicas = {row.name: row for row in alive_actors(REPLICA_CLASS)}
    for name, shards in groups.items():  # owned by their replica, placed with it
        assert {s.owner_address.worker_id for s in shards} == {replicas[name].address.worker_id}
        assert {s.address.node_id for s in shards} == {replicas[name].address.node_id}
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir))
    ref = engine.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    for key in ("a", "b", "c", "d"):  # keys spread over both replicas
        resp = generate(served_tp, [5, 6, 7], key)
        assert resp.status_code == 200
        assert resp.json()["output_ids"] == ref[0].outputs[0].token_ids


def _replace_and_wait(ray, victim_name: str, old_ids: set[str]) -> None:
    """Wait until the Router replaced the victim's replica: two healthy replicas, none of them the
    victim, each with a full shard group."""

    def recovered() -> bool:
        try:
            groups = shard_groups()
        except AssertionError:  # the dead replica's other shards, not yet ended with it
            return False
        return (
            victim_name not in groups
            and sorted(map(len, groups.values())) == [2, 2]
            and len(healthy_replicas(ray)) == 2
            and not any(rid in victim_name for rid in healthy_replicas(ray))
        )

    wait_for(recovered, 150, "the Router to replace the replica whose shard died")
    assert healthy_replicas(ray) != old_ids


def test_idle_shard_death_replaces_the_replica(served_tp, ray_cluster):
    before = healthy_replicas(ray_cluster)
    victim_name, shards = sorted(shard_groups().items())[0]
    kill_shard(shards[1])  # no request in flight: only the health check can notice
    _replace_and_wait(ray_cluster, victim_name, before)
    for key in ("a", "b", "c", "d"):
        assert generate(served_tp, [5, 6, 7], key).status_code == 200


def test_shard_killed_under_load_gives_503s_then_recovers(served_tp, ray_cluster):
    ray = ray_cluster
    before = healthy_replicas(ray)
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)

    def busiest() -> str | None:
        loads = {
            r["replica_id"]: r["in_flight"]
            for r in ray.get(router.replicas.remote())
            if r["healthy"]
        }
        rid = max(loads, key=loads.get)
        return rid if loads[rid] > 0 else None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # 4 requests owned by each replica (the Router's own hash ring), so the replica that
        # keeps its shards has work that must succeed
        keys = keys_owned(sorted(before), 4)
        futures = [pool.submit(generate, served_tp, [5, 6, 7], key, 900) for key in keys]
        wait_for(lambda: busiest() is not None, 60, "requests in flight")
        time.sleep(0.5)  # mid-generation
        busy = busiest()
        victim_name, shards = next(
            (name, shards) for name, shards in shard_groups().items() if busy in name
        )
        kill_shard(shards[0])
        codes = [f.result(timeout=240).status_code for f in futures]
    assert set(codes) <= {200, 503}, codes  # a clean error for the victim's requests, no hang
    assert 503 in codes and 200 in codes, codes
    _replace_and_wait(ray, victim_name, before)
    for i in range(4):
        resp = generate(served_tp, [5, 6, 7], f"after-{i}")
        assert resp.status_code == 200 and resp.json()["output_ids"]


def test_a_trainer_broadcast_reaches_every_shard_of_both_replicas(
    served_tp, tiny_llama_dir, tmp_path
):
    """Collective weight transfer at replicas=2, TP=2: the trainer (rank 0, its own process)
    broadcasts into 4 shards (ranks 1-4), each keeping its slice; a mismatch is refused on
    every rank with no change; a good update flips both replicas to version 1 at once.
    Reference: HF `generate` on the weights sent. NOTE: last in the module: a replica the Router
    replaces afterwards starts from the checkpoint (version 0) and serves nothing until an update
    reaches it, which would leave the tests above one replica."""
    import ray

    from tests.hf_reference import hf_greedy, perturbed_model
    from tests.weight_trainer import GROUP, Trainer, trainer_specs

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    v1_dir, _ = perturbed_model(tiny_llama_dir, str(tmp_path / "v1"), 3)
    specs = trainer_specs(v1_dir)
    bad = [dict(specs[-1], shape=[s + 1 for s in specs[-1]["shape"]])]

    def control(verb: str, *args):
        return ray.get(router.control.remote(verb, *args), timeout=180)

    def replicas() -> list[dict]:
        return ray.get(router.replicas.remote(), timeout=180)

    trainer = Trainer(v1_dir, specs, world_size=5, packed=True, buffer=20000)
    try:
        joined = control("init_weight_group", trainer.info())
        assert sorted(joined["ranks"].values()) == [1, 3]  # each replica's first rank
        control("pause", "keep")
        control("begin_update", None, None)
        with pytest.raises(ValueError, match=specs[-1]["name"]):
            control("receive_weights", None, GROUP, bad)  # no rank took a byte
        control("resume")  # nothing was loaded: the update is dropped
        assert {r["weight_version"] for r in replicas()} == {0}
    finally:
        trainer.close()
    trainer = Trainer(v1_dir, specs, world_size=5, packed=True, buffer=20000)
    try:
        control("init_weight_group", trainer.info())
        control("pause", "keep")
        control("begin_update", None, None)
        trainer.send()
        packing = {"packed": True, "buffer_bytes": 20000}
        assert control("receive_weights", None, GROUP, specs, packing) == len(specs)
        assert control("commit_update", None) == 1
        control("resume")
        control("destroy_weight_group", GROUP)
    finally:
        trainer.close()
    assert {r["weight_version"] for r in replicas() if r["healthy"]} == {1}
    want = hf_greedy(v1_dir, [5, 6, 7], 8)[0]
    for key in ("a", "b", "c", "d"):  # keys spread over both replicas
        resp = generate(served_tp, [5, 6, 7], key)
        assert resp.status_code == 200 and resp.json()["output_ids"] == want
