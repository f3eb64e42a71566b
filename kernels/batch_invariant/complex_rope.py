"""DeepSeek-V2's RoPE on a trainer, rotated as the engine rotates it: `raylane.batch_invariant()`
installs these as transformers' `DeepseekV2RotaryEmbedding.forward` and the modeling file's
`apply_rotary_emb`.

transformers' DeepSeek-V2 rotates through complex numbers in float32 (`torch.polar`, a complex
product) and keeps each rotated pair interleaved. The engine runs V2 on DeepSeek-V3's MLA: cos
and sin cast to the model's dtype, the pairs rotated in that dtype and laid out de-interleaved
(evens, then odds), as transformers' DeepSeek-V3 does. The two agree in exact math (the same
permutation of q's and k's rope dims leaves every score alone), but they round apart, and the
attention's dot products sum the dims in another order. Here the rotary module hands over
V3's cos and sin (as the real and imaginary parts of the complex tensor the model passes
along, each exactly a value of the model's dtype) and the rotation is V3's.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_rope_utils import dynamic_rope_update


@dynamic_rope_update
def rotary_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids [B, T] -> [B, T, R / 2] complex: cos + i sin, as DeepSeek-V3's rotary
    embedding computes them (scaled, rounded to x's dtype), held in float32."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    cos = (freqs.cos() * self.attention_scaling).to(x.dtype)
    sin = (freqs.sin() * self.attention_scaling).to(x.dtype)
    return torch.complex(cos.float(), sin.float())


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """xq [B, H, T, R], xk [B, 1, T, R], freqs_cis [B, T, R / 2] (`rotary_forward`'s) -> both
    rotated in their dtype, the pairs' first elements then their second (DeepSeek-V3's
    interleaved RoPE)."""
    cos = freqs_cis.real.to(xq.dtype).unsqueeze(1)
    sin = freqs_cis.imag.to(xq.dtype).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(xq), rotate(xk)
