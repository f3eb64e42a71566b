"""No path spelling gets past the keys (vLLM's CVE-2026-48746 skipped its middleware on
percent-encoded and double-slash paths), and header floods get 431 before anything reads them.

Requests go over a raw socket, so no client library normalises the path on the way.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator

import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import MAX_BODY, MODEL, tiny_config
from tests.e2e.server import ServerThread

USER_KEY = "paths-user-key"
ADMIN_KEY = "paths-admin-key"


@pytest.fixture(scope="module")
def app(tiny_llama_dir):
    backend = local_backend(AsyncLLMEngine(LLMEngine(tiny_config(tiny_llama_dir))), MODEL)
    return build_app(backend, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=MAX_BODY)


@pytest.fixture(scope="module")
def server(app) -> Iterator[ServerThread]:
    with ServerThread(app) as srv:
        yield srv


def raw(
    server: ServerThread,
    method: str,
    path: str,
    headers: list[tuple[str, str]] = (),
    body: bytes = b"",
) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request sent byte for byte as given."""
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: 127.0.0.1:{server.port}",
        "Connection: close",
        f"Content-Length: {len(body)}",
        "Content-Type: application/json",
        *(f"{k}: {v}" for k, v in headers),
    ]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


def spellings(path: str) -> list[str]:
    """The route as written, doubled slashes, a trailing slash, a percent-encoded letter and
    an encoded slash."""
    i = path.index("/", 1) if path.count("/") > 1 else len(path)
    encoded = f"/%{ord(path[1]):02X}{path[2:]}"
    return [
        path,
        "/" + path,
        path.replace("/", "//"),
        path + "/",
        encoded,
        path[:i] + "%2F" + path[i + 1 :] if i < len(path) else path + "%2F",
    ]


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route in the app's OpenAPI schema and of its docs pages, path
    parameters filled in."""
    out = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")]
    for path, operations in app.openapi()["paths"].items():
        out += [(m.upper(), re.sub(r"\{[^}]+\}", "x", path)) for m in operations]
    return out


def test_every_route_is_covered(app):
    paths = {p for _, p in routes(app)}
    assert {
        "/v1/chat/completions",
        "/generate",
        "/admin/pause",
        "/metrics",
        "/health",
        "/sessions",
    } <= paths


def test_no_spelling_of_a_route_answers_without_a_key(app, server):
    leaks = []
    for method, path in routes(app):
        if path == "/health":
            continue
        for spelled in spellings(path):
            status, _ = raw(server, method, spelled, body=b"{}")
            if status < 300 or status >= 500:
                leaks.append((method, spelled, status))
        status, body = raw(server, method, path, body=b"{}")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", path
    assert not leaks


def test_no_spelling_of_an_admin_route_takes_a_user_key(app, server):
    user = [("Authorization", f"Bearer {USER_KEY}")]
    leaks = []
    for method, path in routes(app):
        if not path.startswith("/admin/"):
            continue
        for spelled in spellings(path):
            status, _ = raw(server, method, spelled, user, body=b"{}")
            if status < 300 or status >= 500:
                leaks.append((method, spelled, status))
        assert raw(server, method, path, user, body=b"{}")[0] == 403, path
    assert not leaks


def test_the_right_keys_still_open_their_routes(server):
    user = [("Authorization", f"Bearer {USER_KEY}")]
    admin = [("Authorization", f"Bearer {ADMIN_KEY}")]
    assert raw(server, "GET", "/v1/models", user)[0] == 200
    assert raw(server, "GET", "//v1//models", user)[0] in (200, 404)  # never 401 with the key
    assert raw(server, "GET", "/admin/weight_version", admin)[0] == 200
    assert raw(server, "GET", "/health")[0] == 200


@pytest.mark.parametrize(("count", "size"), [(150, 10), (60, 2_000), (2_000, 200)])
def test_header_floods_get_431(server, count, size):
    user = [("Authorization", f"Bearer {USER_KEY}")]
    flood = [(f"x-pad-{i}", "a" * size) for i in range(count)]
    status, body = raw(server, "GET", "/v1/models", user + flood)
    assert status == 431
    if body:  # the server itself may refuse a flood this large before the app sees it
        assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert raw(server, "GET", "/v1/models", user + flood[:20])[0] == 200


def test_keys_never_reach_the_logs(server, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-key-7f3a"
    for key in (wrong, USER_KEY, ADMIN_KEY):
        for path in ("/v1/models", "/admin/weight_version", "/nope"):
            raw(server, "GET", path, [("Authorization", f"Bearer {key}")])
    raw(server, "POST", "/generate", [("Authorization", f"Bearer {USER_KEY}")], b"{bad json")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert not [k for k in (wrong, USER_KEY, ADMIN_KEY) if k in logged]
