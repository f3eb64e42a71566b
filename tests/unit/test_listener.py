"""The ingress replica's own HTTP server (cluster/listener.py), in process: it answers, a
replacement binds beside the server it replaces, a port another program holds fails its start,
and a stopped server fails the health check."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI
from raylane.launch import free_port
from raylane.listener import HTTPListener


def app(name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/who")
    def who() -> dict:
        return {"name": name}

    return app


async def started(listener: HTTPListener) -> HTTPListener:
    for _ in range(500):
        if listener.server.started:
            return listener
        await asyncio.sleep(0.01)
    raise AssertionError("the listener did not start")


async def stop(listener: HTTPListener) -> None:
    listener.server.should_exit = True
    await asyncio.wait_for(listener.task, 10)


async def test_it_answers_and_a_replacement_binds_beside_it():
    port = free_port()
    first = await started(HTTPListener(app("first"), "127.0.0.1", port))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        assert (await client.get("/who")).json() == {"name": "first"}
        # Serve starts the new replica while the old one still holds the port
        second = await started(HTTPListener(app("second"), "127.0.0.1", port))
        await stop(first)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        assert (await client.get("/who")).json() == {"name": "second"}
    second.check()  # serving: healthy
    await stop(second)
    with pytest.raises(RuntimeError, match="HTTP server stopped"):
        second.check()


async def test_a_port_another_program_holds_fails_the_start():
    with socket.socket() as other:  # no SO_REUSEPORT: the port is its own
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            HTTPListener(app("late"), "127.0.0.1", other.getsockname()[1])
