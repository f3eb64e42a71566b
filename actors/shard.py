"""ModelShard: one tensor-parallel rank of a model, a ModelRunner inside a Ray actor.

A shard group is `tensor_parallel_size` of these, placed on one node by the Ray executor's
placement group; they form a `torch.distributed` group (gloo on CPU, NCCL on GPU) whose
rendezvous is on loopback at a port rank 0 picks when the group starts. A group never spans
nodes, so loopback always reaches every rank. Operators find the ranks as `ModelShard` in
`ray list actors`.

Steps arrive on a step channel: a loopback socket per shard (see actors/executor/ray_executor.py
for why not a Ray call per step). Only the first connection that presents the shard's random
token is served, and frames decode only to plan types (actors/runner/wire.py).

The channel is served by `serve_steps`, a long-running Ray call, so steps run on the actor's
main thread: measured here, a warm SmolLM2 step took ~20% longer on any other thread (libgomp
hands work between back-to-back parallel regions fastest on a process's initial thread). While
it serves, the shard takes no other Ray call; the engine sends "release" first, and pings over
the channel. Every call that touches the model thus runs on one thread, one at a time.
"""

from __future__ import annotations

import datetime
import functools
import hmac
import os
import secrets
import socket
from typing import TYPE_CHECKING, Any

from raylane.actors.runner import wire
from raylane.actors.runner.config import RunnerConfig, RunnerInfo
from raylane.actors.runner.plan import ChannelCommand, StepError, StepPlan, StepResult

if TYPE_CHECKING:
    from raylane.actors.runner.model_runner import ModelRunner

LOOPBACK = "127.0.0.1"
# a collective waits this long for a peer before failing (a dead peer usually fails it at once)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


class ModelShard:
    """One rank. Constructed cheaply; `start` joins the process group and loads the slice."""

    def __init__(self, config: RunnerConfig, rank: int, world_size: int, torch_threads: int):
        import torch

        self.config, self.rank, self.world_size = config, rank, world_size
        torch.set_num_threads(torch_threads)
        self.runner: ModelRunner | None = None  # set by `start`
        self._listener: socket.socket | None = None
        self._token = b""
        self._conn: socket.socket | None = None

    def pick_port(self) -> int:
        """A free loopback port on this node for the group's rendezvous (called on rank 0)."""
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            return s.getsockname()[1]

    def start(self, port: int) -> RunnerInfo:
        """Join the process group (every rank must call this together), then load the slice."""
        import torch
        import torch.distributed as dist
        from raylane.actors.models import TPGroup
        from raylane.actors.runner.model_runner import ModelRunner, resolve_device

        device = resolve_device(self.config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{LOOPBACK}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        tp = TPGroup(self.rank, self.world_size, dist.group.WORLD)
        self.runner = runner = ModelRunner(self.config, tp)
        return runner.info()

    def execute(self, plan: StepPlan) -> StepResult | StepError | None:
        """One step as a Ray call (the fallback when the engine is on another node)."""
        reply = self._step(plan)
        if isinstance(reply, RuntimeError):
            raise reply
        return reply

    def rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a ModelRunner method on this rank (the executor's `collective_rpc`); a dotted
        name reaches a part of it ("weights.receive")."""
        call: Any = functools.reduce(getattr, method.split("."), self._runner())
        return call(*args, **kwargs)

    def ping(self) -> int:
        return self.rank

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def open_step_channel(self) -> tuple[int, bytes]:
        """Listen on a loopback port for the engine's step stream; returns (port, token)."""
        self._listener = socket.create_server((LOOPBACK, 0))
        self._token = secrets.token_bytes(16)
        return self._listener.getsockname()[1], self._token

    def serve_steps(self) -> str:
        """Serve the step channel on this thread until the engine releases it ("released") or
        goes away ("closed"). Each step's reply is its result (rank 0), None, or the error."""
        if self._conn is None:
            self._conn = _accept(self._listener, self._token) if self._listener else None
            self._listener = None
            if self._conn is None:
                return "closed"
        while True:
            try:
                message = wire.decode(wire.recv_frame(self._conn))
                if message == ChannelCommand("release"):
                    wire.send_frame(self._conn, wire.encode(None))
                    return "released"
                reply = self.rank if isinstance(message, ChannelCommand) else self._step(message)
                wire.send_frame(self._conn, wire.encode(reply))
            except OSError:  # WireError is one: the engine hung up, or sent garbage
                self._conn.close()
                return "closed"

    def _step(self, plan: object) -> StepResult | StepError | RuntimeError | None:
        try:
            if not isinstance(plan, StepPlan):  # a frame may decode to any allowed type
                raise TypeError(f"not a step plan: {type(plan).__name__}")
            return self._runner().execute(plan)
        except Exception as e:
            if self.world_size == 1:  # no peer waits in a collective: fail this step only
                return StepError(repr(e))
            # a peer may be left in a collective: the engine kills the group on this reply
            return RuntimeError(f"rank {self.rank}: {e!r}")

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank}: the shard was not started")
        return self.runner

    def stop(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _accept(listener: socket.socket, token: bytes) -> socket.socket | None:
    """The first connection that presents `token`; others are closed unanswered."""
    with listener:
        while True:
            conn, _ = listener.accept()
            try:
                conn.settimeout(10.0)
                if hmac.compare_digest(wire.recv_exact(conn, len(token)), token):
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return conn
            except OSError:
                pass
            conn.close()
