"""The runner's optional features (`RunnerFeature`, base.py), in the order the runner calls
their hooks. Adding one: its own file, and a line here (or `register(cls)` from its own
module, as a test does; `unregister` takes it back). A runner builds, once, every registered
class whose `enabled(config, model)` holds (feature_set.py)."""

from __future__ import annotations

from raylane.actors.runner.features.base import RunnerFeature
from raylane.actors.runner.features.draft_model import DraftModel
from raylane.actors.runner.features.dsa_indexer import DsaIndexer
from raylane.actors.runner.features.grammar_masks import GrammarMasks
from raylane.actors.runner.features.linear_state import LinearState
from raylane.actors.runner.features.lora import LoRA
from raylane.actors.runner.features.mtp import MtpDrafts
from raylane.actors.runner.features.routed_experts import RoutedExperts

FEATURES: list[type[RunnerFeature]] = [
    DraftModel,
    MtpDrafts,
    LinearState,
    DsaIndexer,
    RoutedExperts,
    GrammarMasks,
    LoRA,
]


def register(cls: type[RunnerFeature]) -> type[RunnerFeature]:
    """Append `cls` to the registry (once); runners built from now on in this process use it.
    Returns it, so it can decorate the class."""
    if cls not in FEATURES:
        FEATURES.append(cls)
    return cls


def unregister(cls: type[RunnerFeature]) -> None:
    """Take `cls` out of the registry (runners already built keep theirs)."""
    if cls in FEATURES:
        FEATURES.remove(cls)


__all__ = ["FEATURES", "RunnerFeature", "register", "unregister"]
