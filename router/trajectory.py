"""A session's trajectory: its turn records, and the messages and token ids they add up to.

Records are the single source of truth. Each holds only what its turn added (the new prompt ids
and the output ids), so the ids of the whole trajectory cost O(prefix), not O(turns x prefix);
the full prompt of turn i is `tokens()[:records[i].prompt_end]`. Every record is a turn the model
generated, hence a rollback checkpoint.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from raylane.actors.engine.sampling_params import DATA_FIELDS, SamplingParams
from raylane.router.messages import Message


@dataclass
class TurnRecord:
    new_messages: list[Message]  # the messages this turn's request added (normalised)
    reply: Message  # the assistant message the session returned for the generated output
    params: SamplingParams
    prefix_len: int  # stored tokens before this turn's prompt ids
    prompt_ids: list[int]  # ids appended for this turn's prompt (template-rendered, masked)
    output_ids: list[int]  # ids the model generated
    logprobs: list[float]  # one per output id
    finish_reason: str  # "stop", "length" or "abort"
    weight_version: int
    routed_experts: np.ndarray | None  # int32 [prompt_end + len(output_ids) - 1, layers, top_k]
    tools: list[dict] | None = None  # as the turn's request passed them to the template
    blobs_dropped: bool = False
    # DSA models: int32 [prompt_end + len(output_ids) - 1, dsa_layers, index_topk]
    indexer_topk: np.ndarray | None = None

    @property
    def prompt_end(self) -> int:
        return self.prefix_len + len(self.prompt_ids)

    @property
    def end(self) -> int:
        return self.prompt_end + len(self.output_ids)

    @property
    def blob_bytes(self) -> int:
        blobs = (self.routed_experts, self.indexer_topk)
        return sum(int(b.nbytes) for b in blobs if b is not None)

    def drop_blobs(self) -> None:
        """Free the per-token replay blobs; ids and logprobs stay."""
        self.routed_experts = self.indexer_topk = None
        self.blobs_dropped = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the blobs (their shape says whether one is held)."""
        experts = self.routed_experts
        params = {name: getattr(self.params, name) for name in DATA_FIELDS}
        return {
            "new_messages": self.new_messages,
            "reply": self.reply,
            "params": params,
            "tools": self.tools,
            "prefix_len": self.prefix_len,
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
            "routed_experts_shape": None if experts is None else list(experts.shape),
            "routed_experts_dropped": self.blobs_dropped,
            "indexer_topk_shape": _shape(self.indexer_topk),
        }


def _shape(blob: np.ndarray | None) -> list[int] | None:
    return None if blob is None else list(blob.shape)


class Trajectory:
    def __init__(self) -> None:
        self.records: list[TurnRecord] = []

    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_tokens(self) -> int:
        return self.records[-1].end if self.records else 0

    def tokens(self, upto: int | None = None) -> list[int]:
        """The token ids of the first `upto` records (all by default), laid end to end."""
        ids: list[int] = []
        for r in self.records[:upto]:  # list += list copies at C speed, unlike chain()
            ids += r.prompt_ids
            ids += r.output_ids
        return ids

    def messages(self) -> list[Message]:
        return list(itertools.chain.from_iterable(r.new_messages + [r.reply] for r in self.records))

    def checkpoint_ends(self) -> list[int]:
        """Message counts at which a rollback may land: 0, then after each generated reply."""
        ends = [0]
        for r in self.records:
            ends.append(ends[-1] + len(r.new_messages) + 1)
        return ends

    def commit(self, keep: int, record: TurnRecord, blob_window: int | None) -> None:
        """Roll back to the first `keep` records, append `record`, then drop the blobs of all but
        the newest `blob_window` records (None keeps every blob)."""
        assert record.prefix_len == (self.records[keep - 1].end if keep else 0)
        del self.records[keep:]
        self.records.append(record)
        if blob_window is not None:
            for old in self.records[:-blob_window]:
                if not old.blobs_dropped:
                    old.drop_blobs()

    @property
    def blob_bytes(self) -> int:
        return sum(r.blob_bytes for r in self.records)
