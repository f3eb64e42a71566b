"""Weight versions as the trainer protocols spell them: the label a trainer gave a commit
(vLLM's `finish_weight_update {weight_version}`, SGLang's `weight_version`), else raylane's
integer as a string.

The control plane keeps the labels (`ControlPlane.weight_label`); an ingress keeps each one it
has read, since a committed version's label never changes. So an answer at a version this
process has seen before costs no call to the Router.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from raylane.session_server.backend import ControlBackend

KEPT = 1024  # versions remembered here (outputs far older are past any max_weight_lag)


class WeightLabels:
    def __init__(self, control: ControlBackend) -> None:
        self.control = control
        self._texts: dict[int, str] = {}  # version -> its text, oldest first

    async def text(self, version: int) -> str:
        """`version`'s label, or the integer as a string when it has none."""
        text = self._texts.get(version)
        if text is None:
            text = self._keep(version, await self.control.weight_label(version))
        return text

    def known(self, version: int) -> str:
        """`text(version)` once it was awaited (the formatters run synchronously)."""
        return self._texts.get(version, str(version))

    async def current(self) -> str:
        """The cluster's version as its text (one call: the state carries its label)."""
        state = await self.control.control_state()
        return self._keep(state["weight_version"], state.get("weight_label"))

    async def resolved(self, stream: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """`stream`'s `(index, output)` items, each after its version's text is `known`."""
        async with aclosing(stream):
            async for item in stream:
                await self.text(item[1].weight_version)
                yield item

    def _keep(self, version: int, label: str | None) -> str:
        text = str(version) if label is None else label
        self._texts[version] = text
        while len(self._texts) > KEPT:
            del self._texts[next(iter(self._texts))]
        return text


def labels_of_app(app: Any) -> WeightLabels:
    """The app's `WeightLabels`, made on the first request that needs them (the backend is set
    by then, whatever order the routes were mounted in)."""
    labels = getattr(app.state, "weight_labels", None)
    if labels is None:
        labels = app.state.weight_labels = WeightLabels(app.state.backend.control)
    return labels
