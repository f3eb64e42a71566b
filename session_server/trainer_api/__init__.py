"""The trainer protocols, each a thin layer over raylane's one control plane and generation path,
so a trainer's unmodified client drives raylane as it drives the server it was written for:
vLLM's RL API (`vllm_routes`, `vllm_generate`), SGLang's native API (`sglang_routes`; its
/generate is raylane's own, answering SGLang's exact shape while these routes are on) and TRL's
`trl vllm-serve` routes (`trl_routes`, `trl_weights`) and SkyRL's additions (`skyrl_routes`).
Off unless asked for (`raylane serve --trainer-api`).

Each module holds two routers: `router`, the routes any user may call (reads, generation), and
`control`, those that change state, which the admin key guards when one is configured. A new
protocol module is one more entry in `MODULES`.
"""

from __future__ import annotations

from fastapi import FastAPI
from raylane.session_server.openapi import ERRORS
from raylane.session_server.trainer_api import (
    disk_update,
    lora_skyrl,
    sglang_routes,
    sglang_weights,
    skyrl_routes,
    trl_routes,
    trl_weights,
    upkeep_routes,
    vllm_generate,
    vllm_routes,
    vllm_weights,
)

MODULES = (
    vllm_routes,
    vllm_generate,
    vllm_weights,
    upkeep_routes,
    sglang_routes,
    sglang_weights,
    disk_update,
    skyrl_routes,
    lora_skyrl,
    trl_routes,
    trl_weights,
)


def mount(app: FastAPI) -> frozenset[str]:
    """Add every trainer protocol's routes to `app`; the paths of those that change state."""
    guarded: set[str] = set()
    for module in MODULES:
        for router in (module.router, module.control):
            app.include_router(router, responses=ERRORS)  # the OpenAI error body
        guarded.update(route.path for route in module.control.routes)
    return frozenset(guarded)
