"""SpeculativeConfig: how drafts are proposed, with vLLM's names (`speculative_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.actors.engine.strict import check_type, strict_fields

SPEC_METHODS = ("ngram", "suffix", "draft_model", "mtp")
_OWNER = "EngineConfig.speculative_config"


@strict_fields
@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` proposes up to `num_speculative_tokens` drafts per decoding sequence; the
    target verifies them in one forward (output identical to decoding without them).

    - "ngram": prompt lookup; the last `prompt_lookup_max` .. `prompt_lookup_min` tokens are
      searched in the request's own prompt and output, the tokens after the latest match drafted.
    - "suffix": the longest suffix match over the request's tokens and its siblings' (the
      other samples of its `n` group), drafting the continuation seen most often.
    - "draft_model": `model` (a path), a small model with the target's vocabulary, run on
      the runners with a KV pool of its own, proposes k tokens (runner/draft_runner.py).
    - "mtp": the target's own MTP layer (DeepSeek-V3's num_nextn_predict_layers, Qwen3.5's
      and Qwen3-Next's mtp_num_hidden_layers) draft on the runner (runner/mtp_drafts.py):
      k chained MTP steps, the last layer reused where the checkpoint has fewer.

    `disable_by_batch_size`: a step with more decoding sequences than this drafts nothing
    (vLLM's name); verifying a large batch costs more than the accepted tokens save.
    `adaptive`: draft only as many positions as pay for their verify cost, by a cost model
    of the step time measured online and the acceptance measured per position
    (spec/cost_model.py); off, every sequence with a match drafts up to k.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    # suffix: a continuation is drafted only when seen with at least this probability
    suffix_min_probability: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        check_type(_OWNER, "method", self.method, str)
        if self.method not in SPEC_METHODS:
            raise ValueError(f"{_OWNER}.method must be one of {SPEC_METHODS}, got {self.method!r}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "draft_model":
            check_type(_OWNER, "model", self.model, str)
        elif self.model is not None:
            raise ValueError(f"{_OWNER}.model applies to method 'draft_model' only")
        if self.method == "ngram":
            self._check_lookup()
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if self.method != "ngram" and getattr(self, name) is not None:
                raise ValueError(f"{_OWNER}.{name} applies to method 'ngram' only")
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        check_type(_OWNER, "adaptive", self.adaptive, bool)
        check_type(_OWNER, "suffix_min_probability", self.suffix_min_probability, (int, float))
        if not 0 <= self.suffix_min_probability <= 1:
            raise ValueError(f"{_OWNER}.suffix_min_probability must be in [0, 1]")

    def _check_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        # vLLM's defaults: one given sets the other; none gives 1 .. 5
        if low is None and high is None:
            low, high = 1, 5
        low, high = low if low is not None else high, high if high is not None else low
        assert low is not None and high is not None  # one of them was given
        _positive("prompt_lookup_min", low)
        _positive("prompt_lookup_max", high)
        if low > high:
            raise ValueError(
                f"{_OWNER}.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """`EngineConfig.speculative_config` as given: None, a dict (YAML, JSON) or a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{_OWNER} must be a dict, got {type(value).__name__}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError(f"{_OWNER} needs 'method' and 'num_speculative_tokens'")
        try:
            return cls(**value)
        except ValueError as e:
            message = str(e)
            raise ValueError(
                message if message.startswith(_OWNER) else f"{_OWNER}: {message}"
            ) from None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _positive(name: str, value) -> None:
    check_type(_OWNER, name, value, int)
    if value < 1:
        raise ValueError(f"{_OWNER}.{name} must be >= 1, got {value}")
