"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention on every layer (dsa.py).

`indexer_topk()` after a forward gives each token's selection per layer, [T, num_dsa_layers,
index_topk] int32 (ascending positions, -1 padded), which the runner records per KV slot
for `CompletionOutput.indexer_topk`.

GLM-5 (`GlmMoeDsaForCausalLM`): the same, with an interleaved-rope indexer, and layers whose
`indexer_types` entry is "shared" reuse the last "full" layer's selection (no indexer, no
indexer key cache); their rows in `indexer_topk` repeat that layer's.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.models.deepseek_v3 import DeepseekV3ForCausalLM
from raylane.actors.models.dsa import DSAttention
from raylane.actors.models.llama import AttentionSpec
from raylane.actors.models.tp_group import TPGroup
from torch import nn


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    index_interleaved = False  # V3.2's indexer rotates half-split; its MLA interleaved

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        self.num_dsa_layers = config.num_hidden_layers
        self.index_topk = config.index_topk

    def make_layer(self, config: Any, spec: AttentionSpec, layer_idx: int):
        self._building = layer_idx  # make_attention reads it (layers are built in order)
        return super().make_layer(config, spec, layer_idx)

    def make_attention(self, config: Any, spec: AttentionSpec) -> nn.Module:
        kinds = getattr(config, "indexer_types", None)
        i = getattr(self, "_building", 0)
        shared = kinds is not None and i < len(kinds) and kinds[i] == "shared"
        # the last "full" layer, in a list: an nn.Module attribute would register it twice
        fulls: list[DSAttention] = self.__dict__.setdefault("_fulls", [])
        if shared and not fulls:
            raise ValueError("indexer_types: a 'shared' layer needs a 'full' layer before it")
        attn = DSAttention(config, self.index_interleaved, self.tp, fulls[-1] if shared else None)
        if not shared:
            fulls.append(attn)
        return attn

    def indexer_topk(self) -> torch.Tensor:
        """The last forward's selections: [T, num_dsa_layers, index_topk] int32."""
        picks = [self._attention(i).indexer_topk for i in range(self.num_dsa_layers)]
        return torch.stack(picks, dim=1).to(torch.int32)  # type: ignore[arg-type]

    def _attention(self, i: int) -> DSAttention:
        attn = self.model.layers[i].self_attn
        assert isinstance(attn, DSAttention)
        return attn


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    index_interleaved = True  # GLM-5's indexer rotates interleaved pairs, as its MLA does
