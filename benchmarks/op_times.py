"""Where one engine's time goes, by op kind: forward hooks on its model's modules time the
linears (with the LM head), the fused RMSNorm / activation / RoPE ops and the attention over
one pass of a workload, so two engine configurations can be compared op by op."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LINEAR, FUSED, ATTENTION = "linears + LM head", "RMSNorm, SiLU*mul, RoPE", "attention"
REST, OUTSIDE, TOTAL = "rest of the forward", "outside the forward", "total (the pass)"
KINDS = (LINEAR, FUSED, ATTENTION, REST, OUTSIDE, TOTAL)
FORWARD = "forward"  # the whole model forward plus its LM head


@dataclass(frozen=True)
class OpCost:
    ms: dict[str, float]  # KINDS -> milliseconds over the pass
    impls: dict[str, str]  # LINEAR, FUSED, ATTENTION -> what ran them


def op_kind(module: Any) -> str | None:
    from raylane.actors.models.attention import Attention
    from raylane.actors.models.layers import LinearBase
    from raylane.kernels.activation import SiluAndMul
    from raylane.kernels.norm import RMSNorm
    from raylane.kernels.rotary import Rotary

    if isinstance(module, LinearBase):
        return LINEAR
    if isinstance(module, (RMSNorm, SiluAndMul, Rotary)):
        return FUSED
    if isinstance(module, Attention):
        return ATTENTION
    return None


class OpTimer:
    """Sums wall seconds per op kind while attached. On the CPU a torch op has finished when it
    returns, so a module's wall time is its ops' time (plus a few microseconds of hook)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._starts: dict[int, float] = {}
        self._handles = [self._hook(model, FORWARD)]
        for module in model.modules():
            kind = op_kind(module)
            if kind is not None:
                self._handles.append(self._hook(module, kind))
        # the LM head runs outside forward(): its matmul counts as a linear, and in the forward
        model.compute_logits = self._timed(model.compute_logits, (LINEAR, FORWARD))

    def _hook(self, module: Any, kind: str) -> tuple:
        def pre(mod: Any, _args: Any) -> None:
            self._starts[id(mod)] = time.perf_counter()

        def post(mod: Any, _args: Any, _out: Any) -> None:
            self.seconds[kind] += time.perf_counter() - self._starts.pop(id(mod))

        return module.register_forward_pre_hook(pre), module.register_forward_hook(post)

    def _timed(self, fn: Callable, kinds: tuple[str, ...]) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            for kind in kinds:
                self.seconds[kind] += time.perf_counter() - start
            return out

        return timed

    def close(self) -> None:
        for pre, post in self._handles:
            pre.remove()
            post.remove()
        del self.model.compute_logits  # the class's method again


def timed_op_pass(engine: Any, run_pass: Callable[[], float]) -> OpCost:
    """`run_pass()` (one pass of the workload on `engine`, returning its wall seconds) with the
    engine's model under an `OpTimer`. The engine must run its model in this process."""
    model = engine.executor.runner.model
    timer = OpTimer(model)
    try:
        wall = run_pass()
    finally:
        timer.close()
    s = timer.seconds
    ms = {kind: 1e3 * s[kind] for kind in (LINEAR, FUSED, ATTENTION)}
    ms[REST] = 1e3 * s[FORWARD] - sum(ms.values())
    ms[OUTSIDE] = 1e3 * (wall - s[FORWARD])
    ms[TOTAL] = 1e3 * wall
    return OpCost(ms, implementations(model))


def implementations(model: Any) -> dict[str, str]:
    """What runs each op kind in `model`: the packed or padded linears, the fused ops and the
    attention backend by their registries' names."""
    linears = [m for m in model.modules() if op_kind(m) == LINEAR]
    fused = next((m.ops for m in model.modules() if op_kind(m) == FUSED), None)
    attention = next((m.backend for m in model.modules() if op_kind(m) == ATTENTION), None)
    linear = "oneDNN packed" if any(m.packed is not None for m in linears) else "F.linear"
    if any(m.invariant for m in linears):
        linear += ", rows padded to 16"  # padded_linear
    return {LINEAR: linear, FUSED: _name(fused), ATTENTION: _name(attention)}


def _name(impl: Any) -> str:
    """The fused-ops or attention registry's name of `impl` ("cpu": the C kernels)."""
    return getattr(impl, "name", type(impl).__name__)
