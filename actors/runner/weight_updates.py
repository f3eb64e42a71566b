"""`RunnerWeights`: one rank's side of a weight update, whichever way the bytes arrive.

`check` opens the rank's transaction (the names and full shapes run through the loaders of a
shape-only twin: nothing changes). Every load after it (a bucket, or tensors received over the
trainer's collective group) first saves the parameters it is about to write, on the CPU, once
per transaction, then copies the new tensors in through the loader's own mapping (fused QKV,
gate/up, experts; each parameter keeps its rank's slice). `rollback` puts the saved
parameters back, so a failed update leaves the old weights; `finish` keeps the new ones. The
save buffers are kept from one update to the next (fresh memory costs page faults, ~3x the
copy): a CPU copy of every parameter an update wrote, for the process's life.

A draft model's tensors (`draft.<its HF name>`, runner/draft_runner.py) go to `draft`, the
draft's own `RunnerWeights`, in the same transaction: checked, saved, rolled back and kept
with the target's, whether they arrive in buckets or over the trainer's group.

Received chunks are loaded on a worker thread while the next chunk arrives (two receive
buffers, as vLLM's consumer double-buffers): the broadcast waits in gloo without the GIL, and
the copy and the re-pack of the packed weights overlap it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from raylane.actors.models import TPGroup, load_weights
from raylane.actors.models.layers import LinearBase, ParallelLMHead
from raylane.actors.models.loader import check_weights, param_targets
from raylane.actors.models.packing import drop_packs, pack_modules, repack_changed
from raylane.actors.models.weights import (
    DEFAULT_PACKED_BUFFER_BYTES,
    Payload,
    TensorSpec,
    broadcast_chunks,
    decode_bucket,
    nbytes,
    torch_dtype,
)
from raylane.actors.runner.group_info import GroupInfo
from raylane.actors.runner.weight_group import WeightGroup, join_group


class RunnerWeights:
    def __init__(self, model: Any, hf_config: Any, tp: TPGroup, device: torch.device) -> None:
        self.model, self.hf_config, self.tp, self.device = model, hf_config, tp, device
        self.dtype = next(model.parameters()).dtype
        self._saved: set[str] | None = None  # parameters saved this update; None: none open
        self._backup: dict[str, torch.Tensor] = {}  # their old values (CPU), buffers reused
        self.groups: dict[str, WeightGroup] = {}
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="raylane-weight-load")
        # modules whose oneDNN packs this transaction's loads dropped (re-packed after the
        # commit, on the loader thread: `_repacking`), and that re-pack
        self._unpacked: list[LinearBase | ParallelLMHead] = []
        self._repacking: Future | None = None
        # a draft model's (runner/draft_runner.py): it takes the `draft.<name>` tensors of the
        # same transaction, so the trainer's buckets and collective group reach it too
        self.draft: RunnerWeights | None = None
        self.on_commit: Callable[[], None] = _nothing  # after `finish` (the runner's features)

    # --- the transaction ----------------------------------------------------------------------

    def check(self, specs: list[tuple[str, tuple[int, ...], str]], begin: bool = True) -> None:
        """ValueError naming the tensor if any (name, full shape, dtype) would not load here.
        `begin`: this opens a transaction (a second begin keeps what the first one saved)."""
        mine, drafts = _split(specs, lambda spec: spec[0])
        if drafts:
            self._draft_check(drafts)
        if mine:
            check_weights(
                type(self.model),
                self.hf_config,
                self.tp,
                self.dtype,
                [(name, tuple(shape), torch_dtype(dtype)) for name, shape, dtype in mine],
            )
        if begin and self._saved is None:
            self._saved = set()
        if begin and self.draft is not None:
            self.draft.check([], begin=True)

    def _draft_check(self, specs: list[tuple[str, tuple[int, ...], str]]) -> None:
        if self.draft is None:
            raise ValueError(
                f"tensors: {specs[0][0]!r} is a draft model's tensor, but the engine has no "
                "draft model (speculative_config method 'draft_model')"
            )
        try:
            self.draft.check([(_strip(n), s, d) for n, s, d in specs], begin=False)
        except ValueError as e:
            raise ValueError(f"the draft model's tensors ({DRAFT_PREFIX}<name>): {e}") from None

    def load_bucket(self, bucket: Payload | dict[str, torch.Tensor]) -> int:
        """Copy a bucket (safetensors bytes or a uint8 array of them, read in place; or named
        tensors) into this rank's slices; the caller checked its names and shapes first."""
        tensors = bucket if isinstance(bucket, dict) else decode_bucket(bucket)
        self.settle()
        self._load(list(tensors.items()))
        return len(tensors)

    def rollback(self) -> None:
        """Put back every parameter the open transaction wrote (idempotent)."""
        saved, self._saved = self._saved, None
        self.settle()
        if self.draft is not None:
            self.draft.rollback()
        if saved:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name in saved:
                    params[name].data.copy_(self._backup[name])
        pack_modules(self._unpacked)
        self._unpacked = []

    def finish(self) -> None:
        """The update stands: drop what was saved, and re-pack what it changed on the loader
        thread (the engine serves meanwhile, the changed linears through F.linear)."""
        self._saved = None
        if self.draft is not None:
            self.draft.finish()
        modules, self._unpacked = self._unpacked, []
        if modules:
            self._repacking = self._loader.submit(pack_modules, modules)
        self.on_commit()

    def settle(self) -> None:
        """Wait for the last commit's re-pack (before weights change on this thread)."""
        if self._repacking is not None:
            self._repacking.result()
            self._repacking = None
        if self.draft is not None:
            self.draft.settle()

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        tensors, drafts = _split(tensors, lambda named: named[0])
        if drafts:
            assert self.draft is not None  # checked first (`check`)
            self.draft._load([(_strip(name), t) for name, t in drafts])
        if tensors:
            self._load_own(tensors)

    def _load_own(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._save(param_targets(self.model, (name for name, _ in tensors)))
        changed = load_weights(self.model, tensors, partial=True)
        if self._saved is None:  # a plain load: its packs at once
            repack_changed(self.model, changed)
        else:  # the re-pack waits for the commit, off the receive's path
            self._unpacked += drop_packs(self.model, changed)

    def _save(self, names: set[str]) -> None:
        if self._saved is None:
            return  # no transaction (a plain load): nothing to roll back to
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in names - self._saved:
                old = params[name].detach()
                if name not in self._backup:
                    self._backup[name] = torch.empty(old.shape, dtype=old.dtype, device="cpu")
                self._backup[name].copy_(old)
                self._saved.add(name)

    # --- the trainer's collective group -------------------------------------------------------

    def join_group(self, info: dict[str, Any], rank_base: int) -> int:
        """Join the trainer's group as rank `rank_base + tp rank` (every rank of every replica
        at once: it blocks until the whole group is in). Returns the rank."""
        group = GroupInfo(**info)
        self.close_group(group.group_name)
        rank = rank_base + self.tp.rank
        self.groups[group.group_name] = join_group(group, rank, self.device)
        return rank

    def receive(
        self,
        group_name: str,
        specs: list[tuple[str, tuple[int, ...], str]],
        packed: bool = False,
        buffer_bytes: int = DEFAULT_PACKED_BUFFER_BYTES,
    ) -> int:
        """Receive the tensors the trainer broadcasts (whole, in order; one per broadcast, or
        vLLM's packed chunks) and load each chunk as it lands. The caller checked the specs on
        every rank first. A failure raises as it is; the caller rolls back."""
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"group_name: no weight update group {group_name!r} was joined")
        wanted = [TensorSpec(n, tuple(s), d) for n, s, d in specs]
        chunks = broadcast_chunks(wanted, packed, buffer_bytes)
        loads: list[Future] = []
        try:
            for i, chunk in enumerate(chunks):
                if i >= 2:
                    loads[i - 2].result()  # its buffer is free again
                buffer = self._buffer(i % 2, sum(nbytes(s) for s in chunk))
                group.broadcast(buffer)
                loads.append(self._loader.submit(self._load, _unpack(buffer, chunk)))
        finally:
            wait(loads)
        for load in loads:
            load.result()  # raises a load's error
        return len(specs)

    def close_group(self, group_name: str | None = None) -> None:
        """Leave one group (None: every group); a peer waiting on us fails at once."""
        names = list(self.groups) if group_name is None else [group_name]
        for name in names:
            group = self.groups.pop(name, None)
            if group is not None:
                group.close()

    def _buffer(self, slot: int, size: int) -> torch.Tensor:
        """Receive buffer `slot` (of 2), `size` bytes, reused (fresh memory page-faults)."""
        if self._buffers[slot].numel() < size:
            self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._buffers[slot][:size]


def _nothing() -> None:
    pass


DRAFT_PREFIX = "draft."  # a draft model's tensors in the target's update: draft.<its HF name>


def _split(items: list, name_of) -> tuple[list, list]:
    """(the target's items, the draft model's), by name."""
    mine = [x for x in items if not name_of(x).startswith(DRAFT_PREFIX)]
    return mine, [x for x in items if name_of(x).startswith(DRAFT_PREFIX)]


def _strip(name: str) -> str:
    return name[len(DRAFT_PREFIX) :]


def _unpack(buffer: torch.Tensor, chunk: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """The chunk's tensors, as views of `buffer` (their bytes back to back)."""
    out, offset = [], 0
    for spec in chunk:
        size = nbytes(spec)
        flat = buffer[offset : offset + size]
        if offset % flat.new_empty(0, dtype=torch_dtype(spec.dtype)).element_size():
            flat = flat.clone()  # a dtype view needs an aligned start
        out.append((spec.name, flat.view(torch_dtype(spec.dtype)).view(spec.shape)))
        offset += size
    return out
