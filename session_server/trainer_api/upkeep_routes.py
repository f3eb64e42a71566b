"""Sleep and weight checks: vLLM's /sleep, /wake_up, /is_sleeping and /weight_checker, SGLang's
/weights_checker. Sleep frees every replica's KV cache (both levels; the weights stay: see
docs/trainers.md); the checkers hash every parameter on every rank, or overwrite them with
seeded noise, so a trainer can prove that a transfer restored them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, Response
from raylane.session_server.backend import ControlBackend
from raylane.session_server.errors import APIError, bad_request
from raylane.session_server.openapi import ok
from raylane.session_server.trainer_api.common import control_of, is_paused
from raylane.session_server.trainer_api.schemas import (
    CheckerBody,
    CheckerResult,
    IsSleeping,
    SGLangCheckerBody,
    SGLangCheckerResult,
)

router = APIRouter(tags=["vLLM RL API"])
control = APIRouter(tags=["vLLM RL API"])
EMPTY = ok(description="Done: an empty body")
SEED = 0  # the noise "reset" writes: the same on every rank and replica


@control.post("/sleep", response_class=Response, responses=EMPTY)
async def sleep(request: Request, level: int = Query(1)) -> Response:
    """Requests in flight end ("abort"), new ones wait; every replica's KV cache is freed."""
    await control_of(request).sleep(level)
    return Response(status_code=200)


@control.post("/wake_up", response_class=Response, responses=EMPTY)
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> Response:
    unknown = sorted(set(tags or ()) - {"kv_cache", "weights"})
    if unknown:
        raise bad_request(f"tags: {unknown} are not 'kv_cache' or 'weights'", "tags")
    await control_of(request).wake_up(tags)
    return Response(status_code=200)


@router.get("/is_sleeping", response_model=None, responses=ok(IsSleeping))
async def is_sleeping(request: Request) -> dict:
    answers = await control_of(request).call_replicas("is_sleeping")
    return {"is_sleeping": any(answers.values())}


@control.post("/weight_checker", response_model=None, responses=ok(CheckerResult))
async def weight_checker(body: CheckerBody, request: Request) -> dict:
    """vLLM's: "checksum" (sha256 per parameter), "reset" (noise into every weight),
    "compare" (against the caller's `baseline`). 409 while paused, as vLLM."""
    ctl = control_of(request)
    if await is_paused(ctl):
        raise APIError(409, "weight_checker needs a running (not paused) engine", code="paused")
    if body.action == "reset":
        await ctl.call_replicas("reset_weights", SEED)
        return {"status": "reset"}
    checksums = await agreed_checksums(ctl)
    if body.action == "checksum":
        return {"checksums": checksums}
    if body.baseline is None:
        raise bad_request("baseline: action 'compare' needs the checksums to compare", "baseline")
    return {"match": not (bad := mismatches(body.baseline, checksums)), "mismatches": bad}


@control.post("/weights_checker", response_model=None, responses=ok(SGLangCheckerResult))
async def weights_checker(body: SGLangCheckerBody, request: Request) -> dict:
    """SGLang's: "snapshot" remembers the checksums (in this ingress), "reset_tensors" writes
    noise, "compare" checks the weights against the snapshot, "checksum" returns them."""
    ctl = control_of(request)
    if body.action == "reset_tensors":
        await ctl.call_replicas("reset_weights", SEED)
        return {"success": True, "message": "every weight was overwritten with seeded noise"}
    checksums = await agreed_checksums(ctl)
    if body.action == "snapshot":
        request.app.state.weight_snapshot = checksums
        return {"success": True, "message": f"snapshot of {len(checksums)} tensors"}
    if body.action == "checksum":
        return {"success": True, "message": f"{len(checksums)} tensors", "checksums": checksums}
    snapshot = getattr(request.app.state, "weight_snapshot", None)
    if snapshot is None:
        raise bad_request("action: 'compare' needs a 'snapshot' first", "action")
    bad = mismatches(snapshot, checksums)
    message = "the weights equal the snapshot" if not bad else f"differ: {bad[:10]}"
    return {"success": not bad, "message": message, "mismatches": bad}


async def agreed_checksums(ctl: ControlBackend) -> dict[str, str]:
    """Every replica's checksums, which must agree (they serve one version)."""
    answers: dict[str, Any] = await ctl.call_replicas("weight_checksums")
    first, *rest = answers.values()
    for other in rest:
        if bad := mismatches(first, other):
            raise APIError(
                409, f"replicas hold different weights: {bad[:5]}", code="replicas_disagree"
            )
    return first


def mismatches(baseline: dict[str, str], current: dict[str, str]) -> list[str]:
    """Names whose checksum differs, or that one side lacks."""
    names = sorted(set(baseline) | set(current))
    return [n for n in names if baseline.get(n) != current.get(n)]
