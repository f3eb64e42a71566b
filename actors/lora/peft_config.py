"""The fields of a PEFT `adapter_config.json` that raylane serves, checked: LoRA on the
attention and MLP projections, bias "none". Anything that would change the math is refused
with a ValueError naming the field; metadata (task_type, base_model_name_or_path, ...) and
training-only fields (lora_dropout, init_lora_weights) are ignored."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# field -> the values that leave the plain LoRA math unchanged
_MUST_BE_OFF: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, [], ()),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layer_replication": (None, []),
    "lora_bias": (False, None),
    "target_parameters": (None, [], ()),
    "trainable_token_indices": (None, [], {}),
    "use_qalora": (False, None),
}


@dataclass(frozen=True)
class PeftLoRAConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the projections it may hold (tensors decide which)

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_peft_config(directory: str | Path) -> PeftLoRAConfig:
    path = Path(directory) / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"lora_path: no adapter_config.json in {str(directory)!r}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"adapter_config.json: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("adapter_config.json: must hold a JSON object")
    return parse_peft_config(raw)


def parse_peft_config(raw: dict[str, Any]) -> PeftLoRAConfig:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"peft_type: only LORA adapters are served, got {peft_type!r}")
    rank = raw.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"r: must be an int >= 1, got {rank!r}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_alpha: must be a number, got {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"use_rslora: must be a bool, got {rslora!r}")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"bias: only 'none' is served, got {raw.get('bias')!r}")
    for name, off in _MUST_BE_OFF.items():
        if name in raw and raw[name] not in off:
            raise ValueError(f"{name}: not supported (got {raw[name]!r})")
    return PeftLoRAConfig(rank, float(alpha), rslora, _targets(raw.get("target_modules")))


def _targets(value: Any) -> tuple[str, ...]:
    """A list of module names, one name, "all-linear", or a regex over module paths."""
    if value is None or value == "all-linear":
        return TARGETS
    if isinstance(value, str):
        if value in TARGETS:
            return (value,)
        try:
            pattern = re.compile(value)
        except re.error as e:
            raise ValueError(f"target_modules: not a valid regex {value!r} ({e})") from None
        found = tuple(t for t in TARGETS if pattern.search(t))
        if not found:
            raise ValueError(f"target_modules: {value!r} matches none of {TARGETS}")
        return found
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"target_modules: must be a list of names or a str, got {value!r}")
    unknown = [v for v in value if v not in TARGETS]
    if unknown:
        raise ValueError(
            f"target_modules: {unknown} not supported (LoRA is served on {list(TARGETS)})"
        )
    return tuple(value)
