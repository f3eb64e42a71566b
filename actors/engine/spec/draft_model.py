"""Checks of a draft model (`speculative_config` method "draft_model") before any runner
loads it: the runners load and run it (actors/runner/draft_runner.py), so a draft that cannot
propose the target's tokens is refused here, with the field to change."""

from __future__ import annotations

_OWNER = "EngineConfig.speculative_config"


def check_draft_model(
    path: str, target_vocab_size: int, target_tokenizer, tensor_parallel_size: int
) -> None:
    """ValueError naming `speculative_config.model` unless the draft has the target's vocab
    size, the same token -> id map where it has a tokenizer, and shards at the target's TP."""
    from raylane.actors.models import check_tp_shape
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{_OWNER}.model: cannot load a model config from {path!r}: {e}")
    draft_vocab = getattr(config.get_text_config(), "vocab_size", None)
    if draft_vocab != target_vocab_size:
        raise ValueError(
            f"{_OWNER}.model: the draft's vocab_size ({draft_vocab}) differs from the "
            f"target's ({target_vocab_size}); a draft model needs the target's tokenizer"
        )
    _check_tokenizer(path, target_tokenizer)
    if "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or []):
        raise ValueError(
            f"{_OWNER}.model: a draft with linear-attention layers is not supported (its "
            "recurrent state would need slots of its own); use a full-attention draft"
        )
    try:
        check_tp_shape(config, tensor_parallel_size)
    except ValueError as e:
        raise ValueError(f"{_OWNER}.model: the draft does not shard like the target: {e}")


def _check_tokenizer(path: str, target_tokenizer) -> None:
    """Where both sides have a tokenizer, the same token must have the same id."""
    if target_tokenizer is None:
        return
    from transformers import AutoTokenizer

    try:
        draft = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return  # weights only: the vocab size check is all there is
    if draft.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"{_OWNER}.model: the draft's tokenizer vocabulary differs from the target's"
        )
