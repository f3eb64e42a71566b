"""`raylane bench weights`' collective rows: the same bytes broadcast by a trainer process over
gloo, into the serving cluster through vLLM's routes (receive, load, commit: a whole
transaction), and into bare receiver processes (the raw broadcast floor, nothing loaded), with
the same world size. Timed from the trainer's go to the commit's answer; best of `repeats`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from raylane.bench.weight_sender import GROUP

# seconds between updates, as rollouts space them in an RL loop: a commit re-packs the oneDNN
# copies of what it changed beside serving (RunnerWeights.finish), not in the next update
BETWEEN_UPDATES_S = 1.5


class Sender:
    """One `raylane.bench.weight_sender` process (a trainer, or a bare receiver)."""

    def __init__(self, plan: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "raylane.bench.weight_sender", json.dumps(plan)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            raise RuntimeError(f"weight sender: expected {word!r}, got {line!r}")
        return line

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def time_raw(model_dir: str, world_size: int, repeats: int, packing: dict, port: int) -> list:
    """Seconds per broadcast of every tensor from rank 0 to `world_size - 1` bare receivers."""
    base = {"model": model_dir, "port": port, "world_size": world_size, **packing}
    procs = [Sender({**base, "role": "send", "rank": 0})]
    procs += [Sender({**base, "role": "receive", "rank": r}) for r in range(1, world_size)]
    try:
        for p in procs:
            p.expect("joined")
        seconds = []
        for _ in range(repeats):
            for p in procs:
                p.go()
            seconds.append(max(float(p.expect("done").split()[1]) for p in procs))
        return seconds
    finally:
        for p in procs:
            p.close()


def time_collective(
    url: str,
    admin_key: str,
    model_dir: str,
    world_size: int,
    repeats: int,
    packing: dict,
    port: int,
    versions,
) -> list:
    """Seconds per update over vLLM's routes: pause(keep), start, update_weights while the
    trainer broadcasts, finish (the commit), resume; timed from the trainer's go to finish.
    Updates are `BETWEEN_UPDATES_S` apart."""
    import httpx

    trainer = Sender(
        {"model": model_dir, "port": port, "world_size": world_size, "role": "send", "rank": 0}
        | packing
    )
    headers = {"Authorization": f"Bearer {admin_key}"}
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
    init |= {"world_size": world_size, "backend": "gloo", "group_name": GROUP}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
            _ok(http.post("/init_weight_transfer_engine", json={"init_info": init}))
            trainer.expect("joined")
            update = _update_info(model_dir, packing)
            seconds = []
            for _ in range(repeats):
                seconds.append(_timed_update(http, trainer, update, str(next(versions))))
                time.sleep(BETWEEN_UPDATES_S)
            return seconds
    finally:
        trainer.close()


def _timed_update(http: Any, trainer: Sender, update: dict, version: str) -> float:
    """One update through vLLM's routes, paused around it; seconds from the trainer's go to
    finish (the commit)."""
    _ok(http.post("/pause", params={"mode": "keep"}))
    _ok(http.post("/start_weight_update", json={"is_checkpoint_format": True}))
    start = time.perf_counter()
    trainer.go()
    _ok(http.post("/update_weights", json={"update_info": update}))
    _ok(http.post("/finish_weight_update", json={"weight_version": version}))
    seconds = time.perf_counter() - start
    trainer.expect("done")
    _ok(http.post("/resume"))
    return seconds


def _update_info(model_dir: str, packing: dict) -> dict:
    from raylane.bench.weight_sender import load_named

    named = load_named(model_dir)
    return {
        "names": [n for n, _ in named],
        "dtype_names": ["float32"] * len(named),
        "shapes": [list(t.shape) for _, t in named],
        "packed": packing.get("packed", False),
        "packed_buffer_size_bytes": packing.get("buffer", 1 << 30),
    }


def _ok(response) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url.path}: {response.status_code} {response.text}")
