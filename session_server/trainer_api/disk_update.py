"""SGLang's `POST /update_weights_from_disk {model_path, weight_version?, abort_all_requests?}`,
as one weight-update transaction of the control plane: the checkpoint's tensors (HF names, from
its safetensors headers) are the manifest, checked on every rank before any byte moves; then
its buckets; then one commit, which flips every replica to the next version or none, labelled
`weight_version` if given. A checkpoint that does not fit the served model is a 400 and changes
nothing."""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Iterator

from fastapi import APIRouter, Request
from raylane.session_server.backend import ControlBackend
from raylane.session_server.errors import bad_request, from_exception
from raylane.session_server.openapi import ok
from raylane.session_server.trainer_api.common import control_of, version_label
from raylane.session_server.trainer_api.schemas import UpdateFromDiskBody, UpdateResult

router = APIRouter(tags=["SGLang native API"])
control = APIRouter(tags=["SGLang native API"])

BUCKET_BYTES = 256 << 20  # read and applied one bucket at a time


@control.post("/update_weights_from_disk", response_model=None, responses=ok(UpdateResult))
async def update_weights_from_disk(body: UpdateFromDiskBody, request: Request) -> dict:
    files = _safetensors_files(body.model_path)
    ctl = control_of(request)
    given = body.weight_version
    label = None if given is None else version_label(given, "weight_version")
    if body.abort_all_requests:
        await ctl.abort(None)
    try:
        count, version = await load_checkpoint(ctl, files, label)
    except ValueError as e:
        raise from_exception(e, {"label": "weight_version", "tensors": "model_path"}) from None
    return {
        "success": True,
        "message": f"Loaded {count} tensors from {body.model_path}; "
        f"weight version updated to {version if label is None else label}.",
        "num_paused_requests": 0,
    }


async def load_checkpoint(
    ctl: ControlBackend, files: list[str], label: str | None
) -> tuple[int, int]:
    """begin (the whole manifest) -> one bucket at a time -> commit; how many tensors, and
    the version committed. Files are read off the event loop, one bucket ahead of none."""
    from raylane.actors.models.weights import iter_buckets

    specs = await asyncio.to_thread(_specs, files)
    update_id = await ctl.begin_update(None, specs, label)
    try:
        buckets = iter_buckets(_tensors(files), BUCKET_BYTES)
        while (payload := await asyncio.to_thread(_next_payload, buckets)) is not None:
            await ctl.load_bucket(update_id, payload)
        return len(specs), await ctl.commit_update(update_id)
    except BaseException:
        await ctl.abort_update(update_id)  # a half-loaded update would hold the pause
        raise


def _next_payload(buckets: Iterator[list]) -> bytes | None:
    from raylane.actors.models.weights import encode_bucket

    bucket = next(buckets, None)
    return None if bucket is None else encode_bucket(bucket)


def _safetensors_files(model_path: str) -> list[str]:
    path = os.path.expanduser(model_path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    if path.endswith(".safetensors") and os.path.isfile(path):
        files = [path]
    if not files:
        raise bad_request(
            f"model_path: {model_path!r} holds no .safetensors checkpoint this server can read",
            "model_path",
        )
    return files


def _specs(files: list[str]) -> list[dict]:
    """Every tensor's name, shape and dtype, from the files' headers (no tensor is read)."""
    from raylane.actors.models.checkpoint import _DTYPES
    from raylane.actors.models.weights import dtype_name
    from safetensors import safe_open

    specs = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                dtype = _DTYPES[view.get_dtype()]
                specs.append({"name": name, "shape": view.get_shape(), "dtype": dtype_name(dtype)})
    return specs


def _tensors(files: list[str]) -> Iterator:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
