"""Shared memory of the paged attention kernels compiled ahead of time for sm_90 (the H100),
with Triton's bundled ptxas and no GPU. `python -m tests.support.sm90_fit` prints, as JSON, the
bytes MLA's prefill asks for at the tiles the host picks and at the old ones (a subprocess:
a test session on the CPU runs Triton in interpreter mode, whose kernels do not compile)."""

from __future__ import annotations

import json

import torch
import triton
from raylane.kernels.attention import triton_common as tc
from raylane.kernels.attention.triton_prefill import _prefill_kernel

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
POINTERS = {"q", "k_cache", "v_cache", "out", "sinks"}
INT_POINTERS = {"block_tables", "seq_lens", "query_start_loc"}


def shared_bytes(kernel, dtype: torch.dtype, consts: dict, num_warps: int) -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*" + TYPES[dtype]
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in ("part_ml", "part_acc"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in consts.items()},
    )
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(src, target=target, options={"num_warps": num_warps}).metadata.shared


def host_choice(dtype: torch.dtype, head_dim: int, v_dim: int, group: int, rows: int):
    """The tiles prefill_attention / decode_attention pick (rows: 64 for prefill, 16 decode)."""
    q = torch.empty(0, dtype=dtype)
    d_pad = tc._padded_head_dim(head_dim)
    tiles, m, heads, chunks = tc._program_shape(group, d_pad, q, rows)
    common = {
        "GROUP": group,
        "HEADS": heads,
        "NUM_CHUNKS": chunks,
        "HEAD_DIM": head_dim,
        "V_DIM": v_dim,
        "D_PAD": d_pad,
        "BLOCK_SIZE": 16,
        "BLOCK_N": tiles["BLOCK_N"],
        "HAS_SINKS": False,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": False,
    }
    return common, m, heads, tiles["num_warps"]


def measure() -> dict[str, int]:
    """MLA's float32 prefill at TP 8 (16 query heads on the latent row) with the tiles the host
    picks now, and with those the first GPU run used. The full sweep (prefill and decode; fp32,
    bf16 and fp16; head dims 64 to 576; groups 1 to 128) fitted too when the tiles were chosen;
    each compile takes seconds, so the check runs these two."""
    common, m, heads, warps = host_choice(torch.float32, 576, 512, 16, tc._PREFILL_BLOCK_M)
    consts = {**common, "BLOCK_M": m, "BLOCK_Q": m // heads}
    found = {"prefill-fp32-576-16": shared_bytes(_prefill_kernel, torch.float32, consts, warps)}
    consts = {**common, "BLOCK_N": 32, "BLOCK_M": 64, "BLOCK_Q": 4, "HEADS": 16, "NUM_CHUNKS": 1}
    found["old-prefill-fp32-576-16"] = shared_bytes(_prefill_kernel, torch.float32, consts, 8)
    return found


if __name__ == "__main__":
    print(json.dumps(measure()))
