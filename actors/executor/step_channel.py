"""The engine's end of the step channels: one loopback socket per shard.

A step encodes the plan once, writes it to every shard, then waits on all sockets together: the
first rank that fails (an error reply, a closed socket) fails the step at once, even while its
peers are still blocked in a collective waiting for it. Commands (ping, release) travel the same
way and are answered by every rank.
"""

from __future__ import annotations

import selectors
import socket

from raylane.actors.runner import wire
from raylane.actors.runner.plan import ChannelCommand, StepError, StepPlan, StepResult
from raylane.actors.shard import LOOPBACK


class ShardFailed(RuntimeError):
    """A rank failed mid-step (its error, or its connection dropped)."""


class StepChannels:
    def __init__(self, endpoints: list[tuple[int, bytes]], timeout_s: float = 60.0):
        self.socks: list[socket.socket] = []
        try:
            for port, token in endpoints:
                sock = socket.create_connection((LOOPBACK, port), timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(token)
                sock.settimeout(None)  # a step takes as long as it takes; failures close sockets
                self.socks.append(sock)
        except OSError:
            self.close()
            raise

    def send(self, plan: StepPlan) -> None:
        """Write a step's plan to every rank; `collect_step` reads its replies (in order)."""
        payload = wire.encode(plan)
        try:
            for sock in self.socks:
                wire.send_frame(sock, payload)
        except OSError as e:
            raise ShardFailed(f"lost a shard: {e}") from e

    def collect_step(self, _=None) -> StepResult | StepError:
        """The replies of the oldest step sent and not yet collected: rank 0's result."""
        try:
            return self._gather()[0]
        except OSError as e:
            raise ShardFailed(f"lost a shard: {e}") from e

    def command(self, kind: str) -> list:
        """Send "ping" or "release" to every rank; their replies in rank order."""
        return self._round(ChannelCommand(kind))

    def _round(self, message: object) -> list:
        payload = wire.encode(message)
        try:
            for sock in self.socks:
                wire.send_frame(sock, payload)
            return self._gather()
        except OSError as e:  # WireError is one: a closed or garbled stream
            raise ShardFailed(f"lost a shard: {e}") from e

    def _gather(self) -> list:
        replies: list = [None] * len(self.socks)
        with selectors.DefaultSelector() as selector:
            for rank, sock in enumerate(self.socks):
                selector.register(sock, selectors.EVENT_READ, rank)
            left = len(self.socks)
            while left:
                for key, _ in selector.select():
                    reply = wire.decode(wire.recv_frame(self.socks[key.data]))
                    if isinstance(reply, RuntimeError):
                        raise ShardFailed(str(reply))
                    replies[key.data] = reply
                    selector.unregister(key.fileobj)
                    left -= 1
        return replies

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks = []
