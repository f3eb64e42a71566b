"""What a model runner is built from, and what it reports back once built (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerConfig:
    """Everything one tensor-parallel rank needs to load its model slice and size its KV cache.

    Built by the engine from its `EngineConfig`; plain data so it can travel to a Ray actor.
    `model_dir` is a Hugging Face directory (a GGUF file is converted once, by the engine,
    before any runner starts).
    """

    model_dir: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_return_routed_experts: bool = False
    enable_return_indexer_topk: bool = False
    seed: int = 0
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    eos_token_ids: tuple[int, ...] = ()
    pack_weights: bool = True  # oneDNN-packed linears on CPU float32 (see actors/models/packing)
    # every row's result independent of the batch it runs in (kernels/batch_invariant)
    batch_invariant: bool = False
    # every rank draws the step's tokens, not only rank 0: with async scheduling each rank
    # fills the next plan's placeholders with what it drew (identical logits and counter-based
    # random words make the draws identical on every rank)
    sample_on_every_rank: bool = False
    # decode batches through the graph runner (see graph_runner.py): None = on CUDA only
    enforce_eager: bool | None = None
    # speculative_config method "mtp": run the MTP layer after each step (runner/mtp_drafts.py)
    mtp: bool = False
    num_mtp_drafts: int = 1  # drafts per step: the MTP pass, then chained MTP steps
    # speculative_config method "draft_model": the draft's HF directory (runner/draft_runner.py)
    draft_model_dir: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] = (1,)
    # speculative decoding's k: the graph runner also captures verify rows of 1 + k tokens
    num_speculative_tokens: int = 0
    max_model_len: int = 2048  # the longest context a captured graph's block tables hold
    # linear-attention models: the state slots (the engine's scheduler hands them out)
    num_state_slots: int = 128
    num_state_snapshots: int = 0  # and their snapshots for prefix caching
    # multi-LoRA: adapter slots (0: LoRA off) and their highest rank (runner/features/lora.py)
    max_loras: int = 0
    max_lora_rank: int = 16


@dataclass(frozen=True)
class RunnerInfo:
    """Facts the engine needs from a built runner (identical on every rank)."""

    num_kv_blocks: int
    vocab_size: int
    num_moe_layers: int
    moe_top_k: int
    dtype: str  # e.g. "float32"
    device: str  # e.g. "cpu", "cuda:0"
    kv_bytes_per_token: int = 0  # KV cache bytes a token takes, summed over the TP ranks
    num_dsa_layers: int = 0  # sparse-attention layers (indexer top-k capture)
    index_topk: int = 0
    num_state_slots: int = 0  # linear-attention models: sequences whose state fits at once
    state_bytes_per_seq: int = 0  # one sequence's conv + recurrent state, all layers
    num_state_snapshots: int = 0  # copies of such state kept for prefix caching
    # each KV cache group's window (layer_kinds.KVGroups; None: full attention): the engine
    # keeps one block table per group and frees a sliding group's blocks outside its window
    kv_group_windows: tuple[int | None, ...] = (None,)
