"""DraftRunner: a draft model (`speculative_config` method "draft_model") on the runner rank,
sharded like the target, with a paged KV pool of its own indexed by the target's block ids.

The pool has the target's number of blocks, so the engine's block tables, prefix cache and
preemption serve both pools and nothing is allocated per step (the block budget counts the
draft's bytes per block too; the runner reaches it as a feature: features/draft_model.py).
The draft runs only for rows the plan asks to draft, before the target's forward:

1. *Catch up*: one draft forward over those rows, each from the first position whose KV the
   sequence has not itself written into the pool (`RequestState.num_draft_computed`) through
   its fed token. So a sequence pays for the draft only once it drafts: a batch where the
   cost model drafts nothing runs no draft at all, and a prefix-cache hit's blocks (whose
   draft rows someone else wrote, or nobody) are never trusted. Usually this is the fed
   token alone, or the last draft and the fed token after an all-accepted run (that draft
   was never fed to the draft model); rejected positions are written over, as the
   target's are.
2. *Draft*: each row's first draft comes from the catch-up's logits at its last row, then
   k - 1 batched decode forwards of the draft (positions L + 1 .. L + k - 1, slots the
   engine allocated) draw the rest. Each draft is drawn with `draw_drafts` (argmax for
   greedy requests, q for sampled ones; draft_sampling.py says which rule verifies them),
   and where min(1, p/q) verifies them q stays on the runner
   (`ScheduledRequest.draft_probs`). The row then is a verify row like any other.

Every rank draws the same drafts: each holds the full logits rows (the LM head all-gathers)
and the random words are a function of (seed, stream, position).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from raylane.actors.models import TPGroup, load_model
from raylane.actors.runner import weight_checks
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.draft_sampling import draft_words, draw_drafts, verified_by_ratio
from raylane.actors.runner.inputs import InputPreparer
from raylane.actors.runner.kv_cache import KVCache, bytes_per_token
from raylane.actors.runner.requests import ScheduledRequest
from raylane.actors.runner.sampler import Sampler
from raylane.actors.runner.weight_updates import DRAFT_PREFIX, RunnerWeights
from raylane.kernels.attention.builder import SeqSlice, build_metadata


class DraftRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device):
        assert config.draft_model_dir is not None
        model, hf_config, _ = load_model(
            config.draft_model_dir, dtype, device, tp, pack_weights=config.pack_weights
        )
        self.model: Any = cast(Any, model)
        self.dtype, self.device, self.block_size = dtype, device, config.block_size
        self.weights = RunnerWeights(self.model, hf_config, tp, device)
        self.kv: KVCache | None = None

    def checksums(self) -> dict[str, str]:
        """Its parameters' checksums, named as its tensors are in an update (`draft.*`)."""
        sums = weight_checks.weight_checksums(self.model)
        return {f"{DRAFT_PREFIX}{name}": value for name, value in sums.items()}

    def layers(self) -> list:
        return self.model.attention_layers()

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.layers(), self.dtype)

    def allocate(self, num_blocks: int) -> None:
        """A zeroed pool of the target's `num_blocks` (at start and after sleep)."""
        self.kv = KVCache(num_blocks, self.block_size, self.layers(), None, self.dtype, self.device)

    def propose(
        self, scheduled: list[ScheduledRequest], inputs: InputPreparer, sampler: Sampler
    ) -> None:
        """Give each row planned with placeholder drafts its drafts (`drafts`, `num_new`
        1 + k, `draft_probs`)."""
        rows = [item for item in scheduled if item.num_to_draft]
        if not rows:
            return
        logits = self._catch_up(rows, inputs)
        drafted: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(max(item.num_to_draft for item in rows)):
            live = [i for i, item in enumerate(rows) if item.num_to_draft > j]
            if j:  # feed each live row its previous draft, at position L + j
                logits = self._decode([rows[i] for i in live], [drafted[i][-1] for i in live], j)
            else:
                logits = logits[live]
            tokens, probs = self._draw([rows[i] for i in live], logits, j, sampler)
            for i, token, q in zip(live, tokens, probs):
                drafted[i].append(token)
                qs[i].append(q)
        for item, drafts, q in zip(rows, drafted, qs):
            item.drafts, item.num_new = tuple(drafts), 1 + len(drafts)
            item.draft_probs = torch.stack(q) if verified_by_ratio(item.state.params) else None
            item.state.num_draft_computed = item.state.num_computed_tokens + len(drafts)

    def _catch_up(self, rows: list[ScheduledRequest], inputs: InputPreparer) -> torch.Tensor:
        """One forward over each row's positions missing from the pool, through its fed
        token; the logits [R, V] at each row's last position."""
        behind = [it.state.num_computed_tokens - it.state.num_draft_computed for it in rows]
        # chunks of different lengths: every row goes as a prefill chunk
        step = inputs.prepare(rows, len(rows), [max(0, b) for b in behind])
        hidden, _ = self.model(step.input_ids, step.positions, step.attn)
        ends = [first + count - 1 for first, count in step.logits_rows]
        index = step.logits_indices[torch.tensor(ends, device=hidden.device)]
        return self.model.compute_logits(hidden.index_select(0, index))

    def _decode(self, rows: list[ScheduledRequest], tokens: list[int], j: int) -> torch.Tensor:
        """One decode forward: each row's `tokens` entry at position L + j (L: the position of
        its fed token); logits [len(rows), V]."""
        starts = [item.state.num_computed_tokens + j for item in rows]
        slices = [SeqSlice(1, at + 1, item.state.block_ids) for item, at in zip(rows, starts)]
        attn = build_metadata([], slices, self.block_size, self.device)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        hidden, _ = self.model(as_tensor(tokens), as_tensor(starts), attn)
        return self.model.compute_logits(hidden)

    @staticmethod
    def _draw(
        rows: list[ScheduledRequest], logits: torch.Tensor, j: int, sampler: Sampler
    ) -> tuple[list[int], torch.Tensor]:
        """Draft j of each row, at its output position n + j; (tokens, q [R, V])."""
        words = [
            draft_words(
                it.state.params,
                it.state.sample_index,
                it.state.seq_id,
                sampler.seed,
                it.state.num_output_tokens + j,
            )
            for it in rows
        ]
        params = [it.state.params for it in rows]
        return draw_drafts(logits, params, words, sampler.vocab_size)
