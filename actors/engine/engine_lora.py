"""`EngineLoRA`: the offline engine's multi-LoRA verbs (vLLM's add/remove/pin/list, and the
adapter-only update transaction), between steps. `LLMEngine` inherits them; the bookkeeping
is a `LoRARegistry`, and what must reach every rank goes through the executor to the runners'
LoRA feature (runner/features/lora.py): `check` (would it load) and `load` (into a slot)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from raylane.actors.lora import (
    LoRABinding,
    LoRAError,
    LoRAInfo,
    LoRARegistry,
    LoRARequest,
    LoRASlotsFull,
)
from raylane.actors.models.weights import Payload, TensorSpec, decode_bucket, specs_of

if TYPE_CHECKING:
    import torch
    from raylane.actors.engine.config import EngineConfig
    from raylane.actors.engine.postprocessor import Postprocessor
    from raylane.actors.engine.request import Request
    from raylane.actors.engine.scheduler import Scheduler
    from raylane.actors.engine.step_pipeline import StepPipeline
    from raylane.actors.executor.base import Executor
    from raylane.actors.lora.adapter import LoRAWeights


class EngineLoRA:
    # set by LLMEngine.__init__
    config: EngineConfig
    executor: Executor
    pipeline: StepPipeline
    post: Postprocessor
    requests: dict[str, Request]
    scheduler: Scheduler

    @cached_property
    def loras(self) -> LoRARegistry:
        if not self.config.enable_lora:
            raise ValueError("lora_request: LoRA is off (EngineConfig.enable_lora=False)")
        return LoRARegistry(
            self.config.max_loras,
            self.config.cpu_loras,
            self._check_on_ranks,
            self._load_on_ranks,
            self._live_bindings,
        )

    def add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> bool:
        """Read, check (on every rank) and register a PEFT adapter; the same name with a new
        path is a new version. False when that name and path are registered already."""
        _check_request(lora_request)
        if self.loras.has(lora_request.lora_name) and not lora_request.lora_path:
            return self.pin_lora(lora_request.lora_name) if pinned else False
        return self.loras.add(lora_request, self._read(lora_request.lora_path), pinned)

    def remove_lora(self, name: str, wait: bool = True) -> bool:
        """Unregister an adapter. With requests in flight on it: `wait` lets them finish
        (new ones are refused at once), else LoRAInUse. False when it is not registered."""
        return self.loras.remove(name, wait)

    def pin_lora(self, name: str) -> bool:
        """Keep the adapter's newest version in a slot (never evicted)."""
        return self.loras.pin(name)

    def list_loras(self) -> list[LoRAInfo]:
        return self.loras.list()

    # --- the adapter-only update: one call, or begin, buckets, finish -----------------------

    def update_lora(
        self,
        name: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | str | None = None,
    ) -> int:
        """A new version of adapter `name` from PEFT-named tensors (any subset of its own, same
        shapes), checked on every rank before it is registered; the old version serves the
        requests that run on it. Returns the new version number."""
        from raylane.actors.lora.adapter import replace_tensors

        new = replace_tensors(self.loras.weights(name), list(named_tensors))
        return self.loras.add_version(name, new, version)

    def begin_lora_update(self, name: str, specs: list[TensorSpec]) -> None:
        """Open an update of `name`: each spec must name one of its tensors, with its shape
        (checked now; nothing changes). A second begin replaces an unfinished one."""
        own = {s.name: s for s in specs_of(self.loras.weights(name).named_tensors().items())}
        for spec in specs:
            if spec.name not in own or tuple(spec.shape) != own[spec.name].shape:
                raise ValueError(f"tensors: {spec.name!r} is not a tensor of adapter {name!r}")
        self._lora_update = _OpenUpdate(name, {s.name: s for s in specs})

    def load_lora_bucket(self, bucket: Payload | dict[str, Any]) -> int:
        """One bucket of the open update (safetensors bytes, or named tensors)."""
        update = self._open_update()
        tensors = bucket if isinstance(bucket, dict) else decode_bucket(bucket)
        for name, tensor in tensors.items():
            spec = update.specs.get(name)
            if spec is None or tuple(tensor.shape) != tuple(spec.shape):
                raise ValueError(f"tensors: {name!r} is not in the update's manifest")
        update.tensors.update(tensors)
        return len(tensors)

    def finish_lora_update(self, version: int | str | None = None) -> int:
        update = self._open_update()
        missing = sorted(set(update.specs) - set(update.tensors))
        if missing:
            raise ValueError(f"tensors: the update's buckets lack {missing[:3]}")
        self._lora_update = None
        return self.update_lora(update.name, update.tensors.items(), version)

    def abort_lora_update(self) -> None:
        self._lora_update = None

    _lora_update: _OpenUpdate | None = None

    def _open_update(self) -> _OpenUpdate:
        if self._lora_update is None:
            raise ValueError("no LoRA update is open (begin_lora_update first)")
        return self._lora_update

    # --- requests -----------------------------------------------------------------------------

    def _bind_lora(self, lora_request: LoRARequest | None) -> LoRABinding | None:
        """At admission: the adapter version (and slot) a request runs on to its end; an
        unregistered name with a path is added first, as vLLM does. None: the base model, or
        (`lora_request` given) every slot serves requests in flight: the request waits
        (`_queue`) until one is free. What is wrong with it raises here."""
        if lora_request is None:
            return None
        _check_request(lora_request)
        if not self.loras.has(lora_request.lora_name) and lora_request.lora_path:
            self.add_lora(lora_request)
        try:
            return self.loras.bind(lora_request)
        except LoRASlotsFull:
            if not self.loras.slots_will_free():
                raise
            return None

    def _queue(self, request: Request, lora_request: LoRARequest | None) -> None:
        """Hand an admitted request to the scheduler, or, when its adapter found no slot yet,
        keep it (FIFO) until a step frees one (`_admit_waiting_loras`)."""
        head = request.seqs[0]
        if lora_request is not None and head.lora is None:
            self._lora_waiting.append((request, lora_request))
        else:
            self.scheduler.add(head)

    def _admit_waiting_loras(self) -> None:
        """Before a step: bind the requests that wait for a slot, in order, while slots free
        up. One whose adapter went away meanwhile ends with finish reason "error"."""
        while self._lora_waiting:
            request, lora_request = self._lora_waiting[0]
            if not self._still_admitted(request):
                self._lora_waiting.popleft()
                continue
            try:
                binding = self.loras.bind(lora_request)
            except LoRASlotsFull:
                return
            except LoRAError as e:
                self._fail_waiting(request, e)
            else:
                for seq in request.seqs:
                    seq.lora = binding
                self.scheduler.add(request.seqs[0])
            self._lora_waiting.popleft()

    def _still_admitted(self, request: Request) -> bool:
        """Not aborted (nor replaced by another request of its id) while it waited."""
        live: object = self.requests.get(request.request_id)
        return live is request

    def _fail_waiting(self, request: Request, error: LoRAError) -> None:
        request.error = str(error)
        self.post.end(request, "error", keep_routing=False)
        self.pipeline.hold(self.post.outputs([request]))

    @cached_property
    def _lora_waiting(self) -> deque[tuple[Request, LoRARequest]]:
        return deque()

    def _live_bindings(self) -> list[LoRABinding]:
        return [s.lora for r in self.requests.values() for s in r.seqs if s.lora is not None]

    # --- the runners --------------------------------------------------------------------------

    def _read(self, path: str) -> LoRAWeights:
        from raylane.actors.lora.adapter import load_adapter

        return load_adapter(path, self.config.max_lora_rank)

    def _check_on_ranks(self, weights: LoRAWeights) -> None:
        self.executor.collective_rpc("features.call", "lora", "check", weights)

    def _load_on_ranks(self, slot: int, weights: LoRAWeights) -> None:
        self.pipeline.quiesce()  # no step in flight reads the slot while it changes
        self.executor.collective_rpc("features.call", "lora", "load", slot, weights)


class _OpenUpdate:
    def __init__(self, name: str, specs: dict[str, TensorSpec]) -> None:
        self.name, self.specs = name, specs
        self.tensors: dict[str, Any] = {}


def _check_request(lora_request: Any) -> None:
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request: must be a LoRARequest, got {type(lora_request).__name__}")
