"""A trainer process for the collective weight-transfer tests (`Trainer` starts one): rank 0
of a gloo group built the way SGLang's trainers build it (`init_custom_process_group`: a
TCPStore rendezvous at tcp://host:port, the keys under the group name, torch's own
process-group helper), then the peer's broadcasts of HF-named tensors read from a
safetensors file, in order.

    python tests/weight_trainer.py '{"port", "world_size", "group", "file", "names",
                                     "packed", "buffer", "stop_after"}'

Prints "joined" once in the group; waits for a line on stdin before broadcasting (so a test
can make its HTTP call first, as a trainer does); `stop_after`: exit after that many
broadcasts (a trainer that dies mid-update).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from raylane.launch import free_port
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

GROUP = "weight_update_group"
ROOT = Path(__file__).resolve().parents[1]


def trainer_specs(model_dir: str) -> list[dict]:
    """The specs of a model's tensors as a trainer announces them (its file's order)."""
    from safetensors import safe_open

    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        return [
            {"name": n, "shape": list(f.get_slice(n).get_shape()), "dtype": "float32"}
            for n in f.keys()  # noqa: SIM118
        ]


class Trainer:
    """Rank 0 in its own process; `send()` makes it broadcast the update once."""

    backend = "gloo"
    module = "tests.weight_trainer"  # the process's program (tests/gpu/nccl_trainer.py: NCCL)

    def __init__(self, v1_dir: str, specs: list[dict], world_size: int = 2, **plan) -> None:
        self.port = free_port()
        self.world_size = world_size
        plan = {"port": self.port, "world_size": world_size, "group": GROUP, **plan}
        plan.update(file=f"{v1_dir}/model.safetensors", names=[s["name"] for s in specs])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, json.dumps(plan)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def info(self) -> dict:
        where = {"master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1}
        return {
            **where,
            "world_size": self.world_size,
            "group_name": GROUP,
            "backend": self.backend,
        }

    def line(self) -> str:
        """The process's next line ("joined", "sent")."""
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def send(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def join(port: int, world_size: int, group: str, rank: int = 0):
    """The trainer's side of the group as `rank` (0 hosts the store: SGLang's scheme; TRL's
    trainer is the last rank, and inference rank 0 hosts it)."""
    timeout = datetime.timedelta(seconds=60)
    url = f"tcp://127.0.0.1:{port}"
    store, _, _ = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend("gloo"), PrefixStore(group, store),
        group_name=group, backend_options=None, timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def chunks(tensors: list[torch.Tensor], packed: bool, buffer: int) -> list[torch.Tensor]:
    """vLLM's packing: tensors appended until the byte count first exceeds `buffer`."""
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
    plan = json.loads(sys.argv[1])
    pg = join(plan["port"], plan["world_size"], plan["group"])
    print("joined", flush=True)
    weights = load_file(plan["file"])
    tensors = [weights[name] for name in plan["names"]]
    for _ in sys.stdin:  # one update per line
        for i, t in enumerate(chunks(tensors, plan.get("packed", False), plan.get("buffer", 1))):
            if i == plan.get("stop_after"):
                os._exit(0)  # dies mid-update, the group left half sent
            torch.distributed.broadcast(t, src=0, group=pg)
        print("sent", flush=True)
    os._exit(0)  # NOTE: gloo aborts on a normal exit with its group alive


if __name__ == "__main__":
    main()
