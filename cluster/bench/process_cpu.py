"""Where the serving path's CPU goes: CPU seconds per process over `raylane bench serve`'s timed
passes (`--cpu-by-process`), for this process's whole tree: this process (the load generator,
and Ray's driver) and its children, the local Ray cluster the bench started (GCS, raylet, the
Serve controller, the ingress, the Router, the engine replica, ...). Read from psutil's counters
at the start and end of each pass; a process's name is its Ray title (`ray::EngineReplica`) or
its program's file name. The engine replica's CPU is also split by thread: its main thread,
its busiest other thread (the runner: the forward), the next busiest (at 2 torch threads the
OpenMP worker, at 1 the replica's event loop: admission, the engine's bookkeeping, the output
channel), and the rest (Ray's own threads).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

THIS = "this process (load generator, Ray driver)"
REPLICA = "ray::EngineReplica"


class ProcessCpu:
    def __init__(self) -> None:
        self.used: dict[str, float] = defaultdict(float)  # name -> CPU seconds, every pass
        self.replica_threads: dict[str, float] = defaultdict(float)  # the replica's, by role
        self.wall_s = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        before, threads, start = _cpu_times(), _replica_threads(), time.perf_counter()
        yield
        after, self.wall_s = _cpu_times(), self.wall_s + time.perf_counter() - start
        for pid, (name, cpu_s) in after.items():
            self.used[name] += cpu_s - before.get(pid, (name, 0.0))[1]
        for role, cpu_s in _by_role(threads, _replica_threads()).items():
            self.replica_threads[role] += cpu_s

    def table(self, http_tokens: int, offline: list) -> str:
        """The table, then the CPU each output token cost: over HTTP, every process but this
        one (the server's); offline, the engine's process (`offline`: its `RunResult`s)."""
        total = sum(self.used.values())
        lines = [
            f"\nCPU by process over the timed passes ({self.wall_s:.1f} s wall, "
            f"{total:.1f} CPU s in all):",
            "| process | CPU s | share of the CPU used | cores busy |",
            "|---|---|---|---|",
        ]
        for name, cpu_s in sorted(self.used.items(), key=lambda kv: -kv[1]):
            if cpu_s >= 0.05:
                share, cores = cpu_s / max(total, 1e-9), cpu_s / max(self.wall_s, 1e-9)
                lines.append(f"| {name} | {cpu_s:.1f} | {share:.1%} | {cores:.2f} |")
        for role, cpu_s in self.replica_threads.items():
            ms = 1e3 * cpu_s / max(http_tokens, 1)
            lines.append(f"| {REPLICA}: {role} | {cpu_s:.1f} | {ms:.2f} ms a token | |")
        http_ms = 1e3 * (total - self.used[THIS]) / max(http_tokens, 1)
        lines.append(f"server CPU per output token: HTTP {http_ms:.1f} ms")
        if offline:
            off_ms = (
                1e3 * sum(r.cpu_s for r in offline) / max(sum(r.output_tokens for r in offline), 1)
            )
            lines[-1] += f", offline {off_ms:.1f} ms (HTTP keeps {off_ms / http_ms:.0%} per CPU s)"
        return "\n".join(lines)


def _cpu_times() -> dict[int, tuple[str, float]]:
    import psutil

    me = psutil.Process()
    found = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            name = THIS if proc.pid == me.pid else _name(proc.cmdline())
        except psutil.Error:  # it exited meanwhile
            continue
        found[proc.pid] = (name, times.user + times.system)
    return found


def _name(cmdline: list[str]) -> str:
    if not cmdline:
        return "?"
    if cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0]
    script = next((a for a in cmdline[1:] if a.endswith(".py")), cmdline[0])
    return os.path.basename(script)


def _replica_threads() -> dict[int, float]:
    """CPU seconds of each thread (by id) of the engine replica, main thread under its pid."""
    import psutil

    found: dict[int, float] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if _name(proc.cmdline()) == REPLICA:
                found.update({t.id: t.user_time + t.system_time for t in proc.threads()})
                found[-1] = proc.pid  # which thread is the main one
        except psutil.Error:
            continue
    return found


def _by_role(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """The threads' CPU over the pass: the main thread, the two busiest others, the rest."""
    main = int(after.pop(-1, -1))
    used = {tid: cpu_s - before.get(tid, 0.0) for tid, cpu_s in after.items()}
    roles = {"main thread": used.pop(main, 0.0)}
    busiest = sorted(used.values(), reverse=True)
    roles["busiest other thread (the runner)"] = busiest[0] if busiest else 0.0
    roles["2nd busiest other thread"] = busiest[1] if len(busiest) > 1 else 0.0
    roles["all other threads"] = sum(busiest[2:])
    return roles
