"""Answers a test got from an app outside the fuzzers (real sequences schemathesis cannot
build, such as a trainer's collective weight transfers), checked against the app's OpenAPI
schema as tests/e2e/test_fuzz_schema.py checks the fuzzed ones: a documented status and a body
that validates."""

from __future__ import annotations

import datetime

import httpx


def answer_problems(app, answers: list[httpx.Response]) -> list[tuple]:
    """(method, path, status, problem) for every answer that disagrees with the schema."""
    import schemathesis
    from schemathesis.core.failures import Failure, FailureGroup

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    found = []
    for answer in answers:
        request = answer.request
        operation = schema[request.url.path][request.method]
        answer.elapsed = datetime.timedelta(0)  # read already; schemathesis asks for it
        try:
            operation.validate_response(answer)
        except FailureGroup as group:
            for f in group.exceptions:
                found.append((request.method, request.url.path, answer.status_code, f.title))
        except Failure as f:  # one failure comes alone
            found.append((request.method, request.url.path, answer.status_code, f.title))
    return found


def recorded(method: str, path: str, status: int, body) -> httpx.Response:
    """An answer another process got and reported, as a response to check."""
    request = httpx.Request(method, f"http://raylane{path}")
    return httpx.Response(status, json=body, request=request)
