"""ConsolidationConfig: how much work one run takes per round, per LLM call, and in parallel."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class ConsolidationConfig:
    """Sizes of a consolidation run.

    batch_size: memories fetched per round (oldest first).
    llm_batch_size: memories per LLM call, within one tag group.
    max_parallel_groups: tag groups consolidated concurrently (LLM calls in flight).
    """

    batch_size: int = 50
    llm_batch_size: int = 8
    max_parallel_groups: int = 4

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int subclass; True as a batch size is a mistake, not 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


BANKS_ALL = "all"


@dataclass(frozen=True)
class ConsolidationServiceConfig:
    """The cluster's consolidation actor: where the memories are, which banks, how often.

    dsn: the PostgreSQL database (kept out of repr: it may hold a password).
    banks: bank ids to consolidate; None consolidates every bank with pending memories.
    interval_s: seconds between the end of one pass and the start of the next.
    model: the model id the LLM calls send; None sends the cluster's served model.
    max_tokens: the longest answer one LLM call may produce.
    limits: sizes of each bank's run (see `ConsolidationConfig`).
    """

    dsn: str = field(repr=False)
    banks: tuple[str, ...] | None = None
    interval_s: float = 60.0
    model: str | None = None
    max_tokens: int = 1024
    limits: ConsolidationConfig = field(default_factory=ConsolidationConfig)

    def __post_init__(self) -> None:
        _check(isinstance(self.dsn, str) and self.dsn != "", "dsn", "a non-empty string", self.dsn)
        if self.banks is not None:
            object.__setattr__(self, "banks", _bank_ids(self.banks))
        number = isinstance(self.interval_s, (int, float)) and not isinstance(self.interval_s, bool)
        _check(
            number and self.interval_s > 0,
            "interval_s",
            "a positive number of seconds",
            self.interval_s,
        )
        _check(
            self.model is None or (isinstance(self.model, str) and self.model != ""),
            "model",
            "a non-empty string",
            self.model,
        )
        _check(
            isinstance(self.max_tokens, int)
            and not isinstance(self.max_tokens, bool)
            and self.max_tokens >= 1,
            "max_tokens",
            "a positive integer",
            self.max_tokens,
        )

    @classmethod
    def from_dict(cls, data: dict, *, default_dsn: str | None = None) -> ConsolidationServiceConfig:
        """The YAML `consolidation:` section: this class's fields and `ConsolidationConfig`'s
        side by side; `banks: all` (or no `banks`) means every bank; a missing `dsn` is
        `default_dsn`. Unknown keys raise `ValueError` naming them."""
        if not isinstance(data, dict):
            raise ValueError(
                f"consolidation: must be a mapping of options, got {type(data).__name__}"
            )
        own = {f.name for f in fields(cls)} - {"limits"}
        limit_names = {f.name for f in fields(ConsolidationConfig)}
        unknown = set(data) - own - limit_names
        if unknown:
            raise ValueError(
                f"consolidation: unknown option(s) {sorted(unknown)}; known: "
                f"{sorted(own | limit_names)}"
            )
        options = {k: v for k, v in data.items() if k in own}
        options.setdefault("dsn", default_dsn)
        if options["dsn"] is None:
            raise ValueError(
                "consolidation.dsn is required (the PostgreSQL DSN of the memory "
                "banks; or set RAYLANE_CONSOLIDATION_DSN)"
            )
        if options.get("banks") == BANKS_ALL:
            options["banks"] = None
        try:
            limits = ConsolidationConfig(**{k: v for k, v in data.items() if k in limit_names})
        except ValueError as exc:
            raise ValueError(f"consolidation.{exc}") from None
        return cls(**options, limits=limits)


def _bank_ids(banks: object) -> tuple[str, ...]:
    if isinstance(banks, str) or not isinstance(banks, (list, tuple)):
        raise ValueError(
            f"consolidation.banks must be a list of bank ids or {BANKS_ALL!r}, got {banks!r}"
        )
    if not banks or not all(isinstance(b, str) and b for b in banks):
        raise ValueError(
            f"consolidation.banks must list non-empty bank ids (or be "
            f"{BANKS_ALL!r}), got {list(banks)!r}"
        )
    return tuple(dict.fromkeys(banks))  # each bank once, in the order given


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        # the value is never echoed for the dsn: it may hold a password
        shown = "<hidden>" if name == "dsn" else repr(value)
        raise ValueError(f"consolidation.{name} must be {expected}, got {shown}")
