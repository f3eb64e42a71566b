"""One sequence being generated: it owns its token ids, block table, status and counters."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.runner.plan import PLACEHOLDER

if TYPE_CHECKING:
    import numpy as np
    from llguidance import LLMatcher
    from raylane.actors.lora.registry import LoRABinding

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt plus the tokens generated for it (sample `index` of request `request_id`)."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
    ):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.block_size = block_size
        self.token_ids: list[int] = list(prompt_token_ids)  # known tokens (no placeholders)
        # tokens sampled by steps still in flight (async scheduling): scheduled as if known,
        # resolved in order when their step's result arrives
        self.num_pending = 0
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self._init_cache_bookkeeping()
        self._init_outputs(params)
        self.siblings: list[Sequence] = []  # n > 1: started once this one's prompt is computed
        self.matcher: LLMatcher | None = None  # structured outputs: its grammar's state
        self.lora: LoRABinding | None = None  # multi-LoRA: the adapter version it runs on

    def _init_cache_bookkeeping(self) -> None:
        """Its KV cache blocks, prefix-cache progress and recurrent state: none yet."""
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.num_released_blocks = 0  # leading blocks freed: wholly outside a sliding window
        # KV cache groups after the first (a model mixing sliding and full layers, see
        # layer_kinds.KVGroups): each group's block table and its leading blocks freed
        self.group_tables: list[list[int]] = []
        self.group_released: list[int] = []
        self.state_slot: int | None = None  # linear-attention models: its recurrent state's slot
        # a prefix-cache hit on such a model: the snapshot its state starts from
        self.restore_snapshot: int | None = None
        # the block boundary its state slot's decode row holds (planned), 0: none
        self.decode_snapshot_at = 0
        self.prefix_looked_up = False  # the scheduler checked the prefix cache on admission
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first schedule)
        self.num_preemptions = 0
        # the weight version its cached KV prefix was computed under (set on admission)
        self.cache_version = 0

    def _init_outputs(self, params: SamplingParams) -> None:
        """What it returns, filled as it runs: nothing yet."""
        self.logprobs: list[float] = []
        self.weight_versions: list[int] = []  # the weight version that produced each output
        self.kept_mass: list[float] = []  # log kept mass per output token, when asked
        self.top_logprobs: list[dict[int, float]] = []
        # entry t is the logprobs of prompt token t (None for the first); filled as prefill runs
        self.prompt_logprobs: list[dict[int, float] | None] = (
            [None] if params.prompt_logprobs is not None else []
        )
        # the rank (1 = most likely) of each prompt token, beside its entry
        self.prompt_ranks: list[int | None] = [None] * len(self.prompt_logprobs)
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # routed expert ids as the runner reports them, in position order; joined at the end
        self.routing_parts: list = []
        self.routed_experts: np.ndarray | None = None  # [len - 1, moe_layers, top_k] once finished
        self.indexer_parts: list = []  # likewise, the DSA indexer's top-k positions
        self.indexer_topk: np.ndarray | None = None  # [len - 1, dsa_layers, index_topk]

    def __len__(self) -> int:
        """Tokens as the scheduler sees them: the known ones and the pending ones."""
        return len(self.token_ids) + self.num_pending

    def runner_token_ids(self, start: int) -> list[int]:
        """Tokens from `start` as the runner holds them: a pending one is PLACEHOLDER, which
        the runner fills in with what it sampled."""
        known = self.token_ids[start:]
        return known + [PLACEHOLDER] * min(self.num_pending, len(self) - start)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def will_finish(self, max_model_len: int | None = None) -> bool:
        """Its pending tokens reach max_tokens or the context limit: no step after theirs can
        add to it."""
        if self.num_pending == 0:
            return False
        if max_model_len is not None and len(self) >= max_model_len:
            return True
        max_tokens = self.params.max_tokens
        return max_tokens is not None and self.num_output_tokens + self.num_pending >= max_tokens

    def append_token(
        self,
        token_id: int,
        logprob: float | None,
        top: dict[int, float] | None,
        weight_version: int = 0,
        kept_mass: float | None = None,
    ) -> None:
        """The oldest pending token arrived (async scheduling), or a token of a serial step."""
        self.num_pending = max(0, self.num_pending - 1)
        self.token_ids.append(token_id)
        self.weight_versions.append(weight_version)
        if kept_mass is not None:
            self.kept_mass.append(kept_mass)
        if logprob is not None:
            self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; every token (outputs too) is prefilled again."""
        self.block_table, self.group_tables = [], []
        self.num_computed_tokens = 0
        self.prefix_looked_up = False
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
