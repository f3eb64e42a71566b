"""Per-request sampling options, named as in vLLM."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from raylane.actors.engine.strict import check_type, strict_fields

_NUM = (int, float)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class RequestOutputKind(Enum):
    """What `LLMEngine.step()` and `AsyncLLMEngine.generate` hand out for a request (vLLM's):
    CUMULATIVE every token so far, DELTA only what each step added, FINAL_ONLY one output when
    the request ends."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a language (vLLM's names; set exactly one):
    `json` a JSON schema (dict or JSON text), `json_object` any JSON object, `regex`, `choice`
    one of the strings, `grammar` a Lark grammar (EBNF-like; GBNF is accepted too). JSON comes
    out compact (no free whitespace) unless `whitespace_flexible`."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "SamplingParams.structured_outputs must set exactly one of "
                f"{list(STRUCTURED_KINDS)}, got {set_ or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                "SamplingParams.structured_outputs.json must be a JSON schema "
                "(an object or its JSON text)"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"SamplingParams.structured_outputs.{name} must be a non-empty string"
                )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "SamplingParams.structured_outputs.choice must be a non-empty "
                "list of non-empty strings"
            )

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@strict_fields
@dataclass
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy; `top_k` 0 or -1 means off.

    `logprobs=N` returns the raw logprob of each sampled token (temperature 1, before any
    truncation or penalty) plus the top-N alternatives; `prompt_logprobs=N` does the same for the
    prompt. `seed` makes its tokens a function of (seed, sample index, output position) alone.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    return_routed_experts: bool = False
    return_indexer_topk: bool = False  # DSA models: CompletionOutput.indexer_topk
    max_weight_lag: int | None = None
    return_kept_mass: bool = False
    # constrain the output to a JSON schema, regex, choice or grammar (None: free text)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt
    cache_salt: str | None = None
    # what step() and AsyncLLMEngine.generate return for it (the serving path streams deltas)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_stops()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams")

    def _check_numbers(self) -> None:
        self._check_types()
        _require(self.n >= 1, "n", "must be >= 1")
        _require(self.temperature >= 0, "temperature", "must be >= 0")
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _require(self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive count")
        _require(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _require(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _require(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        for name in ("logprobs", "prompt_logprobs", "max_weight_lag"):
            value = getattr(self, name)
            _require(value is None or value >= 0, name, "must be >= 0")

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            check_type("SamplingParams", name, getattr(self, name), int)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            check_type("SamplingParams", name, getattr(self, name), _NUM)
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "return_routed_experts",
            "return_indexer_topk",
            "return_kept_mass",
        ):
            check_type("SamplingParams", name, getattr(self, name), bool)
        if self.cache_salt is not None:
            check_type("SamplingParams", "cache_salt", self.cache_salt, str)
        check_type("SamplingParams", "output_kind", self.output_kind, RequestOutputKind)
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "max_weight_lag"):
            if getattr(self, name) is not None:
                check_type("SamplingParams", name, getattr(self, name), int)

    def _check_stops(self) -> None:
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError("SamplingParams.stop must be a string or a list of strings")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError("SamplingParams.stop_token_ids must be a list of token ids")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stop:
            _require(isinstance(s, str) and s != "", "stop", "must hold non-empty strings")
        for t in self.stop_token_ids or []:
            _require(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0,
                "stop_token_ids",
                "must hold non-negative token ids",
            )
        self.stop_list = stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


# the fields a request carries over HTTP and in stored sessions: every constructor field but
# `output_kind`, which only the offline loop reads (the serving path streams deltas)
DATA_FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "output_kind"
)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")
