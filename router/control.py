"""The RL control plane: pause, resume, weight updates and aborts across every engine replica.

The Router actor hosts one for its replica actors, `local_backend` one for its in-process engine;
either way it is the `ControlBackend` the admin routes drive. Its public coroutines are the
verbs (`CONTROL_VERBS`): the ingress calls the Router's plane through `RouterControl`, which
sends each by name, so a new verb is a new method here and nothing else.
One asyncio.Lock serializes pause, resume and each step of an update, so concurrent callers (two
trainers, a retry racing its original) see them one after another, never interleaved; every call
is broadcast and idempotent on the replicas, so a retry, or a Router that restarted and forgot
its state, is harmless. Aborts, flushes and version reads take no lock: an abort must be able to
end the stragglers a "wait" pause is waiting for.

An update is a transaction: `begin_update` pauses the cluster (mode "keep") unless it is paused
and checks the manifest on every replica — a bad name or shape anywhere fails it before any
weight changes; `load_bucket` applies one bucket on every replica of the transaction;
`commit_update` switches them all to the new version and resumes what it paused. A replica that
fails mid-update leaves the transaction and stays at the old version; the Router routes only to
replicas at the cluster's version, so it serves nothing until a later update reaches it, as does
a replica the Router restarted from the checkpoint (version 0). Updates reach every healthy replica,
those behind included: an update with every weight brings them back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from raylane.actors.engine.async_control import PAUSE_MODES
from raylane.actors.models.weights import TensorSpec
from raylane.router.control_parts import (
    ReplicaCalls,
    ReplicaTable,
    Update,
    check_label,
    check_version,
    commit_version,
    manifest,
    remember_label,
)
from raylane.router.errors import ControlConflict, ReplicasFailed, UpdateNotFound
from raylane.router.lora_groups import LoRAGroups
from raylane.router.remote import verbs
from raylane.router.weight_groups import WeightGroups

log = logging.getLogger(__name__)


class ControlPlane(LoRAGroups, WeightGroups):
    # LoRAGroups: the adapter verbs (router/lora_control.py, router/lora_groups.py)
    def __init__(self, table: ReplicaTable, calls: ReplicaCalls) -> None:
        super().__init__(table, calls)
        self.paused_mode: str | None = None
        self._update: Update | None = None
        self._committed: tuple[str, int] | None = None  # the last commit, for a retried one
        # versions' labels, as the trainer protocols named them at commit ("step-42"); the
        # integer stays what the prefix cache and max_weight_lag compare
        self._labels: dict[int, str] = {}
        self._groups: dict[str, list[str]] = {}  # the trainer's groups -> replicas in them
        self._detached: set[asyncio.Task] = set()  # joins and receives that outlive their call
        self._lock = asyncio.Lock()

    async def weight_version(self) -> int:
        return self.table.weight_version()

    async def weight_label(self, version: int | None = None) -> str | None:
        """The label `version` (None: the cluster's) was committed with by a trainer
        protocol (vLLM's `finish_weight_update`, SGLang's `weight_version`); None if none
        was given. A committed version's label never changes, so callers may keep it."""
        return self._labels.get(self.table.weight_version() if version is None else version)

    async def control_state(self) -> dict[str, Any]:
        return self.state()

    def state(self) -> dict[str, Any]:
        """Paused (and the mode), the weight version, and its label where one was given."""
        paused = (
            {"paused": True, "mode": self.paused_mode} if self.paused_mode else {"paused": False}
        )
        version = self.table.weight_version()
        label = self._labels.get(version)
        return {
            **paused,
            "weight_version": version,
            **({"weight_label": label} if label is not None else {}),
        }

    # --- pause and resume ---------------------------------------------------------------------

    async def pause(self, mode: str) -> dict[str, Any]:
        """Pause every replica in `mode` (see `AsyncLLMEngine.pause`); pausing again applies
        the new mode. Returns `state()`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: {mode!r} is not one of {list(PAUSE_MODES)}")
        async with self._lock:
            await self._pause(mode)
            if self._update is not None:  # paused on purpose: the commit must not resume
                self._update.paused_here = False
            return self.state()

    async def resume(self) -> dict[str, Any]:
        """Resume every replica. An update with nothing loaded yet is dropped; one that is
        half loaded is a `ControlConflict` (commit it, abort it, or begin a new one, first)."""
        async with self._lock:
            if self._update is not None:
                if self._update.loaded:
                    raise ControlConflict(
                        f"weight update {self._update.update_id!r} is half loaded: commit it, "
                        "abort it, or begin a new one before resuming"
                    )
                self._update = None
            await self._resume()
            return self.state()

    async def _pause(self, mode: str) -> None:
        await self._everywhere(self._reachable(), "pause", lambda r: r.pause(mode))
        self.paused_mode = mode

    async def _resume(self) -> None:
        await self._everywhere(self._reachable(), "resume", lambda r: r.resume())
        self.paused_mode = None

    # --- the update transaction ---------------------------------------------------------------

    async def begin_update(
        self, version: int | None, spec_dicts: list[dict] | None, label: str | None = None
    ) -> str:
        """Open an update to `version` (newer than the cluster's; None: the commit's, or the
        next) of the tensors in `spec_dicts` ({"name", "shape", "dtype"}, HF names, full
        shapes), checked on every replica; a `ValueError` (naming the tensor) leaves every
        replica as it was. `spec_dicts` None: an open-ended update, each `receive_weights`
        checking its own tensors. `label`: the version's name in a trainer protocol, kept
        beside it at commit (`weight_label`). Returns the update id. A begin replaces an
        update that was not committed."""
        specs = None if spec_dicts is None else manifest(spec_dicts)
        return await self._begin(version, specs, label)

    async def set_weight_version(self, version: int | None, label: str | None = None) -> int:
        """Switch every replica to `version` (newer than the cluster's; None: the next) with
        the weights they hold: an update with no tensors, so it pauses, flips and resumes as
        any update does (new prefills stop matching older chains, new tokens carry the new
        version). Returns the version."""
        update_id = await self._begin(version, [], label)
        return await self.commit_update(update_id)

    async def _begin(
        self, version: int | None, specs: list[TensorSpec] | None, label: str | None
    ) -> str:
        dicts = None if specs is None else [s.to_dict() for s in specs]
        check_label(label)
        async with self._lock:
            if version is not None:
                check_version(version, self.table.weight_version())
            fresh = self.paused_mode is None
            if fresh:
                await self._pause("keep")
            try:
                ok = await self._everywhere(
                    self._reachable(),
                    "begin_weight_update",
                    lambda r: r.begin_weight_update(dicts),
                )
            except BaseException:
                if fresh:  # nothing was begun anywhere: undo the pause
                    await self._resume()
                raise
            paused_here = fresh or (self._update is not None and self._update.paused_here)
            self._update = Update(
                f"upd-{secrets.token_hex(8)}",
                version,
                list(ok),
                len(specs or []),
                paused_here,
                label,
            )
            return self._update.update_id

    async def load_bucket(self, update_id: str, bucket: Any) -> int:
        """Apply one bucket (safetensors bytes, or `[ObjectRef]` of them) on every replica of
        the update; returns how many tensors it held. A `ValueError` (a tensor not in the
        manifest, or unlike its spec) changes nothing, and the update stays open."""
        async with self._lock:
            update = self._open(update_id)
            ok = await self._everywhere(
                update.replica_ids,
                "load_weight_bucket",
                lambda r: r.load_weight_bucket(bucket),
                update=update,
            )
            count = next(iter(ok.values()))
            update.loaded += count
            return count

    async def commit_update(
        self, update_id: str | None, version: int | None = None, label: str | None = None
    ) -> int:
        """Switch every replica of the update (None: the open one) to `version` (default:
        the begin's, or the next), labelled `label` (default: the begin's), and resume the
        cluster if the update paused it. Returns the version; committing it again returns
        it again."""
        check_label(label)
        async with self._lock:
            if self._committed is not None and self._committed[0] == update_id:
                return self._committed[1]
            update = self._open(update_id)
            if update.loaded < update.num_tensors:
                raise ValueError(
                    f"only {update.loaded} of the update's {update.num_tensors} "
                    "tensors were loaded; send the rest before committing"
                )
            version = commit_version(update, version, self.table.weight_version())
            ok = await self._switch(update, version, update.label if label is None else label)
            for rid in ok:
                self.table.set_version(rid, version)
            self._update, self._committed = None, (update.update_id, version)
            if update.paused_here:
                await self._resume_after_commit()
            return version

    async def _switch(self, update: Update, version: int, label: str | None) -> dict[str, Any]:
        """Every replica of the update to `version`. The label is kept first: a version's
        outputs can come as soon as a replica switched, and nothing reads a version before."""
        if label is not None:
            remember_label(self._labels, version, label)
        try:
            return await self._everywhere(
                update.replica_ids,
                "finish_weight_update",
                lambda r: r.finish_weight_update(version),
                update=update,
            )
        except BaseException:
            self._labels.pop(version, None)  # no replica holds it: the next commit reuses it
            raise

    async def _resume_after_commit(self) -> None:
        """The commit stands even if no replica resumes: a later resume retries."""
        try:
            await self._resume()
        except ReplicasFailed as e:
            log.warning("no engine replica resumed after the weight update: %s", e)

    def _open(self, update_id: str | None) -> Update:
        self._raise_detached_failure()
        if self._update is None or update_id not in (None, self._update.update_id):
            raise UpdateNotFound(
                f"no weight update {update_id!r} is open (never begun, "
                "committed, or replaced by a newer begin)",
                param="update_id",
            )
        return self._update

    # --- requests and the cache ---------------------------------------------------------------

    async def abort(self, request_ids: list[str] | None) -> list:
        """End these requests wherever they run (unknown ids are skipped; None: every
        request); their partial outputs (`RequestOutput`, finish reason "abort")."""
        ids = self.table.reachable()
        wanted = None if request_ids is None else list(request_ids)
        done = await self._everywhere(ids, "abort", lambda r: r.abort(wanted)) if ids else {}
        return [out for outs in done.values() for out in outs]

    async def flush_cache(self) -> None:
        """Drop every replica's prefix cache."""
        await self._everywhere(self._reachable(), "flush_cache", lambda r: r.flush_cache())

    # --- sleep and weight checks (the trainer protocols) -----------------------------------------

    async def sleep(self, level: int) -> dict[str, Any]:
        """Pause in mode "abort" (requests in flight end, new ones wait) and free every
        replica's KV cache, and at level 2 its weights; `wake_up` undoes it."""
        if level not in (1, 2):  # before pausing anything
            raise ValueError(f"level: {level!r} is not 1 or 2")
        async with self._lock:
            await self._pause("abort")
            await self._call_all("sleep", level)
            return self.state()

    async def wake_up(self, tags: list[str] | None) -> dict[str, Any]:
        """Restore what sleep released ("weights", "kv_cache"; no tags: both) and resume once
        the KV caches are back (tags without "kv_cache": the cluster stays asleep)."""
        async with self._lock:
            await self._call_all("wake_up", tags)
            if tags is None or "kv_cache" in tags:
                await self._resume()
            return self.state()

    async def call_replicas(self, method: str, *args: Any) -> dict[str, Any]:
        """A read or check (`CONTROL_CALLS`: is_sleeping, weight_checksums, reset_weights) on
        every healthy replica; the answers by replica id."""
        async with self._lock:
            return await self._call_all(method, *args)


# what a caller in another process may ask of the plane (`Router.control`): its own methods
CONTROL_VERBS = verbs(ControlPlane)
