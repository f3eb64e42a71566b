"""Verify rows of a linear-attention step (kernels/linear_attention/verify.py) against a naive
token-by-token recurrence written here: every row's outputs are the recurrence's, the verify
rows' slots keep their state through the step, and `advance` leaves each slot with the state
after exactly its accepted tokens. Torch reference and Triton (under the interpreter)."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from raylane.kernels.linear_attention import StateMetadata, get_linear_backend  # noqa: E402
from raylane.kernels.linear_attention.metadata import VerifyRows  # noqa: E402
from raylane.kernels.linear_attention.verify import (  # noqa: E402
    advance,
    verify_conv,
    verify_delta_rule,
)

from tests.unit.test_triton_linear_attention import step_meta  # noqa: E402

HK, HV, DK, DV, W = 1, 2, 8, 6, 4
C = 2 * HK * DK + HV * DV
LENS = [9, 4, 3, 1]  # a prefill chunk, two verify rows (1 + 3 and 1 + 2 tokens), a decode
SLOTS = [4, 0, 2, 5]
VERIFY = [1, 2]


def naive(q, k, v, g, beta, s):
    """One sequence token by token: ([L, Hv, Dv] outputs, final [Hv, Dk, Dv]; the state after
    each token)."""
    q = q.float().repeat_interleave(HV // HK, dim=1)
    k = k.float().repeat_interleave(HV // HK, dim=1)
    q, k = F.normalize(q, dim=-1, eps=1e-12) * DK**-0.5, F.normalize(k, dim=-1, eps=1e-12)
    outs, states = [], []
    for t in range(q.shape[0]):
        s = s * g[t].float().exp()[:, None, None]
        delta = (v[t].float() - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t].float()[:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
        states.append(s)
    return torch.stack(outs), states


def naive_conv(x, weight, state):
    """[L, C] with the carried [C, W - 1] -> ([L, C] silu outputs, the state after each)."""
    window = torch.cat([state, x.T], dim=1)
    out = torch.stack([(window[:, t : t + W] * weight).sum(-1) for t in range(x.shape[0])])
    return F.silu(out), [window[:, t + 1 : t + W] for t in range(x.shape[0])]


def meta() -> StateMetadata:
    return step_meta(LENS, SLOTS, 3, VerifyRows(VERIFY, [LENS[i] for i in VERIFY]))


def inputs(t: int, gen: torch.Generator):
    """(x, conv weight, q, k, v, g, beta) of `t` tokens at this file's widths."""
    x = torch.randn(t, C, generator=gen)
    weight = torch.randn(C, W, generator=gen) * 0.5
    q, k = (torch.randn(t, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(t, HV, DV, generator=gen)
    g = -F.softplus(torch.randn(t, HV, generator=gen))
    beta = torch.randn(t, HV, generator=gen).sigmoid()
    return x, weight, q, k, v, g, beta


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_verify_rows_leave_only_accepted_tokens_in_the_state(backend_name: str) -> None:
    if backend_name == "triton":
        pytest.importorskip("triton")
    backend = get_linear_backend(backend_name) if backend_name == "torch" else _triton()
    gen = torch.Generator().manual_seed(0)
    t = sum(LENS)
    x, weight, q, k, v, g, beta = inputs(t, gen)
    conv = torch.randn(7, C, W - 1, generator=gen)
    state = torch.randn(7, HV, DK, DV, generator=gen)
    before_conv, before = conv.clone(), state.clone()
    m = meta()
    mixed = verify_conv(backend, x, weight, conv, m, "silu")
    out = verify_delta_rule(backend, q, k, v, g, beta, state, m)
    qsl = m.query_start_loc_host
    assert qsl is not None
    for i, slot in enumerate(SLOTS):
        rows = slice(qsl[i], qsl[i + 1])
        want_conv, conv_states = naive_conv(x[rows], weight, before_conv[slot])
        want, states = naive(q[rows], k[rows], v[rows], g[rows], beta[rows], before[slot])
        torch.testing.assert_close(mixed[rows], want_conv, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[rows].float(), want, atol=1e-5, rtol=1e-5)
        # a verify row's slot keeps the state from before the step; the others move on
        end = -1 if i not in VERIFY else None
        torch.testing.assert_close(state[slot], before[slot] if end is None else states[end])
        want_slot = before_conv[slot] if end is None else conv_states[end]
        torch.testing.assert_close(conv[slot], want_slot, atol=1e-6, rtol=1e-6)
    # the sampler accepted 2 of the first row's 3 drafts and none of the second's 2
    counts = [3, 1]
    layer = SimpleNamespace(conv_state=conv, recurrent_state=state, backend=backend)
    m.verify.record(layer, m, x, q, k, v, g, beta)
    firsts = []
    slots = [SLOTS[i] for i in VERIFY]
    advance(
        [layer], m.verify.records, slots, counts, m.verify.offsets(),
        lambda: firsts.append(state[slots].clone()),
    )  # fmt: skip
    for r, (i, n) in enumerate(zip(VERIFY, counts)):
        rows = slice(qsl[i], qsl[i + 1])
        _, states = naive(q[rows], k[rows], v[rows], g[rows], beta[rows], before[SLOTS[i]])
        _, conv_states = naive_conv(x[rows], weight, before_conv[SLOTS[i]])
        torch.testing.assert_close(state[SLOTS[i]], states[n - 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv[SLOTS[i]], conv_states[n - 1])
        torch.testing.assert_close(firsts[0][r], states[0], atol=1e-5, rtol=1e-5)


def _triton():
    from raylane.kernels.linear_attention.triton_backend import TritonLinearAttention

    return TritonLinearAttention()


class _Layer:
    """A linear-attention layer's state as the runner's StateCache sees it."""

    backend = get_linear_backend("torch")

    def state_shapes(self):
        return [((C, W - 1), None), ((HV, DK, DV), torch.float32)]

    def attach_state(self, tensors):
        self.conv_state, self.recurrent_state = tensors


def test_state_cache_accepts_and_snapshots_a_verify_row() -> None:
    """The runner's StateCache around a step with a verify row (1 + 3 tokens, 2 drafts
    accepted) and a decode, each saving its decode-row snapshot: the verify row's slot ends
    after its 3 accepted tokens and its snapshot holds the state after its first token (the
    block boundary the scheduler planned); the decode's snapshot is taken after the step."""
    from raylane.actors.engine.sampling_params import SamplingParams
    from raylane.actors.runner.requests import RequestState, ScheduledRequest
    from raylane.actors.runner.state_cache import StateCache

    layer = _Layer()
    cache = StateCache([layer], num_slots=4, dtype=torch.float32, device="cpu", num_snapshots=2)
    gen = torch.Generator().manual_seed(1)
    for t in (layer.conv_state, layer.recurrent_state):
        t.copy_(torch.randn(t.shape, generator=gen))
    before_conv, before = layer.conv_state.clone(), layer.recurrent_state.clone()
    params = SamplingParams(temperature=0.0)
    verify = ScheduledRequest(RequestState(7, 0, list(range(11)), [0], 10, params), 4, (1, 2, 3))
    decode = ScheduledRequest(RequestState(8, 0, list(range(6)), [1], 5, params), 1)
    m = cache.metadata([verify, decode], 1, [1, 2])
    t = 5
    x, weight, q, k, v, g, beta = inputs(t, gen)
    verify_conv(layer.backend, x, weight, layer.conv_state, m, "silu")
    verify_delta_rule(layer.backend, q, k, v, g, beta, layer.recurrent_state, m)
    assert m.verify is not None
    m.verify.record(layer, m, x, q, k, v, g, beta)
    saves = ((1, cache.num_snapshots + 1), (2, cache.num_snapshots + 2))  # the decode rows
    cache.save_after(m, saves)
    verify.num_accepted = 2
    cache.accept(m, [verify, decode], saves)
    _, states = naive(q[:4], k[:4], v[:4], g[:4], beta[:4], before[1])
    _, conv_states = naive_conv(x[:4], weight, before_conv[1])
    _, decoded = naive(q[4:], k[4:], v[4:], g[4:], beta[4:], before[2])
    conv_snaps, snaps = cache.snapshots[0]
    torch.testing.assert_close(layer.recurrent_state[1], states[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.conv_state[1], conv_states[2])
    torch.testing.assert_close(snaps[cache.num_snapshots + 1], states[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_snaps[cache.num_snapshots + 1], conv_states[0])
    torch.testing.assert_close(snaps[cache.num_snapshots + 2], decoded[0], atol=1e-5, rtol=1e-5)
