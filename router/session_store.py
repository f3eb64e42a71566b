"""Where the session registry writes its sessions through to, so they can outlive the Router.

The registry keeps every live session in memory and, when its store is durable, writes each
change through: the whole session on create and after every committed turn, a delete when the
client deletes it or the TTL or the cap drops it. A session id it does not hold is looked up in
the store before it answers 404, which is how a restarted Router picks a conversation up again.

- `MemorySessionStore`: nothing outside the registry's own memory (no DSN configured). A Router
  restart loses every session; it costs nothing per turn.
- `PgSessionStore` (router/session_store_pg.py): one PostgreSQL row per session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from raylane.router.session import Session


class SessionStore(Protocol):
    """Durable storage of sessions, keyed by session id.

    `durable` False means the store keeps nothing (the registry then skips every call).
    `save` replaces the stored copy with the session as it is now (its records, blobs the
    registry still holds, `last_used`); it is called under the session's lock, so the session
    does not change while it is read. `last_used` is seconds on the registry's clock (wall time
    by default), the time of the last create or turn. Failures raise
    `raylane.router.errors.SessionStoreUnavailable`.
    """

    durable: bool

    async def save(self, session: Session) -> None: ...

    async def load(self, session_id: str) -> Session | None:
        """The stored session, or None when there is none."""
        ...

    async def delete(self, session_ids: list[str]) -> None: ...

    async def purge(self, idle_before: float) -> int:
        """Delete the sessions whose `last_used` is before `idle_before` (the TTL for sessions
        no Router holds any more); how many went."""
        ...

    async def close(self) -> None: ...


class MemorySessionStore:
    """The registry's memory is the only copy: saves keep nothing, loads find nothing."""

    durable = False

    async def save(self, session: Session) -> None:
        pass

    async def load(self, session_id: str) -> Session | None:
        return None

    async def delete(self, session_ids: list[str]) -> None:
        pass

    async def purge(self, idle_before: float) -> int:
        return 0

    async def close(self) -> None:
        pass


def open_session_store(dsn: str | None) -> SessionStore:
    """PostgreSQL at `dsn` (connected on first use), or memory only when there is none."""
    if not dsn:
        return MemorySessionStore()
    from raylane.router.session_store_pg import PgSessionStore

    return PgSessionStore(dsn)
