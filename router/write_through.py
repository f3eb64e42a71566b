"""The session registry's side of its store: every call safe on any path.

A memory-only store costs nothing (no call reaches it); deletes of sessions the TTL or the cap
dropped on a sync path are batched until the next async one; the TTL sweep of the store runs at
most once per `PURGE_EVERY_S`; a failed background delete or sweep is logged, never a client's
error (the next sweep deletes what it left).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from raylane.router.errors import SessionStoreUnavailable
from raylane.router.session_store import SessionStore

if TYPE_CHECKING:
    from raylane.router.session import Session

log = logging.getLogger(__name__)
PURGE_EVERY_S = 60.0


class WriteThrough:
    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._dropped: list[str] = []  # dropped from memory, still to delete from the store
        self._purged_at = -float("inf")

    @property
    def durable(self) -> bool:
        return self.store.durable

    async def save(self, session: Session) -> None:
        if self.store.durable:
            await self.store.save(session)

    async def load(self, session_id: str) -> Session | None:
        return await self.store.load(session_id) if self.store.durable else None

    async def delete(self, session_id: str) -> None:
        if self.store.durable:
            await self.store.delete([session_id])

    def dropped(self, session_id: str) -> None:
        """Memory let the session go on a sync path: delete it from the store at `flush`."""
        if self.store.durable:
            self._dropped.append(session_id)

    async def flush(self) -> None:
        if not self._dropped:
            return
        ids, self._dropped = self._dropped, []
        try:
            await self.store.delete(ids)
        except SessionStoreUnavailable as e:
            log.warning("could not delete %d dropped sessions from the store: %s", len(ids), e)

    async def purge_if_due(self, now: float, ttl_s: float | None) -> None:
        """Sweep the store of sessions idle past the TTL that no registry holds (their Router
        restarted and nobody came back for them); `now` on the registry's clock."""
        if not self.store.durable or ttl_s is None or now - self._purged_at < PURGE_EVERY_S:
            return
        self._purged_at = now
        try:
            await self.store.purge(now - ttl_s)
        except SessionStoreUnavailable as e:
            log.warning("could not purge expired sessions from the store: %s", e)
