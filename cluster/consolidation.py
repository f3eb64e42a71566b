"""The cluster's consolidation actor: with a `consolidation:` section in the config, `raylane
serve` starts one named actor whose LLM is the cluster's own endpoint, and /metrics merges its
metrics (`metrics_sources`)."""

from __future__ import annotations

import asyncio
import functools
import time

from cluster.config import ClusterConfig

ACTOR_NAME = "raylane-consolidation"
NAMESPACE = "raylane"  # the Router's, so the cluster's actors are found in one place
READY_TIMEOUT_S = 60.0  # connecting (and migrating the schema) at start


def start_consolidation(config: ClusterConfig, url: str, model_name: str):
    """Start the actor for `config`'s section (None when there is none): passes on its
    schedule, LLM calls to `url` (the cluster's base URL, e.g. "http://127.0.0.1:8000") as
    `model_name` unless the section names a model, with the first API key if there are keys.

    An actor an earlier deploy left behind is replaced. ValueError when the database cannot be
    reached (checked now, so a wrong DSN stops `raylane serve` instead of failing every pass).
    """
    service = config.consolidation_config()
    if service is None:
        return None
    from actors.consolidation.actor import ConsolidationActor
    from actors.consolidation.llm import OpenAICompatibleLLM

    stop_consolidation()
    llm = functools.partial(OpenAICompatibleLLM, f"{url}/v1", service.model or model_name,
                            api_key=config.api_keys[0] if config.api_keys else "EMPTY",
                            max_tokens=service.max_tokens)
    # Detached like the Router, and restarted by Ray if its process dies (the schedule is a
    # constructor argument, so a restarted actor resumes its passes).
    actor = ConsolidationActor.options(
        name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached", max_restarts=-1,
        scheduling_strategy="DEFAULT",  # never inside the caller's placement group
    ).remote(service.dsn, llm, service.limits, every_s=service.interval_s, banks=service.banks)
    _check_database(actor)
    return actor


def _check_database(actor) -> None:
    import ray

    try:
        ray.get(actor.connect.remote(), timeout=READY_TIMEOUT_S)
    except Exception as exc:
        stop_consolidation()
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        raise ValueError(f"consolidation: cannot use the database at consolidation.dsn: "
                         f"{type(cause).__name__}: {cause}") from None


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
        self._actor = None

    async def __call__(self) -> str:
        import ray

        if self._actor is None:
            try:  # a lookup is a GCS round trip: not on the event loop
                self._actor = await asyncio.to_thread(ray.get_actor, ACTOR_NAME,
                                                      namespace=NAMESPACE)
            except ValueError:  # no such actor
                return ""
        try:
            return await self._actor.metrics_text.remote()
        except Exception:
            self._actor = None
            raise

    def __repr__(self) -> str:
        return f"the consolidation actor {ACTOR_NAME!r}"
