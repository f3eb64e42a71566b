"""`python -m benchmarks sessions`: memory of the session registry with routed-expert blob
dropping on and off, and the registry's own time per turn.

Many concurrent agent sessions run many turns through the real `SessionRegistry` (template
splicing, rollback planning, commit, retention) in one process. Generation is a model-free fake
that answers ~`--tokens-per-turn` new tokens per turn and returns a routed-expert blob of
`--blob-bytes-per-token` over the whole prefix, as an MoE engine does. Blobs are zero-filled
numpy arrays that tracemalloc counts in full; unless `--touch` writes them, their pages stay
unwritten (glibc is told to mmap every large block), so the run needs little RAM — with
`--touch` it needs the retained bytes in RAM, and RSS follows them too.

With dropping off the registry keeps every turn's blob, O(turns x prefix): 64 sessions x 50
turns would be ~80 GB, so that case runs `--off-sessions` sessions (per-session numbers compare
directly).
"""

from __future__ import annotations

import argparse
import random
import re
import time
from dataclasses import dataclass, field


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions (64)")
    parser.add_argument("--turns", type=int, default=50, help="turns per session (50)")
    parser.add_argument(
        "--tokens-per-turn",
        type=int,
        default=1000,
        help="new tokens per turn, prompt + output (1000)",
    )
    parser.add_argument(
        "--output-share",
        type=float,
        default=0.8,
        help="share of a turn's new tokens the model generates (0.8)",
    )
    parser.add_argument(
        "--blob-bytes-per-token",
        type=int,
        default=1024,
        help="routed-expert bytes per token, a multiple of 128 (1024)",
    )
    parser.add_argument("--max-rollback-steps", type=int, default=1)
    parser.add_argument(
        "--off-sessions", type=int, default=4, help="sessions for the run with dropping off (4)"
    )
    parser.add_argument(
        "--touch",
        action="store_true",
        help="write every blob byte (real RSS; needs the retained bytes in RAM)",
    )
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Case:
    name: str
    sessions: int
    drop: bool
    traced: bool = True


@dataclass
class Result:
    case: Case
    turns: int
    final_prefix: int = 0  # tokens of the longest session at the end
    final_blob: int = 0  # bytes of that session's last blob
    max_retained_per_session: int = 0
    retained_total: int = 0
    heap: int = 0  # tracemalloc, at the end with every session alive
    heap_peak: int = 0
    heap_after_delete: int = 0
    gen_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def us_per_turn(self) -> float:
        return (self.wall_seconds - self.gen_seconds) / (self.case.sessions * self.turns) * 1e6


class SyntheticTokenizer:
    """ChatML rendering and one id per word of a fixed word list: enough for the splicer, no
    model files, and cheap, so the timing measures the registry rather than a tokenizer."""

    eos_token_id = 2

    def __init__(self, words: list[str]) -> None:
        self.vocab = {"<|im_start|>": 1, "<|im_end|>": 2, "\n": 3}
        for w in ["system", "user", "assistant", "tool", *words]:
            self.vocab.setdefault(w, len(self.vocab) + 1)
        self._split = re.compile(r"<\|im_(?:start|end)\|>|\n|[^\s<]+")

    def apply_chat_template(
        self, conversation, tools=None, add_generation_prompt=False, tokenize=False, **kwargs
    ) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(map(self.vocab.__getitem__, self._split.findall(text)))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


@dataclass
class Workload:
    """Pools of pre-made user texts and replies, so the client and the fake model cost
    little next to the registry."""

    tokenizer: SyntheticTokenizer
    user_texts: list[str]
    replies: list[tuple[str, list[int]]]
    rng: random.Random
    gen_seconds: float = 0.0
    blob_shape: tuple[int, int] = (32, 8)
    touch: bool = False
    retained_max: dict[str, int] = field(default_factory=dict)


def run(args: argparse.Namespace) -> int:
    if args.blob_bytes_per_token % 128:
        raise SystemExit("--blob-bytes-per-token must be a multiple of 128 (32 layers x int32)")
    _mmap_large_blocks()
    k = args.max_rollback_steps
    cases = [
        Case("timing (no tracemalloc)", args.sessions, True, traced=False),
        Case("dropping on", args.sessions, True),
        Case("dropping off", args.off_sessions, False),
    ]
    results = [_run_case(c, args) for c in cases]
    print(_table(results, args, k))
    return 0


def _mmap_large_blocks() -> None:
    """Pin glibc's mmap threshold at 128 KiB. By default it rises to the size of the largest
    freed block (up to 32 MiB), after which blobs come from the heap, where calloc has to write
    zeros into recycled memory — pages the benchmark means to leave untouched."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: RSS may then exceed what --touch implies
        pass


def _run_case(case: Case, args: argparse.Namespace) -> Result:
    import asyncio
    import gc
    import tracemalloc

    gc.collect()
    if case.traced:
        tracemalloc.start()
    try:
        result = asyncio.run(_drive(case, args))
        if case.traced:
            result.heap_after_delete = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return result


async def _drive(case: Case, args: argparse.Namespace) -> Result:
    import asyncio
    import gc
    import tracemalloc

    from raylane.router.sessions import SessionConfig, SessionRegistry
    from raylane.router.tito import TemplateSplicer

    work = _workload(args)
    registry = SessionRegistry(
        TemplateSplicer(work.tokenizer),
        _generator(work),
        SessionConfig(max_rollback_steps=args.max_rollback_steps, drop_blobs=case.drop),
    )
    ids = [await registry.create() for _ in range(case.sessions)]
    start = time.process_time()
    await asyncio.gather(*(_session(registry, sid, args.turns, work, case.traced) for sid in ids))
    result = Result(
        case, args.turns, wall_seconds=time.process_time() - start, gen_seconds=work.gen_seconds
    )
    trajectories = [(await registry.get(sid)).trajectory for sid in ids]
    longest = max(trajectories, key=lambda t: t.num_tokens)
    result.final_prefix = longest.num_tokens
    result.final_blob = longest.records[-1].blob_bytes
    result.max_retained_per_session = max(work.retained_max.values(), default=0)
    result.retained_total = registry.retained_blob_bytes()
    if case.traced:
        result.heap, result.heap_peak = tracemalloc.get_traced_memory()
    for sid in ids:
        await registry.delete(sid)
    gc.collect()
    return result


async def _session(registry, sid: str, turns: int, work: Workload, observe: bool) -> None:
    messages: list[dict] = []
    for _ in range(turns):
        messages.append({"role": "user", "content": work.rng.choice(work.user_texts)})
        result = await registry.chat(sid, messages)
        messages.append(result.message)
        if observe:
            held = (await registry.get(sid)).trajectory.blob_bytes
            work.retained_max[sid] = max(work.retained_max.get(sid, 0), held)


def _workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    words = [f"w{i}" for i in range(4096)]
    tok = SyntheticTokenizer(words)
    out_words = max(1, round(args.tokens_per_turn * args.output_share) - 1)  # + eos
    user_words = max(1, args.tokens_per_turn - out_words - 8)  # the template adds ~7 per turn
    user_texts = [" ".join(rng.choices(words, k=user_words)) for _ in range(256)]
    reply_texts = [" ".join(rng.choices(words, k=out_words)) for _ in range(256)]
    replies = [(t, tok.encode(t) + [tok.eos_token_id]) for t in reply_texts]
    return Workload(
        tok,
        user_texts,
        replies,
        rng,
        blob_shape=(32, args.blob_bytes_per_token // 128),
        touch=args.touch,
    )


def _generator(work: Workload):
    import numpy as np
    from raylane.actors.engine.outputs import CompletionOutput

    from tests.support.fake_generator import FakeTurnGenerator

    def reply(prompt_ids: list[int]) -> CompletionOutput:
        t0 = time.process_time()
        text, ids = work.rng.choice(work.replies)
        out = CompletionOutput(0, text, list(ids), [-work.rng.random() for _ in ids])
        work.gen_seconds += time.process_time() - t0
        return out

    def blob(prompt_ids: list[int], output_ids: list[int]):
        t0 = time.process_time()
        rows = len(prompt_ids) + len(output_ids) - 1  # every position but the last
        arr = np.zeros((rows, *work.blob_shape), dtype=np.int32)
        if work.touch:
            arr.fill(1)
        work.gen_seconds += time.process_time() - t0
        return arr

    return FakeTurnGenerator(reply, blob, keep_prompts=False)


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _table(results: list[Result], args: argparse.Namespace, k: int) -> str:
    head = (
        f"sessions: {args.tokens_per_turn} new tokens/turn, "
        f"{args.blob_bytes_per_token} B/token routed-expert blobs, max_rollback_steps={k}"
        f"{', blobs touched' if args.touch else ''}\n\n"
        "| case | sessions x turns | final prefix (tokens) | max retained / session (MB) "
        f"| bound ({k}+2) x final blob (MB) | retained total (MB) | heap at end (MB) "
        "| heap peak (MB) | heap after delete (MB) | registry us/turn |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for r in results:
        traced = r.case.traced
        rows.append(
            f"| {r.case.name} | {r.case.sessions} x {r.turns} | {r.final_prefix:,} "
            f"| {_mb(r.max_retained_per_session) if traced else '-'} "
            f"| {_mb((k + 2) * r.final_blob)} | {_mb(r.retained_total)} "
            f"| {_mb(r.heap) if traced else '-'} | {_mb(r.heap_peak) if traced else '-'} "
            f"| {_mb(r.heap_after_delete) if traced else '-'} "
            f"| {r.us_per_turn:,.0f} |"
        )
    return "\n".join([head, *rows])
