"""Requests over the replicas' output channels (actors/output_channel.py,
router/replica_channels.py) against a serial run of the same engine, without Ray: real
`EngineReplica`s behind an in-process stand-in for their actor handles. Checks the outputs
(ids, logprobs, the cumulative view), that a step's outputs travel as one batch, and that every
way of leaving aborts on the replica."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from raylane.actors.engine import SamplingParams
from raylane.actors.engine.output_accumulator import cumulative
from raylane.actors.replica import EngineReplica
from raylane.router.replica_channels import ReplicaChannels

MAX_TOKENS = 10


class Call:
    """An actor call's result: awaitable; for `num_returns="streaming"`, async-iterable
    over awaitables (Ray's ObjectRefGenerator of refs)."""

    def __init__(self, result) -> None:
        self.result = result

    def __await__(self):
        return self.result.__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return _ready(await anext(self.result))

    def cancel(self) -> None:
        # as `ray.cancel` does: the replica's generator is closed (its `finally` runs)
        asyncio.get_running_loop().create_task(self.result.aclose())


async def _ready(value):
    return value


class LocalHandle:
    """An actor handle of one in-process replica; counts what the caller would send over
    Ray."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica
        self.batches = 0  # channel messages after the first (the replica's id)
        self.aborts: list[str] = []

    def __getattr__(self, method: str):
        handle = self

        class Method:
            @staticmethod
            def options(**_):
                return Method

            @staticmethod
            def remote(*args):
                if method == "abort":
                    handle.aborts.extend(args[0])
                result = getattr(handle.replica, method)(*args)
                if method == "open_channel":
                    return Call(handle._counted(result))
                return Call(asyncio.ensure_future(result))  # sent now, awaited or not

        return Method

    async def _counted(self, stream):
        try:
            async for item in stream:
                self.batches += isinstance(item, list)
                yield item
        finally:
            await stream.aclose()


@pytest.fixture(autouse=True)
def cancel_in_process(monkeypatch):
    import raylane.router.replica_channels as channels_module

    monkeypatch.setattr(channels_module, "_cancel", lambda stream: stream.cancel())


@pytest.fixture
def replica(tiny_llama_dir) -> EngineReplica:
    return EngineReplica(
        {"model": tiny_llama_dir, "num_kv_blocks": 128, "max_model_len": 256}, replica_id="r1"
    )


def prompts(vocab: int, n: int = 5) -> list[list[int]]:
    return [[(7 * i + j) % (vocab - 5) + 5 for j in range(6 + 5 * i)] for i in range(n)]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


async def collect(channels: ReplicaChannels, handle, prompt, params, rid: str) -> list:
    async with aclosing(
        channels.stream(handle.replica.replica_id, handle, prompt, params, rid)
    ) as stream:
        return [out async for out in cumulative(stream)]  # the engine's deltas, folded


async def wait_idle(replica: EngineReplica) -> None:
    for _ in range(200):
        if replica.engine.num_requests == 0 and not replica.engine.engine.requests:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{replica.engine.num_requests} requests still held")


async def test_concurrent_requests_equal_the_serial_run_in_one_batch_per_step(replica):
    engine = replica.engine.engine
    ps = prompts(engine.validator.vocab_size)
    serial = [engine.generate([p], greedy(), use_tqdm=False)[0] for p in ps]
    handle = LocalHandle(replica)
    channels = ReplicaChannels()
    results = await asyncio.gather(
        *(collect(channels, handle, p, greedy(), f"q{i}") for i, p in enumerate(ps))
    )
    for outs, ref in zip(results, serial):
        final, want = outs[-1].outputs[0], ref.outputs[0]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert final.token_ids == want.token_ids and final.finish_reason == "length"
        assert final.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        # cumulative, as the engine's own stream: each output extends the one before
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(b[: len(a)] == a and len(b) > len(a) for a, b in zip(ids, ids[1:]))
    deltas = sum(len(outs) for outs in results)
    # per request that would be one message per output; the channel sends one per step
    assert handle.batches <= MAX_TOKENS + len(ps), (handle.batches, deltas)
    assert handle.batches < deltas / 2
    await wait_idle(replica)


async def test_leaving_early_aborts_on_the_replica(replica):
    handle = LocalHandle(replica)
    channels = ReplicaChannels()
    ps = prompts(replica.engine.engine.validator.vocab_size, 2)
    async with aclosing(channels.stream("r1", handle, ps[0], greedy(200), "leave")) as stream:
        seen = 0
        async for delta in stream:
            seen += sum(len(d.token_ids) for d in delta.outputs)
            if seen >= 2:
                break
    assert handle.aborts == ["leave"]
    await wait_idle(replica)
    # the channel stays open for the next request
    outs = await collect(channels, handle, ps[1], greedy(), "next")
    assert len(outs[-1].outputs[0].token_ids) == MAX_TOKENS


async def test_bad_input_is_a_value_error_and_nothing_runs(replica):
    handle = LocalHandle(replica)
    channels = ReplicaChannels()
    vocab = replica.engine.engine.validator.vocab_size
    with pytest.raises(ValueError, match="prompt"):
        await collect(channels, handle, [5, 6, vocab + 3], greedy(), "bad")
    await wait_idle(replica)


async def test_a_closed_channel_aborts_its_requests_and_fails_them(replica):
    handle = LocalHandle(replica)
    channels = ReplicaChannels()
    ps = prompts(replica.engine.engine.validator.vocab_size, 3)
    streams = [channels.stream("r1", handle, p, greedy(200), f"c{i}") for i, p in enumerate(ps)]
    for stream in streams:
        await anext(stream)
    (channel,) = replica._channels.values()
    channel.close()  # as when the caller is gone
    await wait_idle(replica)  # all three aborted there
    for stream in streams:  # and here they fail, not hang
        with pytest.raises(RuntimeError, match="closed the output channel"):
            async for _ in stream:
                pass


async def test_a_lost_channel_fails_its_requests_and_the_next_one_reopens(replica):
    handle = LocalHandle(replica)
    channels = ReplicaChannels()
    ps = prompts(replica.engine.engine.validator.vocab_size, 2)
    stream = channels.stream("r1", handle, ps[0], greedy(200), "lost")
    await anext(stream)
    (channel,) = [t.result() for t in channels._channels.values()]
    channel._task.cancel()  # the call to the replica ends under it
    with pytest.raises(RuntimeError, match="output channel"):
        async for _ in stream:
            pass
    await stream.aclose()
    await asyncio.sleep(0.05)
    outs = await collect(channels, handle, ps[1], greedy(), "after")
    assert outs[-1].finished


async def test_an_idle_channel_closes_and_the_next_request_reopens(replica, monkeypatch):
    import raylane.router.replica_channels as channels_module

    monkeypatch.setattr(channels_module, "IDLE_CLOSE_S", 0.05)
    handle = LocalHandle(replica)
    channels = ReplicaChannels()
    ps = prompts(replica.engine.engine.validator.vocab_size, 2)
    await collect(channels, handle, ps[0], greedy(), "first")
    assert len(replica._channels) == 1
    for _ in range(100):  # closed on the replica too: Serve waits for no call at a shutdown
        if not replica._channels:
            break
        await asyncio.sleep(0.02)
    assert not replica._channels
    outs = await collect(channels, handle, ps[1], greedy(), "again")
    assert outs[-1].finished and len(replica._channels) == 1


async def test_each_replica_gets_its_own_channel_through_its_own_handle(replica, tiny_llama_dir):
    other = EngineReplica(
        {"model": tiny_llama_dir, "num_kv_blocks": 128, "max_model_len": 256}, replica_id="r2"
    )
    handles = LocalHandle(replica), LocalHandle(other)
    channels = ReplicaChannels()
    ps = prompts(replica.engine.engine.validator.vocab_size, 2)
    outs = await asyncio.gather(
        *(
            collect(channels, h, p, greedy(), f"to-{h.replica.replica_id}")
            for h, p in zip(handles, ps)
        )
    )
    assert all(o[-1].finished for o in outs)
    assert len(replica._channels) == 1 and len(other._channels) == 1
    assert all(h.batches >= 1 for h in handles)


async def test_a_channel_whose_caller_stops_renewing_is_closed(replica, monkeypatch):
    import raylane.router.replica_channels as channels_module

    monkeypatch.setattr(channels_module, "RENEW_S", 3600.0)  # a caller that died: no renewals
    handle = LocalHandle(replica)
    channels = ReplicaChannels()
    ps = prompts(replica.engine.engine.validator.vocab_size, 1)
    stream = channels.stream("r1", handle, ps[0], greedy(200), "orphan")
    await anext(stream)
    (channel_id,) = replica._channels
    await asyncio.sleep(0.05)
    await replica.renew([channel_id])
    replica.close_lapsed_channels(lease_s=0.04)  # renewed just now: kept
    assert list(replica._channels) == [channel_id]
    await asyncio.sleep(0.05)
    replica.close_lapsed_channels(lease_s=0.04)  # lapsed: closed, its request aborted
    await wait_idle(replica)
    with pytest.raises(RuntimeError, match="closed the output channel"):
        async for _ in stream:
            pass


async def test_a_channel_the_replica_closed_unnoticed_is_opened_again(replica):
    """A caller whose event loop did not run for the channel lease (a trainer's
    `run_until_complete` between batches): the replica closed its channel, and the next request
    is submitted on it before the caller noticed. It is sent again on a new channel, once, and
    answers as a serial run does."""
    engine = replica.engine.engine
    ps = prompts(engine.validator.vocab_size, 2)
    want = engine.generate([ps[1]], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    handle = LocalHandle(replica)
    channels = ReplicaChannels()
    await collect(channels, handle, ps[0], greedy(), "before")
    (first,) = replica._channels
    await asyncio.sleep(0.01)
    replica.close_lapsed_channels(lease_s=0.0)  # no renewal since it opened: closed
    assert replica._channels[first].closed and channels.channel_id("r1") == first  # unnoticed
    outs = await collect(channels, handle, ps[1], greedy(), "after")
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want
    assert len(replica._channels) == 1 and first not in replica._channels
    assert channels.channel_id("r1") != first
    await wait_idle(replica)


async def test_a_lapsed_channel_fails_its_requests_without_blaming_the_replica(
    replica, monkeypatch
):
    """A request in flight when the replica closes its caller's channel by lease (the caller's
    event loop stalled) fails with "send it again", and the replica stays routable: its
    caller stalled, it did not fail. A channel whose call failed does report it."""
    import raylane.router.replica_channels as channels_module
    from raylane.router.actor import Router
    from raylane.router.errors import ReplicaFailed
    from raylane.router.replica_requests import ReplicaRequests
    from raylane.router.replica_view import ReplicaView

    monkeypatch.setattr(channels_module, "RENEW_S", 3600.0)  # the stalled caller renews nothing
    router = Router(capacity=4)  # the plain class, in process
    router.replica_set.handles["r1"] = LocalHandle(replica)
    router.register("r1")
    view = ReplicaView(
        lambda known: router.table(None, known), 4, router.report_failure, refresh_s=3600
    )
    requests = ReplicaRequests(view)
    ps = prompts(replica.engine.engine.validator.vocab_size, 3)
    params = greedy(200)

    stream = requests.generate(ps[0], params, "stalled")
    await anext(stream)
    replica.close_lapsed_channels(lease_s=0.0)  # not renewed since it opened: closed
    with pytest.raises(ReplicaFailed, match="did not renew it in time"):
        async for _ in stream:
            pass
    await wait_idle(replica)  # aborted there
    assert view.policy.replicas["r1"].healthy and router.policy.replicas["r1"].healthy

    # the next request reopens a channel and answers as a serial run does
    engine = replica.engine.engine
    want = engine.generate([ps[1]], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    outs = [out async for out in cumulative(requests.generate(ps[1], greedy(), "after"))]
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want

    stream = requests.generate(ps[2], params, "lost")  # this time the channel's call fails
    await anext(stream)
    (channel,) = [t.result() for t in requests.channels._channels.values()]
    channel._task.cancel()
    with pytest.raises(ReplicaFailed, match="failed while serving"):
        async for _ in stream:
            pass
    assert not view.policy.replicas["r1"].healthy and not router.policy.replicas["r1"].healthy
