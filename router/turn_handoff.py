"""A session turn whose tokens stream replica -> ingress, while the Router keeps the session.

The Router hosts the session registry: the turn's start (`SessionRegistry.open_turn`: lock the
session, plan the prompt ids from the stored trajectory) and its end (`SessionRegistry.commit`)
run there. The generation runs at the caller, the ingress, over its own output channel to the
replica (the same path as a plain request), so no token crosses the Router. One turn is one
streaming call to the Router (`Router.session_turn`, `hand_out_turn` here: the turn's
`TurnTicket` first, the committed `TurnResult` last) plus one call that hands the finished
output back (`Router.session_turn_end`, `TurnHandoff.finish`), with lease renewals meanwhile.

`hand_out_turn` and `TurnHandoff` are the Router's side; `stream_turn` and `TurnLeases` the
caller's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, aclosing, contextmanager
from dataclasses import dataclass
from typing import Any

from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.leases import LEASE_S, RENEW_S, LeaseLapsed, LeaseRenewals, LeaseTable
from raylane.router.errors import ReplicaFailed
from raylane.router.generator import TurnGenerator, turn_request_id
from raylane.router.session import TurnDelta, TurnResult
from raylane.router.session_lora import on_lora, session_lora
from raylane.router.session_progress import TurnRun
from raylane.router.session_turn import OpenTurn
from raylane.router.sessions import SessionRegistry

# a turn's caller renews its lease every RENEW_S while it generates (`TurnLeases`); one that
# stops (it died: Ray does not end the Router's call of a dead caller) frees the session after
# LEASE_S, not after the longest turn a caller could take (both from actors/leases.py)


@dataclass(frozen=True)
class TurnTicket:
    """What the caller generates for a turn: the whole prompt, as the session planned it."""

    turn_id: str
    prompt_ids: list[int]
    params: SamplingParams
    lora: str | None = None  # the LoRA adapter the session runs on (router/session_lora.py)


class TurnHandoff:
    """The Router's turns out at their callers: each waits for its finished output (`finish`)
    while its caller renews its lease (`renew`)."""

    def __init__(self, lease_s: float = LEASE_S) -> None:
        self._waiting: dict[str, asyncio.Future] = {}  # turn id -> its finished output
        self._leases = LeaseTable(lease_s)  # the turns' leases, by turn id

    @property
    def lease_s(self) -> float:
        return self._leases.lease_s

    @lease_s.setter
    def lease_s(self, lease_s: float) -> None:
        self._leases.lease_s = lease_s

    @contextmanager
    def handed_out(self, turn_id: str) -> Iterator[None]:
        """The turn is out, its lease fresh: from before its ticket is sent until the end."""
        self._waiting[turn_id] = asyncio.get_running_loop().create_future()
        self._leases.grant(turn_id)
        try:
            yield
        finally:
            del self._waiting[turn_id]
            self._leases.drop(turn_id)

    async def output(self, turn_id: str) -> RequestOutput:
        """The turn's finished output, unless its caller stops renewing its lease first."""
        try:
            return await self._leases.until_lapsed(turn_id, self._waiting[turn_id])
        except LeaseLapsed:
            raise ReplicaFailed(
                "the turn's caller stopped renewing it (it died): the turn is dropped"
            ) from None

    def renew(self, turn_ids: list[str]) -> None:
        """Their callers are alive and still generating them."""
        self._leases.renew(turn_ids)

    def finish(self, turn_id: str, out: RequestOutput) -> None:
        """The caller's finished output of the turn (its last, finish reason set)."""
        final = self._waiting.get(turn_id)
        if final is None or final.done():
            raise ReplicaFailed(f"turn {turn_id} is not waiting for its output (it ended)")
        if not out.finished:
            raise ValueError("a turn's output must be finished")
        final.set_result(out)


async def hand_out_turn(
    registry: SessionRegistry, opening: AbstractAsyncContextManager[OpenTurn], handoff: TurnHandoff
) -> AsyncGenerator[Any, None]:
    """The Router's side of a turn (`opening`: `registry.open_turn(...)`), as the caller sees
    it: the `TurnTicket`, then the committed `TurnResult`. An error before the ticket (an
    unknown session, a bad request) raises at once; closing it before the commit (the caller
    left) leaves the session as it was."""
    ticket: asyncio.Future[TurnTicket] = asyncio.get_running_loop().create_future()
    # the turn runs on its own, so a lease lapses (and frees the session) whether or not
    # anyone still reads this stream
    turn = asyncio.ensure_future(_turn(registry, opening, handoff, ticket))
    either: set[asyncio.Future[Any]] = {turn, ticket}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if ticket.done():
            yield ticket.result()
        yield await turn
    finally:
        ticket.cancel()
        if not turn.done():  # the caller left: the turn ends with no trace
            turn.cancel()
            await asyncio.wait({turn})


async def _turn(
    registry: SessionRegistry,
    opening: AbstractAsyncContextManager[OpenTurn],
    handoff: TurnHandoff,
    ticket: asyncio.Future[TurnTicket],
) -> TurnResult:
    """Start the turn (`opening`), set its `ticket`, wait for its output, commit it."""
    async with opening as turn:
        turn_id = turn_request_id(turn.session.id)
        with handoff.handed_out(turn_id):
            lora = session_lora(turn.session.metadata)
            ticket.set_result(TurnTicket(turn_id, turn.plan.full_prompt, turn.plan.params, lora))
            final = await handoff.output(turn_id)
        return await registry.commit(turn, final)


async def stream_turn(
    call: AsyncIterator[Awaitable[Any]],
    generator: TurnGenerator,
    hand_back: Callable[[str, RequestOutput], Awaitable[None]],
    leases: TurnLeases,
    session_id: str,
    timeout_s: float | None,
    lora_version: int | None = None,
) -> AsyncGenerator[TurnDelta, None]:
    """The caller's side: `call` is the Router's `session_turn` stream (each item awaitable).
    Generates the ticket's prompt with `generator` (past `timeout_s`: aborted, partial output,
    finish reason "abort"), yields its deltas, hands the finished output back (renewing the
    turn's lease in `leases` meanwhile), and yields the finished delta with the committed
    result. Leaving early aborts the generation; the caller then cancels `call`, which leaves
    the session as it was. `lora_version`: that version of the session's adapter."""
    ticket: TurnTicket = await (await anext(call))
    with leases.held(ticket.turn_id):  # until the Router has the output
        outputs = generator.generate(
            ticket.prompt_ids, ticket.params, session_id, **on_lora(ticket.lora, lora_version)
        )
        # `rolled_back` is only known to the Router: 0 here, set on the committed result
        run = TurnRun(outputs, len(ticket.prompt_ids), 0, timeout_s)
        async with aclosing(run.progress()) as steps:
            async for step in steps:
                yield step
        if not run.finished:
            raise ReplicaFailed("the engine stream ended before the turn finished")
        await hand_back(ticket.turn_id, run.output())
    yield run.ended(await (await anext(call)))


class TurnLeases(LeaseRenewals):
    """The caller's side of its turns' leases (actors/leases.py): while this process generates
    turns, one call every `renew_s` renews all of them (`renew(turn_ids)`:
    `Router.session_turns_renew`)."""

    def __init__(
        self, renew: Callable[[list[str]], Awaitable[None]], renew_s: float = RENEW_S
    ) -> None:
        super().__init__(renew_s)
        self.renew = renew

    @contextmanager
    def held(self, turn_id: str) -> Iterator[None]:
        with self.holding(turn_id, "the Router", self.renew):
            yield
