"""Build what an engine runs on: tokenizer, executor (the model runners), block manager.

Checks that happen before any runner starts live here, so a bad configuration (a tensor-parallel
size that does not split the model) is a ValueError before a single process or actor is made.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.config import EngineConfig
from raylane.actors.engine.detokenizer import StopChecker
from raylane.actors.engine.grammar import GrammarCompiler
from raylane.actors.engine.limits import model_limits
from raylane.actors.engine.spec.draft_model import check_draft_model
from raylane.actors.engine.state_slots import SnapshotCache
from raylane.actors.executor import Executor, create_executor
from raylane.actors.runner.config import RunnerConfig, RunnerInfo

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    config: EngineConfig  # with max_model_len and num_kv_blocks resolved
    tokenizer: object
    executor: Executor
    block_manager: BlockManager
    stop_checker: StopChecker
    vocab_size: int
    num_moe_layers: int
    grammars: GrammarCompiler  # structured outputs: specs compiled once, masks per step

    @property
    def runner_info(self) -> RunnerInfo:
        return self.executor.info


def build_engine_parts(config: EngineConfig) -> EngineParts:
    from raylane.actors.models import check_tp_shape, load_tokenizer, resolve_model_dir
    from transformers import AutoConfig

    model_dir = resolve_model_dir(config.model)  # a .gguf converts once, here, for every rank
    hf_config = AutoConfig.from_pretrained(model_dir)
    check_tp_shape(hf_config, config.tensor_parallel_size)
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    eos = _eos_token_ids(hf_config, tokenizer, model_dir)
    limits = model_limits(hf_config, config)
    _check_draft(config, limits.vocab_size, tokenizer)
    config = dataclasses.replace(config, max_model_len=limits.max_model_len)
    executor = create_executor(
        runner_config(config, model_dir, eos, limits.max_model_len),
        config.executor_backend,
        config.shard_resources,
    )
    info = executor.info
    config = dataclasses.replace(config, num_kv_blocks=info.num_kv_blocks)
    if info.num_state_slots:
        config = _with_state_slots(config, info)
    return EngineParts(
        config=config,
        tokenizer=tokenizer,
        executor=executor,
        block_manager=BlockManager(
            info.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            SnapshotCache(info.num_state_snapshots) if info.num_state_snapshots else None,
            info.kv_group_windows,
            frees_windows=_frees_windows(config, info.kv_group_windows),
        ),
        stop_checker=StopChecker(eos, limits.max_model_len),
        vocab_size=limits.vocab_size,
        num_moe_layers=info.num_moe_layers,
        grammars=GrammarCompiler(tokenizer, info.vocab_size),
    )


def _frees_windows(config: EngineConfig, windows: tuple[int | None, ...]) -> bool:
    """Sliding groups free what falls out of their window, also under n-gram or suffix
    speculation: a verify row's queries start at the sequence's computed count, which only
    accepted drafts ever raise, so a rejection never brings a query before the kept window.
    A draft model (or MTP layer) attends over group 0's table in its own pool with its own
    reach: where group 0 slides (every layer of the target does), it keeps every block."""
    spec = config.spec
    return spec is None or spec.method not in ("draft_model", "mtp") or windows[0] is None


def _check_draft(config: EngineConfig, vocab_size: int, tokenizer) -> None:
    """A draft model must propose the target's tokens and shard like it."""
    spec = config.spec
    if spec is not None and spec.method == "draft_model" and spec.model is not None:
        check_draft_model(spec.model, vocab_size, tokenizer, config.tensor_parallel_size)


def _with_state_slots(config: EngineConfig, info: RunnerInfo) -> EngineConfig:
    """A model with linear-attention layers: say how many sequences its state slots hold and
    what prefix caching's state snapshots cost; without snapshots prefix caching is off (a
    cached prefix would skip tokens whose recurrent state the runner does not have)."""
    mib = info.state_bytes_per_seq / 2**20
    logger.info(
        "linear-attention state: %d slots of %.2f MiB (num_state_slots), so %d sequences run "
        "at once; prefix caching: %d state snapshots + a decode row per slot, %.2f MiB "
        "(num_state_snapshots)",
        info.num_state_slots,
        mib,
        min(info.num_state_slots, config.max_num_seqs),
        info.num_state_snapshots,
        (info.num_state_snapshots + info.num_state_slots) * mib if info.num_state_snapshots else 0,
    )
    return dataclasses.replace(config, enable_prefix_caching=info.num_state_snapshots > 0)


def runner_config(
    config: EngineConfig, model_dir: str, eos: list[int], max_model_len: int
) -> RunnerConfig:
    return RunnerConfig(
        model_dir=model_dir,
        dtype=config.dtype,
        device=config.device,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory_gb=config.kv_cache_memory_gb,
        enable_return_routed_experts=config.enable_return_routed_experts,
        enable_return_indexer_topk=config.enable_return_indexer_topk,
        seed=config.seed,
        attention_backend=config.attention_backend,
        batch_invariant=config.batch_invariant,
        tensor_parallel_size=config.tensor_parallel_size,
        eos_token_ids=tuple(eos),
        sample_on_every_rank=config.async_scheduling and config.tensor_parallel_size > 1,
        enforce_eager=config.enforce_eager,
        mtp=config.spec is not None and config.spec.method == "mtp",
        num_mtp_drafts=config.spec.num_speculative_tokens if config.spec is not None else 1,
        draft_model_dir=config.spec.model if config.spec is not None else None,
        cudagraph_capture_sizes=config.capture_sizes,
        num_speculative_tokens=config.spec.num_speculative_tokens if config.spec else 0,
        max_model_len=max_model_len,
        num_state_slots=config.state_slots,
        num_state_snapshots=config.state_snapshots,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank,
    )


def _eos_token_ids(hf_config, tokenizer, model_dir: str) -> list[int]:
    from transformers import GenerationConfig

    ids: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        gen = None
    for value in (gen, getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids += value if isinstance(value, list) else [value] if value is not None else []
    return sorted(set(ids))
