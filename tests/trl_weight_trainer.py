"""A trainer process that syncs weights the way TRL's former `VLLMClient` does (TRL <= 0.29:
`init_communicator`, `update_model_params`, `reset_prefix_cache`, `close_communicator`), its
HTTP calls and their order to the byte, with a gloo group in place of vLLM's NCCL helper
(which needs CUDA): the trainer is the last rank, the server's rank 0 hosts the store, and each
tensor is broadcast after its `/update_named_param/` answered, then a barrier.

    python tests/trl_weight_trainer.py '{"url", "port", "file", "names", "bad": {name: shape},
                                         "batch": n}'

`names`: the tensors in the order TRL sends them (`model.named_parameters()`); `bad`: announce
these with a wrong shape (the server must refuse before any byte moves); `batch`: announce n
at a time with `/batch_update_named_params/` (the forks' batched client, Axolotl's), each
announced tensor then broadcast in order with a barrier after each. Prints one JSON line:
every call's [method, path, status, answer body], in order.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import torch
from safetensors.torch import load_file

from tests.weight_trainer import GROUP, join


def main() -> None:
    plan = json.loads(sys.argv[1])
    answers: list[tuple] = []

    def keep(response: httpx.Response) -> None:
        response.read()
        request = response.request
        answers.append((request.method, request.url.path, response.status_code, response.json()))

    with httpx.Client(base_url=plan["url"], timeout=120, event_hooks={"response": [keep]}) as http:
        post = http.post
        server_ranks = http.get("/get_world_size/").json()["world_size"]
        world_size, rank = server_ranks + 1, server_ranks  # the trainer is the last rank
        init = {"host": "0.0.0.0", "port": plan["port"], "world_size": world_size}
        if post("/init_communicator/", json={**init, "client_device_uuid": "cpu"}).is_success:
            time.sleep(0.1)  # as TRL's client does before joining
            pg = join(plan["port"], world_size, GROUP, rank)
            if _update_model_params(post, pg, rank, plan):
                post("/reset_prefix_cache/")
            post("/close_communicator/")
    print(json.dumps(answers), flush=True)
    os._exit(0)  # NOTE: gloo aborts on a normal exit with its group alive


def _update_model_params(post, pg, rank: int, plan: dict) -> bool:
    """One `/update_named_param/` per tensor, then its broadcast and a barrier (TRL's order);
    False once the server refused one (TRL's client raises, and sends nothing)."""
    weights = load_file(plan["file"])
    names, batch = plan["names"], plan.get("batch")
    for start in range(0, len(names), batch or 1):
        part = names[start : start + (batch or 1)]
        bodies = [_announcement(name, weights[name], plan.get("bad", {})) for name in part]
        path, body = (
            ("/batch_update_named_params/", {"updates": bodies})
            if batch
            else ("/update_named_param/", bodies[0])
        )
        if not post(path, json=body).is_success:
            return False
        for name in part:
            torch.distributed.broadcast(weights[name], src=rank, group=pg)
            torch.distributed.barrier(group=pg)
    return True


def _announcement(name: str, tensor: torch.Tensor, bad: dict) -> dict:
    return {"name": name, "dtype": str(tensor.dtype), "shape": bad.get(name, list(tensor.shape))}


if __name__ == "__main__":
    main()
