"""One engine replica's LoRA verbs, over its `AsyncLLMEngine` (`ReplicaControl` has them): what
the control plane's adapter calls (router/lora_control.py) run on every replica.

An adapter is known by its name everywhere above the engine; its `lora_int_id` is derived from
the name (`adapter_id`), so every replica gives one adapter the same id without asking anyone.
Imports no torch (the Router reads these names).
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from typing import Any

from raylane.actors.replica_lora_group import ReplicaLoRAGroup


def adapter_id(name: str) -> int:
    """The adapter's `lora_int_id`: the same on every replica and after any restart (> 0, as
    vLLM's must be)."""
    return 1 + zlib.crc32(name.encode()) % (2**31 - 2)


class LoRAName(str):
    """An adapter's name that also asks for one of its versions (`LoRARequest.version`). It is
    the name wherever a name is read (routing, listings), so the request path carries it as
    its `lora` unchanged; the replica's `adapter` reads the version off it."""

    version: int

    def __new__(cls, name: str, version: int) -> LoRAName:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"lora_version: must be an int >= 1, got {version!r}")
        self = super().__new__(cls, name)
        self.version = version
        return self

    def __reduce__(self) -> tuple:  # across Ray: the name and the version
        return (LoRAName, (str(self), self.version))


def versioned(name: str | None, version: int | None) -> str | None:
    """`name`, asking for `version` of it (None: the newest)."""
    if version is None:
        return name
    if name is None:
        raise ValueError("lora_version: asks for a version of an adapter; name the adapter")
    return LoRAName(name, version)


def lora_request(name: str, path: str = "") -> Any:
    """The engine's `LoRARequest` for adapter `name` (`path` empty: the one registered; a
    `LoRAName`: the version it asks for)."""
    from raylane.actors.lora import LoRARequest

    if not isinstance(name, str) or not name:
        raise ValueError("lora_name: must be a non-empty string")
    version = getattr(name, "version", None)
    return LoRARequest(str(name), adapter_id(name), path, version)


def adapter(name: str | None) -> dict[str, Any]:
    """The engine's `lora_request=` keyword for a request on adapter `name` (none for None)."""
    return {} if name is None else {"lora_request": lora_request(name)}


def adapter_dict(info: Any) -> dict[str, Any]:
    """A `LoRAInfo` as plain data (HTTP answers, the Router's listing)."""
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        return dataclasses.asdict(info)
    return dict(vars(info))


async def _done(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


class ReplicaLoRA(ReplicaLoRAGroup):
    """The adapter verbs; those over the trainer's collective group are `ReplicaLoRAGroup`'s."""

    engine: Any  # an AsyncLLMEngine
    lora_modules: tuple[dict, ...] = ()  # the adapters it loaded before it served

    @property
    def _loras(self) -> Any:
        """Where the adapter verbs are: the AsyncLLMEngine's, else its LLMEngine's (called on
        the event loop, between steps, as the weight verbs are)."""
        return self.engine if hasattr(self.engine, "add_lora") else self.engine.engine

    async def add_lora(self, name: str, path: str, pinned: bool = False) -> bool:
        """Register adapter `name` from the PEFT directory `path` (again with a new path or new
        files: its next version). ValueError (a `LoRAError` or a bad adapter) changes nothing."""
        if not isinstance(path, str) or not path:
            raise ValueError("lora_path: must be a non-empty path to a PEFT adapter directory")
        return await _done(self._loras.add_lora(lora_request(name, path), pinned=pinned))

    async def load_lora_modules(self, modules: list[dict]) -> None:
        """`--lora-modules` ({name, path} each), before it serves."""
        for module in modules:
            await self.add_lora(module["name"], module["path"])
        self.lora_modules += tuple({"name": m["name"], "path": m["path"]} for m in modules)

    async def loaded_lora_modules(self) -> list[dict]:
        """The adapters it loaded before it served ({name, path}): a restarted Router tells
        them from those loaded at runtime, and sees which were unloaded since
        (router/lora_memory.py)."""
        return list(self.lora_modules)

    async def remove_lora(self, name: str, wait: bool = True) -> bool:
        return await _done(self._loras.remove_lora(name, wait=wait))

    async def pin_lora(self, name: str) -> bool:
        return await _done(self._loras.pin_lora(name))

    async def list_loras(self) -> list[dict[str, Any]]:
        return [adapter_dict(i) for i in await _done(self._loras.list_loras())]

    # an adapter-only update (the engine's bucketed form; `update_lora` in one go)

    async def begin_lora_update(self, name: str, specs: list[dict]) -> None:
        from raylane.actors.models.weights import TensorSpec

        tensor_specs = [TensorSpec.from_dict(d) for d in specs]
        await _done(self._loras.begin_lora_update(name, tensor_specs))

    async def load_lora_bucket(self, bucket: Any) -> int:
        """`bucket`: safetensors bytes, or `[ObjectRef]` of them (stored once for every
        replica), under PEFT's names."""
        if isinstance(bucket, list):
            bucket = await bucket[0]
        return await _done(self._loras.load_lora_bucket(bucket))

    async def finish_lora_update(self, version: int | str | None = None) -> int:
        return await _done(self._loras.finish_lora_update(version))

    async def abort_lora_update(self) -> None:
        await _done(self._loras.abort_lora_update())

    # a replacement replica gets what the control plane remembers (router/lora_memory.py)

    async def lora_tensors(self, name: str) -> bytes:
        """Adapter `name`'s newest version, every tensor under PEFT's names (safetensors)."""
        from raylane.actors.models.weights import encode_bucket

        llm = getattr(self.engine, "engine", self.engine)
        named = llm.loras.weights(name).named_tensors()
        return encode_bucket((k, v.detach().cpu()) for k, v in named.items())

    async def restore_lora(self, record: dict, tensors: Any = None) -> int:
        """Bring adapter `record["name"]` to the cluster's state: its path (and pin), then its
        version number and label, with `tensors` (safetensors bytes, or `[ObjectRef]` of
        them) as that version's. Returns the version it holds."""
        from raylane.actors.models.weights import decode_bucket

        name, number = record["name"], record["version"]
        held = {a["name"]: a for a in await self.list_loras()}.get(name)
        if held is None or held["path"] != record["path"]:
            await self.add_lora(name, record["path"], record["pinned"])
        elif record["pinned"]:
            await self.pin_lora(name)
        newest = {a["name"]: a for a in await self.list_loras()}[name]["version"]
        if number <= newest:
            return newest
        if isinstance(tensors, list):
            tensors = await tensors[0]
        named = list(decode_bucket(tensors).items()) if tensors is not None else []
        if number - 1 > newest:  # numbers go on past versions it never saw
            await _done(self._loras.update_lora(name, [], number - 1))
        # None or a str label: the next number (`number`); an int label is the number
        return await _done(self._loras.update_lora(name, named, record["label"]))
