"""The cluster's consolidation actor: with a `consolidation:` section in the config, the Serve
application starts one named actor whose LLM is the cluster's own endpoint (`start_with_app`,
from the Ingress: so a RayService `import_path` deploy gets it as `raylane serve` does), and
/metrics merges its metrics (`metrics_sources`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING

from raylane.config import ClusterConfig
from raylane.router.names import NAMESPACE  # the Router's: the cluster's actors in one place

if TYPE_CHECKING:
    from ray.actor import ActorHandle

ACTOR_NAME = "raylane-consolidation"
READY_TIMEOUT_S = 60.0  # connecting (and migrating the schema) at start
RETRY_S = 30.0  # between an app's tries to start the actor (e.g. its database is not up yet)
APP_READY_TIMEOUT_S = 3600.0  # a large model can load for long; past this, a logged retry
WILDCARD_HOSTS = ("0.0.0.0", "::", "")

# Serve's logger: what the Ingress logs here lands in its replica's log
log = logging.getLogger("ray.serve")


def start_consolidation(config: ClusterConfig, url: str, model_name: str):
    """Start the actor for `config`'s section unless it runs already (None when there is no
    section): passes on its schedule, LLM calls to `url` (the cluster's base URL, e.g.
    "http://127.0.0.1:8000") as `model_name` unless the section names a model, with the first
    API key if there are keys.

    Idempotent: the app's Ingress (`start_with_app`) and `raylane serve` both call it once the
    endpoint answers, and whichever comes first creates the one actor. ValueError when the
    database cannot be reached (checked now, so a wrong DSN stops `raylane serve` instead of
    failing every pass); the actor is then killed, so a later call starts afresh.
    """
    service = config.consolidation_config()
    if service is None:
        return None
    from raylane.actors.consolidation.actor import ConsolidationActor
    from raylane.actors.consolidation.llm import OpenAICompatibleLLM

    llm = functools.partial(
        OpenAICompatibleLLM,
        f"{url}/v1",
        service.model or model_name,
        api_key=config.api_keys[0] if config.api_keys else "EMPTY",
        max_tokens=service.max_tokens,
    )
    # Detached like the Router, and restarted by Ray if its process dies (the schedule is a
    # constructor argument, so a restarted actor resumes its passes). get_if_exists: a second
    # caller gets the running actor, created once.
    # @ray.remote makes the class an ActorClass, but mypy keeps a decorated class's own type
    actor = ConsolidationActor.options(  # type: ignore[attr-defined]
        name=ACTOR_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        max_restarts=-1,
        get_if_exists=True,
        scheduling_strategy="DEFAULT",  # never inside the caller's placement group
    ).remote(service.dsn, llm, service.limits, every_s=service.interval_s, banks=service.banks)
    _check_database(actor)
    return actor


def start_with_app(config: ClusterConfig, model_name: str) -> threading.Thread | None:
    """The Serve application's side (called by its Ingress): with a `consolidation:` section,
    a background thread waits until the app answers /health at the Serve HTTP address
    (`serve_url`), then starts the actor pointed at that address. An error (the database not
    reachable, the app not up within APP_READY_TIMEOUT_S) is logged and tried again every
    RETRY_S seconds; the app keeps serving meanwhile. None when there is no section."""
    if config.consolidation is None:
        return None
    thread = threading.Thread(
        target=_start_when_serving,
        args=(config, model_name),
        name="raylane-consolidation-start",
        daemon=True,
    )
    thread.start()
    return thread


def _start_when_serving(config: ClusterConfig, model_name: str) -> None:
    from raylane.listener import wait_healthy

    while True:
        try:
            url = serve_url()
            # NOTE: not before the app answers: the actor's first pass asks it at once
            wait_healthy(url, timeout_s=APP_READY_TIMEOUT_S)
            start_consolidation(config, url, model_name)
            log.info("consolidation: the actor %r runs, its LLM at %s/v1", ACTOR_NAME, url)
            return
        except Exception as exc:  # logged, never raised: the app serves without it
            log.error(
                "consolidation: the actor %r is not running (%s: %s); the app serves on, "
                "next try in %.0f s",
                ACTOR_NAME,
                type(exc).__name__,
                exc,
                RETRY_S,
            )
        time.sleep(RETRY_S)


def serve_url() -> str:
    """The Serve HTTP address as the controller knows it, as a base URL any node can reach: a
    wildcard host (0.0.0.0 in a RayService) becomes this node's IP, where a proxy runs (Serve
    starts one on every node with a replica, proxy_location EveryNode)."""
    import ray
    from ray.serve.context import _get_global_client  # no public API gives the HTTP options

    client = _get_global_client()  # raises when no Serve controller runs
    assert client is not None
    http = client.http_config
    host = ray.util.get_node_ip_address() if http.host in WILDCARD_HOSTS else http.host
    return f"http://[{host}]:{http.port}" if ":" in host else f"http://{host}:{http.port}"


def _check_database(actor) -> None:
    import ray

    try:
        ray.get(actor.connect.remote(), timeout=READY_TIMEOUT_S)
    except Exception as exc:
        stop_consolidation()
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        raise ValueError(
            f"consolidation: cannot use the database at consolidation.dsn: "
            f"{type(cause).__name__}: {cause}"
        ) from None


def stop_consolidation(timeout_s: float = 10.0) -> None:
    """Kill the actor if there is one (a run in flight stops; its committed batches stay, and
    the next run picks up the rest); returns once its name is free for a new one."""
    import ray

    try:
        ray.kill(ray.get_actor(ACTOR_NAME, namespace=NAMESPACE), no_restart=True)
    except ValueError:  # no such actor
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the name is released once the GCS sees it dead
        try:
            ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


def metrics_sources(config: ClusterConfig) -> list[ActorMetrics]:
    """What the cluster's /metrics merges besides the engines: the actor's, when configured."""
    return [ActorMetrics()] if config.consolidation is not None else []


class ActorMetrics:
    """A /metrics source: the consolidation actor's Prometheus text.

    The handle is looked up by name and looked up again after a failed call, so an actor that
    a new deploy replaced is found. No actor (not started yet, or stopped) is no text; a dead
    or failing one raises, and /metrics leaves it out.
    """

    def __init__(self) -> None:
        self._actor: ActorHandle | None = None

    async def __call__(self) -> str:
        import ray

        if self._actor is None:
            try:  # a lookup is a GCS round trip: not on the event loop
                self._actor = await asyncio.to_thread(
                    ray.get_actor, ACTOR_NAME, namespace=NAMESPACE
                )
            except ValueError:  # no such actor
                return ""
        try:
            return await self._actor.metrics_text.remote()
        except Exception:
            self._actor = None
            raise

    def __repr__(self) -> str:
        return f"the consolidation actor {ACTOR_NAME!r}"
