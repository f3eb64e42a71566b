"""Speculative decoding on the engine side: the configuration, the proposers (n-gram, suffix
over a request and its siblings), drafting a step and folding its accepted counts back in, and
the counters. The runner side (verifying k + 1 rows in one forward) is
`actors/runner/spec_verify.py`."""

from raylane.actors.engine.spec.config import SPEC_METHODS, SpeculativeConfig

__all__ = ["SPEC_METHODS", "SpeculativeConfig"]
