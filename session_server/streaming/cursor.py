"""What a stream has sent so far, per choice (`ChoiceCursor`) and per prompt (`PromptSeen`),
kept from the engine's deltas alone: O(new tokens) per step, no cumulative rebuild."""

from __future__ import annotations

from dataclasses import dataclass, field

from raylane.actors.engine.outputs import EngineCoreOutput, SampleDelta


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    text_offset: int  # where `text` starts in the choice's whole text
    finished: bool
    first: bool  # the choice's first delta


@dataclass
class ChoiceCursor:
    """What one choice has sent so far. The engine already held back text that could become a
    stop string, so every delta's text goes out as it is."""

    sent_chars: int = 0
    started: bool = False
    done: bool = False

    def advance(self, d: SampleDelta) -> Delta | None:
        if self.done or not (d.text or d.token_ids or d.finished):
            return None
        start, first = self.sent_chars, not self.started
        self.sent_chars, self.started, self.done = start + len(d.text), True, d.finished
        return Delta(d.text, d.token_ids, d.logprobs, d.top_logprobs, start, d.finished, first)


@dataclass
class PromptSeen:
    """What a stream told about one prompt so far, kept without rebuilding cumulative outputs:
    the prompt (sent once), its logprobs, and counts for the usage chunk."""

    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None
    num_cached_tokens: int = 0
    completion_tokens: int = 0
    weight_version: int = 0
    finished: bool = False

    def add(self, out: EngineCoreOutput) -> None:
        if out.prompt_token_ids is not None:
            self.prompt_token_ids = out.prompt_token_ids
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + out.prompt_logprobs
            self.prompt_ranks = (self.prompt_ranks or []) + (out.prompt_ranks or [])
        # the highest seen: a deadline's last delta (made here) does not know it
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.completion_tokens += sum(len(d.token_ids) for d in out.outputs)
        self.weight_version = max(self.weight_version, out.weight_version)
        self.finished = out.finished
