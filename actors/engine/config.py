"""Engine configuration: one frozen dataclass, named like vLLM's options."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.actors.engine.spec.config import SpeculativeConfig
from raylane.actors.engine.strict import check_type, strict_fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXECUTOR_BACKENDS = ("uni", "ray")


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 up to max_num_seqs (vLLM's ladder)."""
    return tuple(n for n in (1, 2, 4, *range(8, max_num_seqs + 8, 8)) if n <= max_num_seqs)


@strict_fields
@dataclass(frozen=True)
class EngineConfig:
    """What to load and how much to run at once.

    `num_kv_blocks=None` sizes the KV cache from `kv_cache_memory_gb`; `max_model_len=None` takes
    the model's `max_position_embeddings`. `tensor_parallel_size > 1` runs one Ray `ModelShard`
    actor per rank (`distributed_executor_backend="ray"`, implied); `"uni"` (the default at
    TP=1) runs the model in this process.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    # linear-attention models: sequences whose recurrent state is held at once, one state slot
    # each (the scheduler admits no more); None: max_num_seqs
    num_state_slots: int | None = None
    # prefix caching on such models: snapshots of that state at block boundaries, least
    # recently used out (each costs one slot's memory); None: as many as state slots, 0: no
    # prefix caching for them
    num_state_snapshots: int | None = None
    enable_return_routed_experts: bool = False
    enable_return_indexer_topk: bool = False  # DSA models: record each token's indexer top-k
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "uni" | "ray"; None picks by TP size
    # Ray resources of each ModelShard (Ray executor): None is {"GPU": 1} on GPUs, else a
    # fractional {"CPU": 0.1} so ranks share a CPU node's cores
    shard_resources: dict | None = None
    seed: int = 0
    attention_backend: str = "auto"
    max_logprobs: int = 20
    # plan step N+1 while step N runs (vLLM's --async-scheduling); outputs are the same as
    # serial ones (tests/unit/test_async_*.py), so it is on by default
    async_scheduling: bool = True
    # decode batches replayed from graphs captured at start-up (vLLM's names). None: graphs
    # where they capture (CUDA), eager on the CPU; False on the CPU runs the same graph runner
    # with an eager "replay" over its padded static buffers (its logic, tested without a GPU)
    enforce_eager: bool | None = None
    # batch sizes captured; a decode batch is padded to the next one. None: 1, 2, 4, 8, then
    # steps of 8 up to max_num_seqs (and max_num_seqs itself), see `capture_sizes`
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    # speculative decoding (vLLM's name): a dict such as {"method": "ngram",
    # "num_speculative_tokens": 4}, kept as a `SpeculativeConfig` (see actors/engine/spec)
    speculative_config: SpeculativeConfig | dict | None = None
    # a request's tokens, logprobs and routing are the same alone or in any batch, and equal
    # to a trainer's transformers forward under `raylane.batch_invariant()` (docs/rl.md)
    batch_invariant: bool = False
    # multi-LoRA (vLLM's names): adapters held in slots at once, their highest rank, and
    # adapters registered in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._check_sizes()
        self._check_executor()
        self._check_graphs()
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        self._check_lora()

    def _check_types(self) -> None:
        for name in ("model", "dtype", "device", "attention_backend"):
            check_type("EngineConfig", name, getattr(self, name), str)
        if self.tokenizer is not None:
            check_type("EngineConfig", "tokenizer", self.tokenizer, str)
        for name in (
            "enable_prefix_caching",
            "enable_return_routed_experts",
            "enable_return_indexer_topk",
            "async_scheduling",
            "batch_invariant",
            "enable_lora",
        ):
            check_type("EngineConfig", name, getattr(self, name), bool)
        check_type("EngineConfig", "seed", self.seed, int)
        check_type("EngineConfig", "kv_cache_memory_gb", self.kv_cache_memory_gb, (int, float))
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")

    def _check_sizes(self) -> None:
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "max_logprobs",
            "max_loras",
            "max_lora_rank",
        ):
            value = getattr(self, name)
            check_type("EngineConfig", name, value, int)
            if value < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {value}")
        for name in ("max_model_len", "num_kv_blocks", "num_state_slots"):
            value = getattr(self, name)
            if value is not None:
                check_type("EngineConfig", name, value, int)
                if value < 1:
                    raise ValueError(f"EngineConfig.{name} must be >= 1 or None, got {value}")
        if self.num_state_snapshots is not None:
            check_type("EngineConfig", "num_state_snapshots", self.num_state_snapshots, int)
            if self.num_state_snapshots < 0:
                raise ValueError(
                    f"EngineConfig.num_state_snapshots must be >= 0 or None, "
                    f"got {self.num_state_snapshots}"
                )
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("EngineConfig.kv_cache_memory_gb must be > 0")

    def _check_lora(self) -> None:
        if self.max_cpu_loras is not None:
            check_type("EngineConfig", "max_cpu_loras", self.max_cpu_loras, int)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(
                    f"EngineConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= "
                    f"max_loras ({self.max_loras})"
                )
        spec = self.spec
        if self.enable_lora and spec is not None and spec.method in ("draft_model", "mtp"):
            raise ValueError(
                f"EngineConfig.speculative_config.method={spec.method!r} does not run "
                "LoRA adapters (its drafts would come from the base model); use 'ngram' or "
                "'suffix' with enable_lora"
            )

    @property
    def cpu_loras(self) -> int:
        """Adapters registered at once (`max_cpu_loras`, or `max_loras`)."""
        return self.max_cpu_loras or self.max_loras

    @property
    def spec(self) -> SpeculativeConfig | None:
        """`speculative_config`, parsed (None: no speculation)."""
        assert not isinstance(self.speculative_config, dict)  # parsed in __post_init__
        return self.speculative_config

    def _check_graphs(self) -> None:
        if self.enforce_eager is not None:
            check_type("EngineConfig", "enforce_eager", self.enforce_eager, bool)
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            return
        if (
            not isinstance(sizes, (tuple, list))
            or not sizes
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)
        ):
            raise ValueError(
                "EngineConfig.cudagraph_capture_sizes must be a non-empty list of "
                f"batch sizes >= 1, got {sizes!r}"
            )
        object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture: the configured ones up to max_num_seqs, or the
        default ladder; max_num_seqs itself is always one, so every decode batch fits."""
        ladder = self.cudagraph_capture_sizes or default_capture_sizes(self.max_num_seqs)
        return tuple(sorted({n for n in ladder if n < self.max_num_seqs} | {self.max_num_seqs}))

    @property
    def state_slots(self) -> int:
        """Linear-attention models: the state slots to allocate (see `num_state_slots`)."""
        return self.num_state_slots or self.max_num_seqs

    @property
    def state_snapshots(self) -> int:
        """Linear-attention models: the state snapshots to keep (see `num_state_snapshots`)."""
        if not self.enable_prefix_caching:
            return 0
        return self.state_slots if self.num_state_snapshots is None else self.num_state_snapshots

    def _check_executor(self) -> None:
        if self.shard_resources is not None:
            check_type("EngineConfig", "shard_resources", self.shard_resources, dict)
            for key, value in self.shard_resources.items():
                if (
                    not isinstance(key, str)
                    or isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or value < 0
                ):
                    raise ValueError(
                        "EngineConfig.shard_resources must map Ray resource names "
                        f"to amounts >= 0, got {self.shard_resources!r}"
                    )
        backend = self.distributed_executor_backend
        if backend is None:
            return
        check_type("EngineConfig", "distributed_executor_backend", backend, str)
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"EngineConfig.distributed_executor_backend must be one of "
                f"{EXECUTOR_BACKENDS} or None, got {backend!r}"
            )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"EngineConfig.distributed_executor_backend='uni' runs one rank in "
                f"process; tensor_parallel_size={self.tensor_parallel_size} needs "
                "'ray' (or leave it None)"
            )

    @property
    def executor_backend(self) -> str:
        """The executor that runs the model: "ray" when asked or when TP > 1, else "uni"."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "ray" if self.tensor_parallel_size > 1 else "uni"
