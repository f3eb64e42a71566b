"""A request the ingress cuts at its deadline (session_server/streaming/): the last delta it
makes itself ends every running sample with "abort" and shows the text the engine still held
back (it could have become a stop string), so the joined text is what was generated."""

from __future__ import annotations

import asyncio

from raylane.actors.engine.output_accumulator import accumulate
from raylane.actors.engine.outputs import EngineCoreOutput, SampleDelta
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server.streaming import start


class StallingBackend:
    """Two samples: sample 0 sends "ab" (holding "c" back), sample 1 finishes; then nothing."""

    def __init__(self) -> None:
        self.closed = False

    async def generate(self, prompt_ids, params, request_id, routing_key=None):
        try:
            yield EngineCoreOutput(
                request_id,
                [
                    SampleDelta(0, "ab", [1, 2], held_text="c"),
                    SampleDelta(1, "xy", [3], finish_reason="stop", stop_reason="z"),
                ],
                False,
                weight_version=2,
                prompt_token_ids=list(prompt_ids),
            )
            await asyncio.sleep(3600)
        finally:
            self.closed = True


async def test_the_deadline_shows_the_held_back_text_and_aborts_what_runs():
    backend = StallingBackend()
    params = SamplingParams(n=2, stop=["cd"], max_tokens=50)
    stream = start(backend, [[9, 9]], params, "r", None, timeout_s=0.05)
    deltas = [out async for _, out in stream]
    assert backend.closed  # the engine request was closed (aborted)
    out = accumulate(deltas)
    assert out.finished and out.weight_version == 2
    (a, b) = out.outputs
    assert (a.text, a.token_ids, a.finish_reason) == ("abc", [1, 2], "abort")
    assert (b.text, b.finish_reason, b.stop_reason) == ("xy", "stop", "z")  # untouched
