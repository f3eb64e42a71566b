"""Leases between a caller process and an actor that holds state for it: one protocol for both
the replicas' output channels (actors/replica.py, router/replica_channels.py) and the Router's
session turns (router/turn_handoff.py).

Ray does not end an actor's call whose caller died, so a holder cannot tell a dead caller from
a slow one by the call alone. The caller renews what it holds every `RENEW_S`
(`LeaseRenewals`: one loop per caller, one call per holder each period, batching all the keys
it holds there); the holder drops what was not renewed for `LEASE_S` (`LeaseTable`): a few
renewal periods, not the longest a turn or a request could take.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger(__name__)

LEASE_S = 15.0  # a key not renewed for this long lapses at its holder
RENEW_S = 3.0  # how often a caller renews everything it holds

T = TypeVar("T")
Renew = Callable[[list[str]], Awaitable[Any]]  # a holder's renew verb: the keys to renew


class LeaseLapsed(RuntimeError):
    """The caller of a key stopped renewing it: it died, or its event loop stalled."""


class LeaseTable:
    """The holder's side: when each key it holds for a caller was last renewed."""

    def __init__(self, lease_s: float = LEASE_S) -> None:
        self.lease_s = lease_s
        self._renewed: dict[str, float] = {}  # key -> time.monotonic() of its last renewal

    def __contains__(self, key: str) -> bool:
        return key in self._renewed

    def grant(self, key: str) -> None:
        """Hold `key`, its lease fresh."""
        self._renewed[key] = time.monotonic()

    def drop(self, key: str) -> None:
        self._renewed.pop(key, None)

    def renew(self, keys: list[str]) -> None:
        """Their caller is alive; keys not held (dropped, or lapsed) stay so."""
        now = time.monotonic()
        for key in keys:
            if key in self._renewed:
                self._renewed[key] = now

    def left(self, key: str) -> float:
        """Seconds until `key` lapses (<= 0: it has)."""
        return self._renewed[key] + self.lease_s - time.monotonic()

    def lapsed(self, lease_s: float | None = None) -> list[str]:
        """The keys not renewed for `lease_s` (default: this table's lease)."""
        limit = time.monotonic() - (self.lease_s if lease_s is None else lease_s)
        return [key for key, renewed in self._renewed.items() if renewed < limit]

    async def until_lapsed(self, key: str, result: asyncio.Future[T]) -> T:
        """`result`, unless `key`'s lease lapses first (then LeaseLapsed; `result` is left)."""
        while (left := self.left(key)) > 0:
            try:
                return await asyncio.wait_for(asyncio.shield(result), left)
            except TimeoutError:
                continue  # renewed meanwhile, or lapsed: the loop's test says which
        raise LeaseLapsed(f"lease {key} lapsed: its caller stopped renewing it")


class LeaseRenewals:
    """The caller's side: while it holds any key, one task renews all of them every `renew_s`,
    one call per holder. A holder whose last renewal has not answered is skipped, so one stuck
    holder does not let the leases at the others lapse."""

    def __init__(self, renew_s: float = RENEW_S) -> None:
        self.renew_s = renew_s
        self._held: dict[str, tuple[str, Renew]] = {}  # key -> its holder, the holder's renew
        self._calls: dict[str, asyncio.Task] = {}  # holder -> its renewal in flight
        self._task: asyncio.Task | None = None

    @contextmanager
    def holding(self, key: str, holder: str, renew: Renew) -> Iterator[None]:
        self.hold(key, holder, renew)
        try:
            yield
        finally:
            self.release(key)

    def hold(self, key: str, holder: str, renew: Renew) -> None:
        """Renew `key` at `holder` (through `renew`) until it is released."""
        self._held[key] = (holder, renew)
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._renew_while_held())

    def release(self, key: str) -> None:
        self._held.pop(key, None)

    async def _renew_while_held(self) -> None:
        while self._held:
            await asyncio.sleep(self.renew_s)
            loop = asyncio.get_running_loop()
            # a call left pending on a loop that no longer runs would block its holder forever
            self._calls = {
                h: call
                for h, call in self._calls.items()
                if not call.done() and call.get_loop() is loop
            }
            for holder, (renew, keys) in self._by_holder().items():
                if holder not in self._calls:
                    self._calls[holder] = loop.create_task(_renew(holder, renew, keys))

    def _by_holder(self) -> dict[str, tuple[Renew, list[str]]]:
        by_holder: dict[str, tuple[Renew, list[str]]] = {}
        for key, (holder, renew) in sorted(self._held.items()):
            by_holder.setdefault(holder, (renew, []))[1].append(key)
        return by_holder


async def _renew(holder: str, renew: Renew, keys: list[str]) -> None:
    try:
        await renew(keys)
    except Exception as e:  # it restarts (the next renewal may land), or died (its call says)
        log.warning("could not renew this process's leases at %s: %r", holder, e)
