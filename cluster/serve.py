"""The Ray Serve application: a stateless FastAPI ingress in front of N engine replicas.

`app_builder` is the `import_path` a RayService points at (`cluster.serve:app_builder`, with
the ClusterConfig fields as args); `build_application(config)` is what `raylane serve` runs.
"""

from __future__ import annotations

import os

from ray import serve
from ray.serve.config import RequestRouterConfig

from actors.replica import EngineReplica
from cluster.config import ClusterConfig
from router.actor import get_or_create_router
from router.serve_router import IMPORT_PATH as REQUEST_ROUTER


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  health_check_period_s=2, health_check_timeout_s=30,
                  request_router_config=RequestRouterConfig(request_router_class=REQUEST_ROUTER))
class EngineDeployment(EngineReplica):
    async def __init__(self, engine_options: dict, torch_threads: int, capacity: int):
        EngineReplica.__init__(self, engine_options, get_or_create_router(capacity),
                               torch_threads)
        await self.start()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    def __init__(self, replicas, model_dir: str, config: ClusterConfig):
        from cluster.serve_backend import ServeBackend
        from router.session_host import SessionSetup
        from session_server.backend import ModelInfo

        tokenizer, max_len, vocab, moe = _model_facts(model_dir, config)
        info = ModelInfo(config.served_model_name or _default_name(config, model_dir), max_len,
                         vocab)
        router = get_or_create_router(config.max_queue_per_replica)
        # the Router hosts the sessions and runs their turns on these replicas
        capture = moe and bool(config.engine.get("enable_return_routed_experts"))
        setup = SessionSetup(model_dir, replicas, return_routed_experts=capture)
        self.backend = ServeBackend(replicas, router, tokenizer, info, setup)
        self.config = config

    def __serve_build_asgi_app__(self):
        from session_server.app import build_app

        return build_app(self.backend, api_keys=list(self.config.api_keys) or None,
                         max_body_bytes=self.config.max_body_bytes)


def build_application(config: ClusterConfig, model_dir: str | None = None):
    """The bound Serve application for `config` (the model resolved to an HF directory)."""
    from actors.models.loader import resolve_model_dir
    from cluster.models import resolve_model

    model_dir = model_dir or resolve_model_dir(resolve_model(config.model))  # .gguf -> HF dir
    engine_options = {"model": model_dir, **config.engine}
    replicas = EngineDeployment.options(num_replicas=config.replicas).bind(
        engine_options, config.replica_threads(), config.max_queue_per_replica)
    return Ingress.bind(replicas, model_dir, config)


def app_builder(args: dict):
    """RayService / `serve run` entry point: `cluster.serve:app_builder key=value ...`."""
    return build_application(ClusterConfig.from_env(ClusterConfig.from_dict(dict(args))))


def _model_facts(model_dir: str, config: ClusterConfig):
    from transformers import AutoConfig, AutoTokenizer

    hf = AutoConfig.from_pretrained(model_dir)
    max_len = config.engine.get("max_model_len") or getattr(hf, "max_position_embeddings", 4096)
    moe = bool(getattr(hf, "num_experts_per_tok", 0))  # Qwen3-MoE, Mixtral: routes tokens
    return AutoTokenizer.from_pretrained(model_dir), max_len, hf.vocab_size, moe


def _default_name(config: ClusterConfig, model_dir: str) -> str:
    if config.model is None:
        from cluster.models import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(config.model))
