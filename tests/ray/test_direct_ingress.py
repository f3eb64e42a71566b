"""`raylane serve`'s default HTTP path on its local cluster: the ingress replica answers on the
configured port itself (cluster/listener.py) and Serve runs no proxy; everything a client does
through it matches the reference. `--no-direct-ingress` (Serve's proxy) is tested beside it,
each on the session's shared cluster in turn (Serve, its proxies included, is stopped between).
"""

from __future__ import annotations

import psutil
import pytest
from openai import OpenAI
from raylane.config import ClusterConfig

from tests.hf_reference import hf_greedy
from tests.ray.conftest import free_port, streamed_and_whole_chat
from tests.ray.test_serve_tp import alive_actors
from tests.support import ray_cluster as shared_ray

PROMPT = [5, 6, 7, 8, 9]
INGRESS_CLASS = "ServeReplica:raylane:Ingress"


@pytest.fixture(scope="module", params=[None, False], ids=["direct-by-default", "serve-proxy"])
def served(request, ray_cluster, tiny_llama_dir):
    """(url, whether the ingress replica should answer itself)"""
    from raylane import launch

    config = ClusterConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        port=free_port(),
        torch_threads=1,
        direct_ingress=request.param,
        engine={"num_kv_blocks": 128, "max_model_len": 256},
    )
    try:
        yield launch.deploy(config), request.param is None
    finally:
        shared_ray.stop_apps()


@pytest.fixture
def url(served) -> str:
    return served[0]


def listener(port: int) -> psutil.Process:
    (conn,) = [
        c
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    return psutil.Process(conn.pid)


def test_who_listens_on_the_port(served):
    url, direct = served
    port = int(url.rsplit(":", 1)[1])
    owner = " ".join(listener(port).cmdline())
    proxies = alive_actors("ProxyActor")
    if direct:
        assert INGRESS_CLASS in owner
        assert proxies == []  # Serve runs no proxy beside it
    else:
        assert "ProxyActor" in owner and len(proxies) == 1


def test_generate_and_streamed_chat_through_it(url, tiny_llama_dir):
    import httpx

    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    got = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    want, want_logprobs = hf_greedy(tiny_llama_dir, PROMPT, 8)
    assert got["output_ids"] == want
    assert [lp for lp, *_ in got["meta_info"]["output_token_logprobs"]] == pytest.approx(
        want_logprobs, abs=1e-4
    )

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    streamed, whole = streamed_and_whole_chat(client, "hi", 12)
    assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens > 0


def test_a_port_in_use_fails_before_deploying(served, tiny_llama_dir):
    import socket

    import httpx
    from raylane import launch

    url, _ = served
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        config = ClusterConfig(model=tiny_llama_dir, served_model_name="tiny", port=port)
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            launch.deploy(config)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # the app serves on


def test_direct_ingress_is_decided_by_where_the_cluster_runs():
    with pytest.raises(ValueError, match="direct_ingress"):
        ClusterConfig(direct_ingress=True, ray_address="ray://head:10001")
    assert ClusterConfig().resolved().direct_ingress is True
    assert ClusterConfig(ray_address="ray://head:10001").resolved().direct_ingress is False
    assert ClusterConfig(direct_ingress=False).resolved().direct_ingress is False


def test_a_serve_app_refuses_direct_ingress():
    from raylane.serve import app_builder

    with pytest.raises(ValueError, match="direct_ingress"):
        app_builder({"direct_ingress": True})
