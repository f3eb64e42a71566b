"""A fake of vLLM's flash-attention fork for CPU tests: `flash_attn_varlen_func` computes
attention with the torch reference from exactly the arguments it was given (paged K/V through
the block table, `seqused_k`, `cu_seqlens_q`, window, scale, softcap, sinks), keeps the fork's
own checks (FA2 rejects sinks and split counts above 1), and records each call."""

from __future__ import annotations

import sys
import types
from functools import partial

import pytest
import torch
from raylane.kernels.attention.flash_fork import MODULES
from raylane.kernels.attention.torch_ref import attend


def fake_fork_module(versions=(2,), reports_version: bool = True) -> types.ModuleType:
    """A module shaped like `vllm.vllm_flash_attn` supporting the FA `versions`; without
    `reports_version`, like the PyPI vllm-flash-attn 2.6.2 (no is_fa_version_supported)."""
    module = types.ModuleType("fake_vllm_flash_attn")
    module.calls = []  # type: ignore[attr-defined]
    module.flash_attn_varlen_func = partial(varlen, module.calls)  # type: ignore[attr-defined]
    if reports_version:
        module.is_fa_version_supported = lambda v, device=None: v in versions  # type: ignore[attr-defined]
        module.fa_version_unsupported_reason = (  # type: ignore[attr-defined]
            lambda v, device=None: None if v in versions else f"FA{v} is not built"
        )
    return module


def install(
    monkeypatch: pytest.MonkeyPatch,
    vllm: types.ModuleType | None = None,
    standalone: types.ModuleType | None = None,
    capability: tuple[int, int] = (8, 0),
) -> None:
    """Put the fakes (None: not installed) where the probe imports them, on a GPU of
    `capability`."""
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm") if vllm else None)
    for name, module in zip(MODULES, (vllm, standalone)):
        monkeypatch.setitem(sys.modules, name, module)  # None: `import` raises ImportError
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def install_for_cpu_engine(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> None:
    """`module` as vLLM's fork, found on the CPU too: an engine on CPU tensors runs its layers
    through the fake (only the probe's device check is bypassed)."""
    import raylane.kernels.attention.flash_fork as flash_fork

    install(monkeypatch, vllm=module)
    find, cuda = flash_fork.find_flash_fork, torch.device("cuda")
    monkeypatch.setattr(flash_fork, "find_flash_fork", lambda device: find(cuda))


def varlen(
    calls: list,
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    seqused_k=None,
    *,
    softmax_scale=None,
    causal=False,
    window_size=None,
    softcap=0.0,
    block_table=None,
    out=None,
    num_splits=0,
    fa_version=2,
    s_aux=None,
    **rest,
):
    """The fork's signature (vllm_flash_attn.flash_attn_interface) for a paged call."""
    assert not rest, f"arguments the backend should not pass: {sorted(rest)}"
    assert cu_seqlens_k is None and seqused_k is not None and block_table is not None
    if fa_version == 2 and (s_aux is not None or num_splits > 1):
        raise NotImplementedError("FA2 does not support s_aux or num_splits > 1")
    for t in (cu_seqlens_q, seqused_k, block_table):
        assert t.dtype == torch.int32 and t.stride(-1) == 1
    assert k.dim() == 4 and v.dim() == 4, "paged K/V: [num_blocks, block_size, H_kv, D]"
    calls.append(dict(locals(), calls=None))
    left = -1 if window_size is None else window_size[0]
    starts, used = cu_seqlens_q.tolist(), seqused_k.tolist()
    for i, context in enumerate(used):
        rows = slice(starts[i], starts[i + 1])
        out[rows] = _one_seq(q[rows], k, v, block_table[i], context, softmax_scale, left, causal,
                             s_aux, softcap)  # fmt: skip
    return out


def _one_seq(q, k, v, table, context: int, scale, left: int, causal, sinks, softcap):
    """q [n, H, D] over the first `context` keys of the blocks in `table` -> [n, H, Dv]."""
    block_size, num_q = k.shape[1], q.shape[0]
    blocks = table[: -(-context // block_size)].long()
    keys, values = (c[blocks].flatten(0, 1)[:context] for c in (k, v))  # [context, H_kv, D]
    q_pos = torch.arange(context - num_q, context).unsqueeze(1)  # bottom-right aligned
    k_pos = torch.arange(context).unsqueeze(0)
    allowed = k_pos <= q_pos if causal else torch.ones(num_q, context, dtype=torch.bool)
    if left >= 0:
        allowed &= k_pos >= q_pos - left
    got = attend(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        allowed.view(1, 1, num_q, context),
        scale,
        sinks,
        softcap,
    )  # [1, H, n, Dv]
    return got[0].transpose(0, 1)
