"""The Router actor's handle over a plain in-process `Router`, as the ingress's
`RouterSessions` calls it: a streaming call yields awaitables (as Ray streams refs) and is
cancelled with `.cancel()` (patch `raylane.serve_backend._cancel` to call it)."""

from __future__ import annotations

import asyncio
from typing import Any


class StreamingCall:
    """`router.<method>.options(num_returns="streaming").remote(...)`; `args` and `stream` of
    the last call."""

    def __init__(self, method) -> None:
        self.method = method
        self.args: tuple = ()
        self.stream: Stream | None = None

    def options(self, **_) -> StreamingCall:
        return self

    def remote(self, *args) -> Stream:
        self.args = args
        self.stream = Stream(self.method(*args))
        return self.stream


class Stream:
    def __init__(self, items) -> None:
        self.items = items
        self.cancelled: asyncio.Task | None = None
        self.sent = 0  # items the Router streamed (Ray messages)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self):
        item = await anext(self.items)
        self.sent += 1
        return asyncio.sleep(0, item)

    def cancel(self) -> None:  # as ray.cancel: the Router's side unwinds soon after
        self.cancelled = asyncio.ensure_future(self.items.aclose())


class Call:
    """`router.<method>.remote(...)`: an awaitable of the result."""

    def __init__(self, method) -> None:
        self.method = method

    def remote(self, *args) -> Any:
        async def result():
            value = self.method(*args)
            return await value if asyncio.iscoroutine(value) else value

        return result()


class InProcessRouter:
    def __init__(self, router) -> None:
        self.router = router
        self.session_turn = StreamingCall(router.session_turn)
        self.session_turn_end = Call(router.session_turn_end)
        self.session_turns_renew = Call(router.session_turns_renew)
        self.session_create = Call(router.session_create)
        self.session_describe = Call(router.session_describe)
        self.session_delete = Call(router.session_delete)
        self.session_sample = Call(router.session_sample)
