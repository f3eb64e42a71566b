"""Session turns on the Ray Serve engine replicas: the `TurnGenerator` the Router injects.

Each turn goes to the replica the Router's policy picks for the session id, so a session sticks
to one replica and reuses its prefix cache; the call carries `target_replica`, which the
deployment's request router (`router/serve_router.py`) honours. Tokens stream from the replica
to the Router (which records them) and on to the ingress.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

from actors.engine.errors import EnginePaused, RequestFailed
from actors.engine.output_delta import DeltaDecoder
from actors.engine.outputs import RequestOutput
from actors.engine.sampling_params import SamplingParams
from router.errors import SessionError
from router.generator import TurnOutput, turn_output, turn_params, turn_request_id
from router.replica_calls import unwrapped


class ReplicasBusy(SessionError):
    """Every replica's queue is full (or the session's replica is): retry later."""

    status = 429
    error_type = "rate_limit_error"


class NoReplica(SessionError):
    """No engine replica can serve, or the one serving the turn failed."""

    status = 503
    error_type = "server_error"


class ReplicaPicker(Protocol):
    """The Router's replica table, as the generator uses it."""

    def choose(self, routing_key: str | None = None) -> str | None: ...

    def done(self, replica_id: str) -> None: ...

    def ready(self) -> bool: ...

    def report_failure(self, replica_id: str) -> None: ...


async def stream_from_replica(handle: Any, replica_id: str, prompt_ids: list[int],
                              params: SamplingParams, request_id: str,
                              ) -> AsyncIterator[RequestOutput]:
    """Cumulative outputs of one request on the chosen replica (`handle`: the engine
    deployment's DeploymentHandle), rebuilt from the deltas the replica streams. Leaving early
    cancels the call, which aborts the request on the replica; a ValueError (bad input) or
    EnginePaused (its paused queue is full) raised there arrives as itself."""
    stream = handle.options(stream=True).generate.remote(
        prompt_ids, params, request_id, target_replica=replica_id)
    decoder = DeltaDecoder()
    finished = False
    try:
        async for delta in stream:
            out = decoder.decode(delta)
            finished = out.finished
            yield out
    except Exception as e:
        error = unwrapped(e)  # Ray wraps what the replica raised
        if error is e:
            raise
        raise error from None
    finally:
        if not finished:
            stream.cancel()


class ReplicaTurnGenerator:
    """`TurnGenerator` over the engine replicas, sticky by session id."""

    def __init__(self, handle: Any, picker: ReplicaPicker,
                 return_routed_experts: bool = False) -> None:
        self.handle = handle
        self.picker = picker
        self.return_routed_experts = return_routed_experts

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       routing_key: str) -> AsyncIterator[TurnOutput]:
        replica_id = self._choose(routing_key)
        params = turn_params(params, self.return_routed_experts)
        stream = stream_from_replica(self.handle, replica_id, prompt_ids, params,
                                     turn_request_id(routing_key))
        try:
            async with aclosing(stream):
                async for out in stream:
                    yield turn_output(out)
        except (ValueError, RequestFailed):  # the request's fault (400) or its step's: the
            raise  # replica is fine
        except EnginePaused as e:  # paused for a weight update, and its queue is full
            raise NoReplica(f"{e}; send the turn again") from None
        except Exception as e:
            self.picker.report_failure(replica_id)
            raise NoReplica(f"the engine replica failed while serving the turn: "
                            f"{type(e).__name__}; send the turn again") from e
        finally:
            self.picker.done(replica_id)

    def _choose(self, routing_key: str) -> str:
        replica_id = self.picker.choose(routing_key)
        if replica_id is None:
            if not self.picker.ready():
                raise NoReplica("no engine replica is ready")
            raise ReplicasBusy("the session's engine replica is busy; retry later")
        return replica_id
