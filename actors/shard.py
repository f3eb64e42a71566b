"""ModelShard: one tensor-parallel rank of a model, a ModelRunner inside a Ray actor.

A shard group is `tensor_parallel_size` of these, placed on one node by the Ray executor's
placement group; they form a `torch.distributed` group (gloo on CPU, NCCL on GPU) whose
rendezvous is on loopback at a port rank 0 picks when the group starts. A group never spans
nodes, so loopback always reaches every rank. Operators find the ranks as `ModelShard` in
`ray list actors`.

Steps arrive on a step channel: a loopback socket each shard listens on, served by one thread
(see actors/executor/ray_executor.py for why not a Ray call per step). Only the first
connection that presents the shard's random token is served, and frames decode only to plan
types (actors/runner/wire.py). Control calls (`rpc`) come as Ray calls; a lock keeps them from
running inside a step.
"""

from __future__ import annotations

import datetime
import hmac
import os
import secrets
import socket
import threading
from typing import Any

from actors.runner import wire
from actors.runner.config import RunnerConfig, RunnerInfo
from actors.runner.plan import StepPlan, StepResult

LOOPBACK = "127.0.0.1"
# a collective waits this long for a peer before failing (a dead peer usually fails it at once)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


class ModelShard:
    """One rank. Constructed cheaply; `start` joins the process group and loads the slice."""

    def __init__(self, config: RunnerConfig, rank: int, world_size: int, torch_threads: int):
        import torch

        self.config, self.rank, self.world_size = config, rank, world_size
        torch.set_num_threads(torch_threads)
        self.runner = None
        self.device = None
        self._lock = threading.Lock()  # one of: a step, a control call

    def pick_port(self) -> int:
        """A free loopback port on this node for the group's rendezvous (called on rank 0)."""
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            return s.getsockname()[1]

    def start(self, port: int) -> RunnerInfo:
        """Join the process group (every rank must call this together), then load the slice."""
        import torch
        import torch.distributed as dist

        from actors.models import TPGroup
        from actors.runner.model_runner import ModelRunner, resolve_device

        device = self.device = resolve_device(self.config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://{LOOPBACK}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)
        tp = TPGroup(self.rank, self.world_size, dist.group.WORLD)
        self.runner = ModelRunner(self.config, tp)
        return self.runner.info()

    def execute(self, plan: StepPlan) -> StepResult | None:
        """One step as a Ray call (the fallback when the engine is on another node)."""
        with self._lock:
            return self.runner.execute(plan)

    def rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a ModelRunner method on this rank (the executor's `collective_rpc`)."""
        with self._lock:
            return getattr(self.runner, method)(*args, **kwargs)

    def ping(self) -> int:
        return self.rank

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def open_step_channel(self) -> tuple[int, bytes]:
        """Listen on a loopback port for the engine's step stream; returns (port, token)."""
        listener = socket.create_server((LOOPBACK, 0))
        token = secrets.token_bytes(16)
        threading.Thread(target=self._serve_steps, args=(listener, token), daemon=True,
                         name="step-channel").start()
        return listener.getsockname()[1], token

    def _serve_steps(self, listener: socket.socket, token: bytes) -> None:
        conn = _accept(listener, token)
        if conn is None:
            return
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)  # per thread
        with conn:
            while True:
                try:
                    plan = wire.decode(wire.recv_frame(conn))
                    wire.send_frame(conn, wire.encode(self._step(plan)))
                except OSError:  # WireError is one: the engine hung up, or sent garbage
                    return

    def _step(self, plan: StepPlan) -> StepResult | RuntimeError | None:
        try:
            with self._lock:
                return self.runner.execute(plan)
        except Exception as e:  # the group is poisoned: the engine kills it on this reply
            return RuntimeError(f"rank {self.rank}: {e!r}")

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
