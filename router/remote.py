"""A class's verbs called from another process, with one table of them: the class itself.

The control plane's verbs are `ControlPlane`'s public coroutines (router/control.py), an engine
replica's are `ReplicaControl`'s (actors/replica_control.py). A caller holds a `Remote` in the
class's place (typed as the class, so a reader and the type checker land on the real method)
and each call travels as one Ray call; the other side runs the real method. Adding a verb is
adding the method: nothing else spells it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any


def verbs(cls: type) -> frozenset[str]:
    """The public coroutine methods of `cls`: what a caller in another process may send it."""
    return frozenset(
        name
        for name, _ in inspect.getmembers(cls, inspect.iscoroutinefunction)
        if not name.startswith("_")
    )


class Remote:
    """`await remote.pause("keep")` is `await send("pause", ("keep",))`, for `verbs` only: a
    misspelled verb is an AttributeError here, not an error in the other process."""

    def __init__(self, verbs: frozenset[str], send: Callable[[str, tuple], Awaitable[Any]]):
        self._verbs = verbs
        self._send = send

    def __getattr__(self, verb: str) -> Callable[..., Awaitable[Any]]:
        # only called for names the instance lacks; `_verbs` is set first in __init__
        if verb.startswith("_") or verb not in self._verbs:
            raise AttributeError(f"{verb!r} is not one of the verbs {sorted(self._verbs)}")

        async def call(*args: Any) -> Any:
            return await self._send(verb, args)

        return call


async def dispatch(target: Any, verbs: frozenset[str], verb: str, args: tuple) -> Any:
    """The receiving side of a `Remote` whose actor takes every verb in one method:
    `target.<verb>(*args)`, for `verbs` only."""
    if verb not in verbs:
        raise ValueError(f"verb: {verb!r} is not one of {sorted(verbs)}")
    return await getattr(target, verb)(*args)
