"""`raylane bench serve`'s table: each system's rounds (median tok/s, pooled latencies) and the
HTTP/offline ratio as the median of paired rounds."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from raylane.bench.serve_load import RunResult


@dataclass
class Rows:
    """One system's runs, one per round."""

    name: str
    runs: list[RunResult] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return statistics.median(r.tok_s for r in self.runs)

    def pooled(self, attr: str) -> list[float]:
        return [x for r in self.runs for x in getattr(r, attr)]


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1e3:.0f}"


def print_table(rows: list[Rows], num: int) -> None:
    http = rows[0]
    rounds = len(http.runs)
    print(
        f"\nworkload: {num} chat requests per round, greedy, float32; {rounds} round(s), "
        "output tok/s and req/s: median over rounds, latencies: pooled"
    )
    print(
        "| system | req/s | output tok/s | per round | raylane HTTP / this | TTFT p50 ms "
        "| TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        req_s = statistics.median(r.requests / r.wall_s for r in row.runs)
        per_round = " ".join(f"{r.tok_s:.1f}" for r in row.runs)
        ttft, itl = row.pooled("ttft"), row.pooled("itl")
        print(
            f"| {row.name} | {req_s:.2f} | {row.tok_s:.1f} | {per_round} | "
            f"{http.tok_s / row.tok_s:.2f} | {_pct(ttft, 0.5)} | {_pct(ttft, 0.99)} | "
            f"{_pct(itl, 0.5)} | {_pct(itl, 0.99)} | {sum(r.errors for r in row.runs)} |"
        )
    if len(rows) > 1 and rows[1].name.startswith("raylane offline"):
        ratios = [h.tok_s / o.tok_s for h, o in zip(http.runs, rows[1].runs)]
        each = ", ".join(f"{100 * x:.0f}%" for x in ratios)
        print(
            f"\nHTTP keeps {100 * statistics.median(ratios):.0f}% of the offline engine's "
            f"output tok/s (median of {rounds} paired round(s): {each})"
        )
