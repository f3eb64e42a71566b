"""How step plans and results travel between the engine and its shards on one node.

Frames on a stream socket: an 8-byte length, then a pickle. Decoding uses a restricted
unpickler that builds only the plan and result types, plain Python containers and numpy int32
arrays (routed experts): a peer that is not our engine cannot make a shard run code through it.
The socket is loopback-only and opened with a random token, see actors/shard.py.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct

_LENGTH = struct.Struct("!Q")
_ALLOWED = {
    ("raylane.actors.runner.plan", "StepPlan"),
    ("raylane.actors.runner.plan", "NewRequest"),
    ("raylane.actors.runner.plan", "CachedRequest"),
    ("raylane.actors.engine.sampling_params", "SamplingParams"),
    ("raylane.actors.engine.sampling_params", "StructuredOutputsParams"),
    ("raylane.actors.engine.sampling_params", "RequestOutputKind"),
    ("raylane.actors.runner.plan", "StepResult"),
    ("raylane.actors.runner.plan", "ExtraTokens"),  # speculative decoding: a verify row's tokens
    ("raylane.actors.runner.plan", "ChannelCommand"),
    ("raylane.actors.runner.plan", "StepError"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.numeric", "_frombuffer"),
    ("builtins", "RuntimeError"),
}


class WireError(ConnectionError):
    """The peer closed the stream or sent something that is not a plan or result."""


class _PlanUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise WireError(f"refusing to unpickle {module}.{name}")
        return super().find_class(module, name)


def encode(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> object:
    try:
        return _PlanUnpickler(io.BytesIO(data)).load()
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"undecodable frame: {e!r}") from e


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes:
    (size,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    return recv_exact(sock, size)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise WireError(f"the peer closed the connection ({e})") from e
        if n == 0:
            raise WireError("the peer closed the connection")
        got += n
    return bytes(buf)
