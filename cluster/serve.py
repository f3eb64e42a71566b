"""The Ray Serve application: a stateless FastAPI ingress in front of N engine replicas.

`app_builder` is the `import_path` a RayService points at (`raylane.serve:app_builder`, with
the ClusterConfig fields as args); `build_application(config)` is what `raylane serve` runs.

At tensor_parallel_size > 1 each engine replica owns a group of `ModelShard` actors. Serve makes
one STRICT_PACK placement group per replica (bundle 0 the replica's, then one per shard), and
the executor inside the replica places its shards in bundles 1..N of that group (see
actors/executor/placement.py): a replica and its shards start, fit and die together, on one
node. Serve puts the replica's child actors in its group by default (it sets
`placement_group_capture_child_tasks`), which is why the Router is created outside any replica.
Ray places each group on the least-used node that fits it, so replicas spread over nodes;
Serve forbids `max_replicas_per_node` with placement groups, so to force one replica per node
size `engine.shard_resources` so that a second group does not fit a node (and leave
RAY_SERVE_USE_PACK_SCHEDULING_STRATEGY unset: it packs replicas onto as few nodes as it can).
"""

from __future__ import annotations

import os

from ray import serve
from ray.serve.config import RequestRouterConfig
from raylane.actors.engine.config import EngineConfig
from raylane.actors.executor.placement import check_fits_one_node, replica_bundles, shard_bundle
from raylane.actors.replica import EngineReplica
from raylane.config import ClusterConfig
from raylane.router.actor import get_or_create_router
from raylane.router.serve_router import IMPORT_PATH as REQUEST_ROUTER


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1024,
    health_check_period_s=2,
    health_check_timeout_s=30,
    request_router_config=RequestRouterConfig(request_router_class=REQUEST_ROUTER),
)
class EngineDeployment(EngineReplica):
    async def __init__(self, engine_options: dict, torch_threads: int, capacity: int):
        EngineReplica.__init__(self, engine_options, get_or_create_router(capacity), torch_threads)
        await self.start()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    async def __init__(self, replicas, model_dir: str, config: ClusterConfig):
        from raylane.consolidation import metrics_sources, start_with_app
        from raylane.router.session_host import SessionSetup
        from raylane.serve_backend import ServeBackend
        from raylane.session_server.app import build_app
        from raylane.session_server.backend import ModelInfo

        tokenizer, max_len, vocab, moe = _model_facts(model_dir, config)
        info = ModelInfo(served_model_name(config), max_len, vocab)
        router = get_or_create_router(config.max_queue_per_replica, config.sessions_dsn)
        # the Router hosts the sessions and runs their turns on these replicas
        capture = moe and bool(config.engine.get("enable_return_routed_experts"))
        setup = SessionSetup(model_dir, replicas, return_routed_experts=capture)
        backend = ServeBackend(replicas, router, tokenizer, info, setup)
        self.asgi = build_app(
            backend,
            api_keys=list(config.api_keys) or None,
            max_body_bytes=config.max_body_bytes,
            admin_api_key=config.admin_api_key,
            request_timeout_s=config.request_timeout_s,
            max_n=config.max_n,
            tool_call_parser=config.tool_call_parser,
            metrics_sources=metrics_sources(config),
        )
        self.listener = None
        if config.direct_ingress:  # the app answers on config.port itself; Serve runs no proxy
            from raylane.listener import HTTPListener

            self.listener = HTTPListener(self.asgi, config.host, config.port)
        start_with_app(config, served_model_name(config))  # its actor, once the app answers

    def __serve_build_asgi_app__(self):
        return self.asgi  # what Serve's proxy calls, when there is one

    def check_health(self) -> None:
        if self.listener is not None:
            self.listener.check()


def build_application(config: ClusterConfig, model_dir: str | None = None):
    """The bound Serve application for `config` (the model resolved to an HF directory)."""
    from raylane.actors.models.loader import resolve_model_dir
    from raylane.models import resolve_model

    model_dir = model_dir or resolve_model_dir(resolve_model(config.model))  # .gguf -> HF dir
    engine_options = {"model": model_dir, **config.engine}
    options = engine_deployment_options(config, config.engine_config(model_dir))
    # NOTE: made here, before any replica: a replica would place the (detached) Router in its
    # own placement group, and the Router would die when Serve replaces that replica
    get_or_create_router(config.max_queue_per_replica, config.sessions_dsn)
    replicas = EngineDeployment.options(**options).bind(
        engine_options, config.replica_threads(), config.max_queue_per_replica
    )
    return Ingress.bind(replicas, model_dir, config)


def engine_deployment_options(config: ClusterConfig, engine: EngineConfig) -> dict:
    """Serve options of the engine replicas: with a Ray shard group, one placement group per
    replica for it, checked against the alive nodes (ValueError naming the shortfall)."""
    options: dict = {"num_replicas": config.replicas}
    if engine.executor_backend != "ray":
        return options  # the model runs inside the replica process
    bundles = shard_group_bundles(engine)
    options.update(placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK")
    return options


def shard_group_bundles(engine: EngineConfig) -> list[dict[str, float]]:
    """One replica's bundles (its own, then one per shard), if a node of this cluster can hold
    them all; Serve would otherwise wait forever for a group no node can place."""
    import ray

    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    shard = shard_bundle(engine.shard_resources, engine.device, has_gpus)
    bundles = replica_bundles(shard, engine.tensor_parallel_size)
    check_fits_one_node(
        bundles,
        ray.nodes(),
        f"one engine replica (tensor_parallel_size="
        f"{engine.tensor_parallel_size}, {shard} per shard)",
    )
    return bundles


def app_builder(args: dict):
    """RayService / `serve run` entry point: `raylane.serve:app_builder key=value ...`.

    A new config replaces the consolidation actor the app's last one started (or stops it, when
    the section is gone): this Ingress starts the actor anew, with this config, once it answers.
    """
    from raylane.consolidation import stop_consolidation

    config = ClusterConfig.for_serve_app(dict(args))
    if config.direct_ingress:
        raise ValueError(
            "ClusterConfig.direct_ingress is for the local cluster `raylane serve` "
            "starts; a Serve app is reached through Serve's proxy"
        )
    app = build_application(config)
    # NOTE: after the build: a config that fails to build leaves the running app's actor be
    stop_consolidation()
    return app


def _model_facts(model_dir: str, config: ClusterConfig):
    from transformers import AutoConfig, AutoTokenizer

    hf = AutoConfig.from_pretrained(model_dir)
    max_len = config.engine.get("max_model_len") or getattr(hf, "max_position_embeddings", 4096)
    moe = bool(getattr(hf, "num_experts_per_tok", 0))  # Qwen3-MoE, Mixtral: routes tokens
    return AutoTokenizer.from_pretrained(model_dir), max_len, hf.vocab_size, moe


def served_model_name(config: ClusterConfig) -> str:
    """The model id clients send (and the consolidation actor, by default)."""
    return config.served_model_name or _default_name(config)


def _default_name(config: ClusterConfig) -> str:
    if config.model is None:
        from raylane.models import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(config.model))
