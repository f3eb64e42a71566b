r"""vLLM's CPU build on `raylane bench spec`'s workloads: without speculation and with ngram.

Reads the JSON of `spec_workloads.py` (the same token-id prompts and sampling params raylane
measures), runs each cell on two `vllm.LLM` engines that differ only in `speculative_config`
(alternating, the best of --repeats, after one warm-up run each), and prints a table like
`raylane bench spec`'s: output tok/s over the whole `generate`, the ratio to no speculation,
CPU seconds of this process and of the engine's own processes (a measure the machine's load
moves less), ngram's acceptance and mean accepted length (vLLM's spec-decode counters), and
whether the outputs equal the run without speculation. Not a test (pytest never collects
benchmarks/).

Run with the peer's venv, from a directory outside the project (vLLM spawns its engine core):

    source /work/shared/peers/vllm_env.sh          # VPY, VENV; installs once (3.4 GB)
    cd /tmp && VLLM_CPU_KVCACHE_SPACE=2 \
      LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VENV/lib/libiomp5.so \
      $VPY REPO/benchmarks/peers/vllm_spec.py /tmp/spec_workloads.json --repeats 2

The script needs its `__main__` guard: vLLM spawns its engine core, which re-imports the main
module (a script without the guard fails with "Engine core initialization failed"). On 2 cores,
vLLM's default `VLLM_CPU_OMP_THREADS_BIND=auto` runs the model worker's OpenMP threads on core 0
alone and reserves core 1 for the engine core (scheduler); `VLLM_CPU_OMP_THREADS_BIND=0-1` gives
the worker both cores, beside the scheduler (`nobind` leaves the OpenMP settings alone). The
value is `auto`, `nobind` or a CPU list: `all` makes the engine core fail at start-up
(`ValueError: invalid literal for int() with base 10: 'all'`, then "Engine core
initialization failed").
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import psutil

COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def ngram_config(args: argparse.Namespace) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }


@dataclass
class Engine:
    llm: object
    pids: list[int]  # the processes vLLM started for it (engine core, model worker)


def build(model_dir: str, spec: dict | None, args: argparse.Namespace) -> Engine:
    from vllm import LLM

    before = own_children()
    llm = LLM(
        model=model_dir,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        speculative_config=spec,
        disable_log_stats=False,  # the spec-decode counters
        seed=0,
    )
    return Engine(llm, sorted(own_children() - before))


def own_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def counters(llm) -> tuple[float, ...]:
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return tuple(float(values.get(name, 0)) for name in COUNTERS)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of this process and of one engine's processes (not the other's)."""
    total = 0.0
    for pid in [os.getpid(), *pids]:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_once(engine: Engine, prompts, params) -> dict:
    llm = engine.llm
    before, cpu0 = counters(llm), cpu_seconds(engine.pids)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    cpu, after = cpu_seconds(engine.pids) - cpu0, counters(llm)
    ids = [list(c.token_ids) for o in outs for c in o.outputs]
    tokens = sum(len(t) for t in ids)
    drafts, drafted, accepted = (a - b for a, b in zip(after, before))
    return {
        "tok_s": tokens / seconds,
        "cpu_tok_s": tokens / cpu if cpu else 0.0,
        "tokens": tokens,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted": 1 + accepted / drafts if drafts else None,
        "ids": ids,
    }


def measure(engines: dict, cell: dict, repeats: int) -> dict[str, dict]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in cell["prompts"]]
    params = [SamplingParams(**p) for p in cell["params"]]
    for engine in engines.values():
        engine.llm.generate(prompts, params, use_tqdm=False)  # warm
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for method, engine in engines.items():
            r = run_once(engine, prompts, params)
            if method not in best or r["tok_s"] > best[method]["tok_s"]:
                best[method] = r
    return best


def print_rows(cell: dict, best: dict[str, dict], header: bool) -> None:
    if header:
        print(
            "| workload | batch | method | tok/s | vs off | CPU tok/s | vs off (CPU) "
            "| acceptance | mean accepted len | same as off |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
    off = best["off"]
    for method, r in best.items():
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        mal = "-" if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f}"
        same = "yes" if r["ids"] == off["ids"] else "NO"
        print(
            f"| {cell['workload']} | {cell['batch']} | {method} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / off['tok_s']:.2f}x | {r['cpu_tok_s']:.1f} | "
            f"{r['cpu_tok_s'] / off['cpu_tok_s']:.2f}x | {acc} | {mal} | {same} |",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workloads", help="the JSON written by spec_workloads.py")
    parser.add_argument("--model", help="HF directory (default: the JSON's model_dir)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (raylane: 4)")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min (raylane: 2)")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max (raylane: 4)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    with open(args.workloads) as f:
        dump = json.load(f)
    model_dir = args.model or dump["model_dir"]
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    print(f"vLLM on {model_dir}, {args.dtype}, VLLM_CPU_OMP_THREADS_BIND={bind}", flush=True)
    engines = {
        "off": build(model_dir, None, args),
        "ngram": build(model_dir, ngram_config(args), args),
    }
    for i, cell in enumerate(dump["cells"]):
        print_rows(cell, measure(engines, cell, args.repeats), header=i == 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
