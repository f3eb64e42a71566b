"""Exceptions of the consolidation actor."""

from __future__ import annotations


class ConsolidationError(Exception):
    """Base class of the errors this package raises on purpose."""


class CallFailed(ConsolidationError):
    """One LLM call failed because of what was in it (bad answer, prompt rejected).

    The consolidator reacts by halving the batch; transport errors (endpoint down) are not
    this error, because splitting cannot fix them and would mark good memories failed.
    """


class InvalidAnswer(CallFailed):
    """The model answered, but not with a valid `{"actions": [...]}` for this batch."""


class BankBusy(ConsolidationError):
    """Another run (in this or another process) holds the bank's consolidation lock."""

    def __init__(self, bank_id: str) -> None:
        super().__init__(f"a consolidation of bank {bank_id!r} is already running")
        self.bank_id = bank_id


class CommitConflict(ConsolidationError):
    """A batch's commit found its memories already stamped or an observation out of scope.

    The transaction is rolled back, so nothing is duplicated; it means two writers raced on a
    bank despite the bank lock, or the answer escaped validation.
    """
