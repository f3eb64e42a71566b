"""The Ray Serve application: a stateless FastAPI ingress; the engine replicas are the Router's.

`app_builder` is the `import_path` a RayService points at (`raylane.serve:app_builder`, with
the ClusterConfig fields as args); `build_application(config)` is what `raylane serve` runs.

The Serve app holds only the `Ingress` deployment. The engine replicas are plain Ray actors the
Router creates, health-checks and replaces (router/replica_set.py) to match the `ReplicaSpec`
built here; the ingress routes on its own copy of the Router's replica table and talks to the
chosen replica's actor handle directly (router/replica_view.py), so a request never calls the
Router. The Router is created here, by the app's builder, outside any placement group.

At tensor_parallel_size > 1 each engine replica owns a group of `ModelShard` actors in its own
STRICT_PACK placement group (bundle 0 the replica's, then one per shard; see
actors/executor/placement.py): a replica and its shards start, fit and die together, on one
node. Ray places each group on the least-used node that fits it, so replicas spread over nodes;
to force one replica per node size `engine.shard_resources` so that a second group does not fit
a node.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from ray import serve
from raylane.actors.engine.config import EngineConfig
from raylane.actors.executor.placement import check_fits_one_node, replica_bundles, shard_bundle
from raylane.config import ClusterConfig
from raylane.router.actor import get_or_create_router
from raylane.router.replica_set import ReplicaSpec

if TYPE_CHECKING:
    from raylane.router.session_host import SessionSetup
    from raylane.session_server.backend import ModelInfo


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    # Serve awaits an async constructor (mypy knows only plain classes)
    async def __init__(  # type: ignore[misc]
        self, spec: ReplicaSpec, model_dir: str, config: ClusterConfig
    ):
        from raylane.consolidation import start_with_app
        from raylane.serve_backend import serve_backend

        tokenizer, info, setup = _served_model(model_dir, config)
        router = get_or_create_router(config.max_queue_per_replica, config.sessions_dsn)
        # each refresh of its replica table hands the Router this app's spec, so a Router that
        # restarted runs the replicas again
        backend = serve_backend(router, tokenizer, info, setup, spec, config.max_queue_per_replica)
        self.asgi = _http_app(backend, config)
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


def _served_model(model_dir: str, config: ClusterConfig) -> tuple[Any, ModelInfo, SessionSetup]:
    """The served model's tokenizer, what the HTTP layer tells about it, and the session
    setup the Router hosts its sessions with (their turns run on the replicas)."""
    from raylane.router.session_host import SessionSetup
    from raylane.session_server.backend import ModelInfo

    tokenizer, max_len, vocab, moe, dsa = _model_facts(model_dir, config)
    engine = config.engine_config(model_dir)
    capture = moe and engine.enable_return_routed_experts
    picks = dsa and engine.enable_return_indexer_topk
    info = ModelInfo(
        served_model_name(config),
        max_len,
        vocab,
        model_path=model_dir,
        replicas=config.replicas,
        tensor_parallel_size=engine.tensor_parallel_size,
        dtype=engine.dtype,
        routed_experts=capture,
        batch_invariant=engine.batch_invariant,
        enable_lora=engine.enable_lora,
        max_loras=engine.max_loras,
        max_lora_rank=engine.max_lora_rank,
    )
    setup = SessionSetup(model_dir, return_routed_experts=capture, return_indexer_topk=picks)
    return tokenizer, info, setup


def _http_app(backend: Any, config: ClusterConfig) -> Any:
    """The FastAPI app over `backend`, with the config's HTTP options."""
    from raylane.consolidation import metrics_sources
    from raylane.session_server.app import build_app

    return build_app(
        backend,
        api_keys=list(config.api_keys) or None,
        max_body_bytes=config.max_body_bytes,
        admin_api_key=config.admin_api_key,
        request_timeout_s=config.request_timeout_s,
        max_n=config.max_n,
        tool_call_parser=config.tool_call_parser,
        trainer_api=config.trainer_api,
        metrics_sources=metrics_sources(config),
    )


def build_application(config: ClusterConfig, model_dir: str | None = None):
    """The bound Serve application for `config` (the model resolved to an HF directory)."""
    from raylane.actors.models.loader import resolve_model_dir
    from raylane.models import resolve_model

    model_dir = model_dir or resolve_model_dir(resolve_model(config.model))  # .gguf -> HF dir
    spec = replica_spec(config, model_dir)
    router = get_or_create_router(config.max_queue_per_replica, config.sessions_dsn)
    router.deploy.remote(spec)  # the replicas load while Serve starts the ingress
    return Ingress.bind(spec, model_dir, config)  # type: ignore[attr-defined]  # serve.deployment


def replica_spec(config: ClusterConfig, model_dir: str) -> ReplicaSpec:
    """The engine replicas `config` asks for: with a Ray shard group, each in its own placement
    group, checked against the alive nodes (ValueError naming the shortfall)."""
    engine = config.engine_config(model_dir)
    bundles = shard_group_bundles(engine) if engine.executor_backend == "ray" else None
    modules = {"lora_modules": list(config.lora_modules)} if config.lora_modules else {}
    return ReplicaSpec(
        {"model": model_dir, **config.engine, **modules},
        config.replicas,
        config.replica_threads(),
        bundles,
        stamp=time.time(),
    )


def shard_group_bundles(engine: EngineConfig) -> list[dict[str, float]]:
    """One replica's bundles (its own, then one per shard), if a node of this cluster can hold
    them all; the replica would otherwise wait forever for a group no node can place."""
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
    from raylane.actors.engine.limits import read_model_limits
    from raylane.actors.models import load_tokenizer

    engine = config.engine_config(model_dir)
    lim = read_model_limits(engine)  # the engine's own rule
    # the engine's own tokenizer (EngineConfig.tokenizer overrides the model's)
    return (
        load_tokenizer(engine.tokenizer or model_dir),
        lim.max_model_len,
        lim.vocab_size,
        lim.is_moe,
        lim.is_dsa,
    )


def served_model_name(config: ClusterConfig) -> str:
    """The model id clients send (and the consolidation actor, by default)."""
    return config.served_model_name or _default_name(config)


def _default_name(config: ClusterConfig) -> str:
    if config.model is None:
        from raylane.models import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(config.model))
