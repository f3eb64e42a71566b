"""`raylane serve --direct-ingress`: the ingress replica itself listens on the configured port
(Ray Serve's direct ingress), and everything a client does through it matches the reference.
"""

from __future__ import annotations

import os

import psutil
import pytest
from openai import OpenAI

from cluster.config import ClusterConfig
from tests.hf_reference import hf_greedy
from tests.ray.conftest import free_port, streamed_and_whole_chat

PROMPT = [5, 6, 7, 8, 9]
INGRESS_CLASS = "ServeReplica:raylane:Ingress"


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    from cluster import launch

    config = ClusterConfig(model=tiny_llama_dir, served_model_name="tiny", port=free_port(),
                           torch_threads=1, direct_ingress=True,
                           engine={"num_kv_blocks": 128, "max_model_len": 256})
    launch.start_ray(num_cpus=2, direct_ingress_port=config.port)
    try:
        yield launch.deploy(config)
    finally:
        launch.shutdown()


def listener(port: int) -> psutil.Process:
    (conn,) = [c for c in psutil.net_connections(kind="tcp")
               if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    return psutil.Process(conn.pid)


def test_the_ingress_replica_listens_on_the_port(url):
    port = int(url.rsplit(":", 1)[1])
    assert INGRESS_CLASS in " ".join(listener(port).cmdline())
    # the driver's environment is its own again: only the cluster's processes have the flag
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in os.environ


def test_generate_and_streamed_chat_through_it(url, tiny_llama_dir):
    import httpx

    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True}, "return_logprob": True}
    got = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    want, want_logprobs = hf_greedy(tiny_llama_dir, PROMPT, 8)
    assert got["output_ids"] == want
    assert [lp for lp, *_ in got["meta_info"]["output_token_logprobs"]] == pytest.approx(
        want_logprobs, abs=1e-4)

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    streamed, whole = streamed_and_whole_chat(client, "hi", 12)
    assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens > 0


def test_direct_ingress_refuses_a_remote_cluster():
    with pytest.raises(ValueError, match="direct_ingress"):
        ClusterConfig(direct_ingress=True, ray_address="ray://head:10001")
