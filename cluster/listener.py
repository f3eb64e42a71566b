"""The ingress replica's own HTTP server (`ClusterConfig.direct_ingress`, on by default for the
local cluster `raylane serve` starts).

Through Ray Serve's proxy every streamed token crosses two processes and is serialized twice
(replica -> proxy actor -> client); here the ingress replica answers the socket itself. It binds
with SO_REUSEPORT: a replica that Serve starts while the one it replaces still holds the port
binds beside it, and the kernel frees a dead replica's port with its process, so a crashed
ingress is served again as soon as Serve has replaced it (Ray Serve 2.60's own direct ingress
keeps a dead replica's port allocated and never serves on it again). `wait_healthy` polls an
endpoint until it answers.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request


class HTTPListener:
    """uvicorn serving `app` on (host, port) from the running event loop, until the process
    ends. The port is bound here, so a port another program holds fails the replica's start
    with OSError."""

    def __init__(self, app, host: str, port: int) -> None:
        import uvicorn

        self.sock = bind_socket(host, port, reuse_port=True)
        # log_config=None: the replica's logging stays Serve's; access logs off, as the proxy's
        config = uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, timeout_keep_alive=30
        )
        self.server = uvicorn.Server(config)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))

    def check(self) -> None:
        """Raise when the server has stopped (Serve's health check then replaces the replica)."""
        if self.task.done():
            error = None if self.task.cancelled() else self.task.exception()
            raise RuntimeError(f"the ingress's HTTP server stopped: {error!r}")


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to (host, port), IPv4 or IPv6 by the host's spelling (TIME_WAIT
    connections do not hold the port); OSError when another socket holds it. With `reuse_port`
    it binds beside other SO_REUSEPORT sockets of this user."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def wait_healthy(url: str, timeout_s: float = 300.0, api_keys=()) -> None:
    """Poll `url`/health until it answers 200 (TimeoutError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
