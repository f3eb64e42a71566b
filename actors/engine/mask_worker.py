"""MaskWorker: computes the grammar masks of a launched step off the engine's thread.

A step's masks can be computed once its rows' grammars have taken every earlier token, that
is once every earlier step was collected; by then the step itself may be running (async
scheduling). The engine hands the step's sequences here and posts the futures to the
executor at once; llguidance computes each row on a pool thread without holding the GIL, so
the engine folds in results and plans the next step meanwhile, and the runner takes the masks
after its forward pass (actors/runner/mask_board.py: a row still computing then is skipped,
not waited for).

One future per row, so one slow grammar state holds one pool thread, not the others. A row
skipped because its mask was late keeps its future: its grammar has not moved, and the next
step takes the same mask.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from raylane.actors.engine.sequence import Sequence


class MaskWorker:
    def __init__(self, vocab_size: int, threads: int | None = None):
        self.words = -(-vocab_size // 32)  # int32 words of one mask
        self.threads = threads or min(8, max(2, os.cpu_count() or 2))
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[int, tuple[int, Future]] = {}  # seq_id -> (tokens it saw, its mask)

    def masks(self, seqs: dict[int, Sequence]) -> dict[int, Future]:
        """Futures of the next-token masks of `seqs` (by seq_id): int32 [words] bit sets, or
        None for a sequence that ended (its token is dropped anyway)."""
        futures = {seq_id: self._mask(seq) for seq_id, seq in seqs.items()}
        # forget finished jobs of sequences this step does not name (ended, or not running)
        self._jobs = {s: j for s, j in self._jobs.items() if s in seqs or not j[1].done()}
        return futures

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _mask(self, seq: Sequence) -> Future:
        if seq.finish_reason is not None or seq.matcher is None:
            done: Future = Future()
            done.set_result(None)
            return done
        seen = len(seq.token_ids)  # the grammar has taken every known token
        job = self._jobs.get(seq.seq_id)
        if job is None or job[0] != seen:
            job = (seen, self._executor().submit(self._compute, seq.matcher))
            self._jobs[seq.seq_id] = job
        return job[1]

    def _compute(self, matcher) -> np.ndarray:
        row = np.empty(self.words, dtype=np.int32)
        # NOTE: releases the GIL while llguidance walks the token trie
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return row

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="raylane-grammar")
        return self._pool
