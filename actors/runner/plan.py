"""The step plan: the only thing that crosses from the engine to the runner, and its result.

Plain, picklable, torch-free data shaped like vLLM v1's scheduler output. A request the runner
has not seen carries its data once (`NewRequest`); a request it knows carries only what changed
(`CachedRequest`); `finished_seq_ids` and `preempted_seq_ids` say what to forget. The runner keeps
its own per-request state keyed by `seq_id` (one per sample of an `n > 1` request), so a plan is
small whatever the context length, can travel to another process, and can be built ahead of the
step that runs it.

The runner defines these types; the engine imports them, never the other way round. The one
exception is `SamplingParams`, which travels as the user gave it: it is plain torch-free data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raylane.actors.engine.sampling_params import SamplingParams

# A token id the runner fills in with the token it sampled for that request at the previous
# step (async scheduling plans step N+1 before step N's token reaches the host).
PLACEHOLDER = -1


@dataclass(frozen=True)
class NewRequest:
    """A sequence the runner has not seen: everything it needs, once."""

    seq_id: int
    sample_index: int  # which sample of its request (seeded samples differ by it)
    token_ids: tuple[int, ...]  # the prompt
    block_ids: tuple[int, ...]  # the whole block table so far
    num_computed_tokens: int  # tokens already in the KV cache (a prefix-cache hit)
    params: SamplingParams  # the request's own, as the user gave it (validated, picklable)
    # KV cache groups after the first (layer_kinds.KVGroups): each group's whole table so far
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    # multi-LoRA: the slot of the adapter version it runs on (0: the base model); it keeps
    # that slot to its end, through preemptions (the engine never reloads a slot in use)
    lora_slot: int = 0


@dataclass(frozen=True)
class CachedRequest:
    """A sequence the runner knows: only what changed since the runner last saw it."""

    seq_id: int
    # tokens appended since the last plan that named it (PLACEHOLDER: what the runner sampled)
    new_token_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]  # appended to its block table
    num_computed_tokens: int  # tokens in the KV cache before this step
    # back from preemption: its blocks were freed, `new_block_ids` is the whole new table
    resumed: bool = False
    # KV cache groups after the first: appended to each group's table, like `new_block_ids`
    new_group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """One engine step. `scheduled` is the flat token order: prefill chunks, then decodes."""

    step_id: int
    new_requests: tuple[NewRequest, ...] = ()
    cached_requests: tuple[CachedRequest, ...] = ()
    scheduled: tuple[tuple[int, int], ...] = ()  # (seq_id, tokens to compute this step)
    num_prefills: int = 0  # the first entries of `scheduled` are prefill chunks
    finished_seq_ids: tuple[int, ...] = ()  # finished or aborted: forget everything
    preempted_seq_ids: tuple[int, ...] = ()  # blocks freed: forget the table, keep the history
    # structured outputs: (seq_id, int32 bit set [ceil(vocab / 32)]) for rows whose next token
    # a grammar constrains (bit t of word t // 32 allows token t)
    token_masks: tuple[tuple[int, object], ...] = ()
    # structured outputs, in-process runner: rows whose masks follow the plan (the engine posts
    # them on the executor's MaskBoard once their grammars have taken every earlier token)
    late_masks: tuple[int, ...] = ()
    # speculative decoding: (seq_id, draft tokens) for rows that verify drafts; such a row's
    # `scheduled` count is 1 + len(drafts) (the last sampled token, then the drafts). Drafts
    # all PLACEHOLDER: the runner's draft model draws them first (runner/draft_runner.py)
    draft_token_ids: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # linear-attention models: each `scheduled` row's state slot (the scheduler's)
    state_slots: tuple[int, ...] = ()
    # (state slot, snapshot slot): copy the snapshot into the slot before the step (a
    # prefix-cache hit resumes there) / the slot into the snapshot after it (prefix caching)
    snapshot_restores: tuple[tuple[int, int], ...] = ()
    snapshot_saves: tuple[tuple[int, int], ...] = ()
    # (snapshot row, snapshot row): copies between snapshot rows, first thing in the step
    snapshot_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ChannelCommand:
    """A message on a shard's step channel that is not a step: "ping" (answered with the
    rank) or "release" (stop serving the channel so the shard can take Ray calls)."""

    kind: str


@dataclass(frozen=True)
class StepError:
    """A shard's reply when its step raised but the shard can serve on (one rank: no peer is
    left waiting in a collective). The runner dropped that step's requests."""

    message: str


@dataclass
class ExtraTokens:
    """A verify row's tokens after its first (the accepted drafts' successors): the target's
    own token, logprob, top logprobs and kept mass at each further position."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    kept_mass: list[float | None]


@dataclass
class StepResult:
    """What comes back from a step, one entry per `plan.scheduled` entry, in that order."""

    # None where the chunk did not reach the end of the sequence (no token sampled)
    token_ids: list[int | None]
    logprobs: list[float | None]  # raw logprob of the sampled token, when asked
    top_logprobs: list[dict[int, float] | None]
    prompt_logprobs: list[list[dict[int, float]]]  # new prompt-logprob entries, when asked
    # routed expert ids (int32 [positions, num_moe_layers, top_k]) of the positions this step
    # added to the sequence's record: a prefix-cache hit's cached positions, then the computed
    # ones; None when not asked. The engine concatenates them in order.
    routed_experts: list[object | None]
    # log of the probability mass truncation kept for the sampled token, when asked
    kept_mass: list[float | None] = field(default_factory=list)
    # seconds spent in prepare / forward / sample, and perf_counter stamps: started_at and
    # finished_at by the runner, sent_at and received_at by the executor
    timings: dict[str, float] = field(default_factory=dict)
    graph_replayed: bool = False  # the forward replayed a captured (or, on CPU, eager) graph
    verify_graph_replayed: bool = False  # ... a verify graph (graph_runner.py)
    # rows whose grammar mask was late: they sampled nothing and recompute their last position
    skipped_seq_ids: tuple[int, ...] = ()
    # speculative decoding: per entry, the tokens after `token_ids[i]` when drafts were
    # accepted (len = accepted drafts), else None
    extra: list[ExtraTokens | None] = field(default_factory=list)
    # DSA models: the indexer's top-k positions (int32 [positions, dsa_layers, index_topk]),
    # reported like routed_experts
    indexer_topk: list[object | None] = field(default_factory=list)
    # speculative method "mtp": per entry, the MTP layers' drafts for the tokens after its
    # newest one (None where it sampled nothing); empty without MTP
    mtp_drafts: list[tuple[int, ...] | None] = field(default_factory=list)
    # per entry, the rank (1 = most likely) of each prompt token `prompt_logprobs` covers
    prompt_ranks: list[list[int]] = field(default_factory=list)
    # speculative method "draft_model": per entry, the drafts the runner's draft model drew
    # for its placeholders (None elsewhere); empty when the step drew none
    drafts: list[tuple[int, ...] | None] = field(default_factory=list)

    @classmethod
    def empty(cls, size: int) -> StepResult:
        return cls(
            [None] * size,
            [None] * size,
            [None] * size,
            [[] for _ in range(size)],
            [None] * size,
            [None] * size,
            extra=[None] * size,
            indexer_topk=[None] * size,
            prompt_ranks=[[] for _ in range(size)],
        )

    def spread(self, rows: list[int], size: int) -> StepResult:
        """This result's entries at `rows` of a result of `size` entries (the others empty)."""
        out = StepResult.empty(size)
        for name in (
            "token_ids",
            "logprobs",
            "top_logprobs",
            "prompt_logprobs",
            "prompt_ranks",
            "routed_experts",
            "indexer_topk",
            "kept_mass",
            "extra",
        ):
            column = getattr(out, name)
            for row, value in zip(rows, getattr(self, name)):
                column[row] = value
        out.timings, out.graph_replayed = self.timings, self.graph_replayed
        out.verify_graph_replayed = self.verify_graph_replayed
        out.skipped_seq_ids = self.skipped_seq_ids
        for name in ("mtp_drafts", "drafts"):  # columns only some steps have
            if getattr(self, name):
                column = [None] * size
                for row, value in zip(rows, getattr(self, name)):
                    column[row] = value
                setattr(out, name, column)
        return out
