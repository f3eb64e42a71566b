"""Run an ASGI app with uvicorn in a background thread on a free loopback port.

>>> with ServerThread(app) as server:
...     httpx.get(server.url + "/health")
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from typing_extensions import Self


class ServerThread:
    """A uvicorn server on 127.0.0.1 and a port the OS picked; `stop()` shuts it down."""

    def __init__(self, app, *, startup_timeout: float = 30.0):
        self.app = app
        self.startup_timeout = startup_timeout
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.sock]},
            name=f"uvicorn-{self.port}",
            daemon=True,
        )

    def start(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
