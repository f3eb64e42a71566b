"""The session registry: multi-turn agent conversations recorded as token-in/token-out turns.

A turn goes: normalise the messages -> plan where they attach (append, or roll back to a
generated checkpoint) -> build the prompt ids (tito) -> generate -> commit the record and drop
stale replay blobs -> write the session through to the store. Nothing is mutated before the
commit, so a rejected or failed turn leaves no trace. Turns of one session run one at a time (a
per-session lock); sessions run in parallel. `chat_deltas` runs a turn here, over the
registry's `TurnGenerator`; a turn generated elsewhere (the Router's, at the ingress) takes the
same two steps, directly: `open_turn` (lock and plan) and `commit` (record and write through).

The registry is the `SessionBackend` the HTTP routes serve (in process as it is; in a cluster
the Router actor hosts it). The store (router/session_store.py) is what outlives the process:
every call writes through to it and loads a session it holds when memory does not.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.errors import BadSessionRequest, SessionNotFound, TooManySessions
from raylane.router.generator import TurnGenerator
from raylane.router.messages import Message, normalize_message
from raylane.router.samples import TrainingSample, merge_trajectory
from raylane.router.session import Session, SessionConfig, TurnDelta, TurnResult
from raylane.router.session_lora import on_lora, session_lora
from raylane.router.session_progress import CumulativeTurns, TurnRun
from raylane.router.session_store import MemorySessionStore, SessionStore
from raylane.router.session_turn import OpenTurn, ReplyParser, SessionTurn, default_reply
from raylane.router.tito import TemplateSplicer
from raylane.router.write_through import WriteThrough


class SessionRegistry(CumulativeTurns):
    """Creates, serves and deletes sessions; plain Python, hosted by the Router actor.

    `splicer` renders messages to ids with the served model's chat template, `generator` runs a
    turn in `chat_deltas` (see `TurnGenerator`; None where callers generate their turns,
    between `open_turn` and `commit`), `reply_parser` turns an output into the assistant message the
    client gets back and is expected to echo (default: the text as `content`), `store` is
    written through (default: memory only, see `MemorySessionStore`). `model` names the served
    model (the Router's `SessionSetup.model_dir`), which each session records: a stored one
    recorded with another model is refused (see `Session.continue_with`).
    """

    def __init__(
        self,
        splicer: TemplateSplicer,
        generator: TurnGenerator | None,
        config: SessionConfig | None = None,
        reply_parser: ReplyParser = default_reply,
        # wall time: a stored session's last use must mean the same after a restart
        clock: Callable[[], float] = time.time,
        store: SessionStore | None = None,
        model: str | None = None,
    ) -> None:
        self.splicer = splicer
        self.generator = generator
        self.config = config or SessionConfig()
        self.reply_parser = reply_parser
        self.clock = clock
        self.model = model
        self._store = WriteThrough(store or MemorySessionStore())
        self._sessions: dict[str, Session] = {}  # least recently used first
        # ids dropped (-> why) or deleted (-> None); bounded. Never loaded from the store again
        self._gone: dict[str, str | None] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    async def create(self, metadata: dict[str, Any] | None = None) -> str:
        """A new session's id, written through to the store before it is handed out."""
        self._expire()
        self._make_room()
        session_id = "sess-" + secrets.token_urlsafe(18)  # 144 random bits: unguessable
        session = Session(
            session_id, dict(metadata or {}), last_used=self.clock(), model=self.model
        )
        self._sessions[session_id] = session
        async with session.lock:  # the cap never drops a locked session while it is written
            try:
                await self._store.save(session)
            except BaseException:
                self._drop(session, "it could not be stored")
                raise
        await self._store.flush()  # what the TTL and the cap dropped
        await self._store.purge_if_due(self.clock(), self.config.ttl_s)
        return session_id

    async def get(self, session_id: str) -> Session:
        """The session, marked as just used, loaded from the store when memory does not hold
        it; SessionNotFound (saying so when it expired)."""
        await self._store.flush()
        if session_id not in self._sessions and session_id not in self._gone:
            await self._load(session_id)
        self._expire()
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise SessionNotFound(session_id, self._gone.get(session_id))
        session.last_used = self.clock()
        self._sessions[session_id] = session  # most recently used now
        return session

    async def describe(self, session_id: str) -> dict[str, Any]:
        return (await self.get(session_id)).describe()

    async def sample(self, session_id: str, max_seq_len: int | None = None) -> TrainingSample:
        """The session's completed turns merged into one training sample."""
        if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
            raise BadSessionRequest("max_seq_len must be a positive integer", param="max_seq_len")
        return merge_trajectory((await self.get(session_id)).trajectory.records, max_seq_len)

    async def _load(self, session_id: str) -> None:
        session = await self._store.load(session_id)
        # NOTE: re-checked after the await: a concurrent call may have loaded it (keep that
        # one) or deleted it (its tombstone wins over the copy read before)
        if session is None or session_id in self._sessions or session_id in self._gone:
            return
        session.continue_with(self.model)  # SessionModelMismatch; left in the store
        ttl = self.config.ttl_s
        if ttl is not None and session.last_used < self.clock() - ttl:
            self._remember_gone(session_id, f"unused for over {ttl:g} s")
            await self._store.delete(session_id)
            return
        self._make_room()
        self._sessions[session_id] = session

    # --- the TTL and the cap ---------------------------------------------------------------

    def _expire(self) -> None:
        """Drop the sessions idle for longer than the TTL (not those in a turn)."""
        if self.config.ttl_s is None:
            return
        cutoff = self.clock() - self.config.ttl_s
        idle = [s for s in self._sessions.values() if s.last_used < cutoff and not s.lock.locked()]
        for session in idle:
            self._drop(session, f"unused for over {self.config.ttl_s:g} s")

    def _make_room(self) -> None:
        """At the cap, drop the least recently used session that is not in a turn."""
        limit = self.config.max_sessions
        if limit is None or len(self._sessions) < limit:
            return
        victim = next((s for s in self._sessions.values() if not s.lock.locked()), None)
        if victim is None:
            raise TooManySessions(f"all {limit} live sessions are in a turn; retry later")
        self._drop(victim, f"the least recently used of {limit} live sessions")

    def _drop(self, session: Session, why: str | None) -> None:
        session.deleted = True
        del self._sessions[session.id]
        self._remember_gone(session.id, why)
        if why is not None:  # a client's delete deletes it from the store itself
            self._store.dropped(session.id)

    def _remember_gone(self, session_id: str, why: str | None) -> None:
        self._gone[session_id] = why
        while len(self._gone) > max(1024, self.config.max_sessions or 0):
            del self._gone[next(iter(self._gone))]

    def retained_blob_bytes(self) -> int:
        return sum(s.trajectory.blob_bytes for s in self._sessions.values())

    async def delete(self, session_id: str) -> None:
        """Waits for the session's in-flight turn, then forgets the session (the store first:
        if that fails, the session is still there to delete again)."""
        session = await self.get(session_id)
        async with session.lock:
            if session.deleted:  # a concurrent delete got the lock first
                raise SessionNotFound(session_id)
            await self._store.delete(session_id)
            self._drop(session, None)

    async def chat(
        self,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        lora_version: int | None = None,
    ) -> TurnResult:
        """Run one turn to completion; returns the committed result."""
        result = None
        async with aclosing(
            self.chat_stream(
                session_id,
                messages,
                params,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                timeout_s=timeout_s,
                lora_version=lora_version,
            )
        ) as turn:
            async for result in turn:
                pass
        assert result is not None  # chat_stream ends with the committed result or raises
        return result

    async def chat_deltas(
        self,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        lora_version: int | None = None,
    ) -> AsyncGenerator[TurnDelta, None]:
        """Run one turn, yielding the engine's deltas as they come; the last, the finished one,
        with the committed result (without replay blobs: the session's record keeps them, the
        client gets none).

        Consume it under `contextlib.aclosing`: leaving early aborts the generation and leaves
        the session as it was, as does any error (4xx `SessionError`s included).
        `timeout_s` bounds the generation (counted once the session's previous turn has
        ended): past it the generation is aborted and the turn commits its partial output,
        finish reason "abort", as an abort through the control plane does (turn_deadline.py).
        `lora_version`: that version of the session's adapter (router/session_lora.py).
        """
        generator = self.generator
        if generator is None:
            raise RuntimeError("this registry's turns are generated by their callers")
        async with self.open_turn(
            session_id, messages, params, tools=tools, chat_template_kwargs=chat_template_kwargs
        ) as turn:
            run = self._turn_run(generator, turn, session_id, timeout_s, lora_version)
            async with aclosing(run.progress()) as steps:
                async for step in steps:
                    yield step
            if not run.finished:
                raise RuntimeError("the turn generator stopped before a finished output")
            committed = await self.commit(turn, run.output())
        yield run.ended(committed)

    @staticmethod
    def _turn_run(
        generator: TurnGenerator,
        turn: OpenTurn,
        session_id: str,
        timeout_s: float | None,
        lora_version: int | None = None,
    ) -> TurnRun:
        """The opened turn's generation (on the session's adapter, if it has one, at
        `lora_version` if given)."""
        plan = turn.plan
        lora = on_lora(session_lora(turn.session.metadata), lora_version)
        deltas = generator.generate(plan.full_prompt, plan.params, session_id, **lora)
        return TurnRun(deltas, len(plan.full_prompt), plan.plan.discarded, timeout_s)

    @asynccontextmanager
    async def open_turn(
        self,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[OpenTurn]:
        """A turn's start: the session locked for it (its turns run one at a time) and the turn
        planned (`OpenTurn.plan.full_prompt` is what to generate). End it inside with `commit`;
        leaving without a commit (an error, a cancel) leaves the session as it was."""
        session = await self.get(session_id)
        async with session.lock:
            if session.deleted:  # deleted (or dropped) while this turn waited for the lock
                raise SessionNotFound(session_id, self._gone.get(session_id))
            yield OpenTurn(
                session,
                SessionTurn.prepare(
                    self.splicer,
                    session.trajectory,
                    messages,
                    params,
                    tools,
                    chat_template_kwargs or {},
                    self.config.max_rollback_steps,
                ),
            )

    async def commit(self, turn: OpenTurn, final: RequestOutput) -> TurnResult:
        """A turn's end: records its finished output `final` and writes the session through;
        the committed result (the reply `message` set)."""
        session, plan = turn.session, turn.plan
        # stored normalised, so the client's echo of it compares equal
        reply = normalize_message(self.reply_parser(final.outputs[0]))
        session.trajectory.commit(
            plan.plan.keep, plan.record(final, reply), self.config.blob_window
        )
        session.last_used = self.clock()  # the TTL counts from the end of a turn
        # NOTE: on failure memory stays ahead of the store; the client, which got no reply,
        # resends the turn (a one-step rollback) and the next write stores it all
        await self._store.save(session)
        return plan.result(final, reply, len(session.trajectory) - 1)
