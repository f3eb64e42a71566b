"""The processes of `raylane bench weights`' collective rows: a trainer (rank 0) that
broadcasts a model's float32 tensors over a gloo group, and bare receivers (the raw broadcast
floor: the same bytes into preallocated buffers, nothing loaded). Each runs in its own process,
as a trainer does (a gloo group joins in a constructor that holds the GIL).

    python -m raylane.bench.weight_sender '{"role": "send"|"receive", "model", "port",
                                            "rank", "world_size", "packed", "buffer"}'

Prints "joined"; then one broadcast of every tensor per line read on stdin, "done <seconds>"
after each.
"""

from __future__ import annotations

import json
import os
import sys
import time

GROUP = "weight_update_group"  # the default name


def load_named(model_dir: str) -> list:
    """The checkpoint's tensors in HF names, float32 (what a trainer would send)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def chunks(tensors: list, packed: bool, buffer: int) -> list:
    """What travels per broadcast: each tensor, or vLLM's packed chunks (tensors appended in
    order until the byte count first exceeds `buffer`)."""
    import torch

    if not packed:
        return tensors
    out, part, size = [], [], 0
    for t in tensors:
        part.append(t.contiguous().view(torch.uint8).view(-1))
        size += part[-1].numel()
        if size > buffer:
            out.append(torch.cat(part))
            part, size = [], 0
    return out + ([torch.cat(part)] if part else [])


def main() -> None:
    import torch
    from raylane.actors.runner.group_info import GroupInfo
    from raylane.actors.runner.weight_group import GlooGroup

    plan = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    tensors = [t for _, t in load_named(plan["model"])]
    if plan["role"] == "receive":
        tensors = [torch.empty_like(t) for t in tensors]  # receive buffers, reused
    payload = chunks(tensors, plan.get("packed", False), plan.get("buffer", 1 << 30))
    info = GroupInfo("127.0.0.1", plan["port"], 1, plan["world_size"], GROUP)
    group = GlooGroup(info, plan["rank"])
    print("joined", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        for t in payload:
            group.broadcast(t)
        print(f"done {time.perf_counter() - start:.6f}", flush=True)
    os._exit(0)  # NOTE: gloo aborts on a normal exit with its group alive


if __name__ == "__main__":
    main()
