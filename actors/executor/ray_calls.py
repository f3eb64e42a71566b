"""What the Ray executor asks of Ray itself: a connection (`ensure_ray`), and the answers of
every rank's call at once, where the first failure anywhere raises without waiting for the
rest (`gather`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from raylane.actors.executor.base import ExecutorError


def ensure_ray() -> None:
    """Connect to `RAY_ADDRESS` if set, else start a light local Ray (never someone else's)."""
    import ray

    if ray.is_initialized():
        return
    for key, value in (
        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        ("RAY_AUTH_MODE", "disabled"),
        ("RAY_USAGE_STATS_ENABLED", "0"),
    ):
        os.environ.setdefault(key, value)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        ray.init(
            address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False
        )


def gather(
    refs: list,
    fail: Callable[[BaseException], None],
    timeout_s: float | None = None,
    kill_on_error: bool = False,
) -> list:
    """Wait for every rank; the first failure anywhere raises at once. A rank that died or did
    not answer in time, or one that raised with `kill_on_error`, is handed to `fail` (which
    ends the group) and raises ExecutorError; a rank's exception otherwise raises as itself."""
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    try:
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(f"shards did not answer within {timeout_s:.0f} s")
            ray.get(ready)  # raises a failed rank's error while its peers still wait
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        if kill_on_error:
            fail(e)
            raise ExecutorError(f"a shard failed mid-step: {e.cause!r}") from e
        _drain(refs)  # the same error on the other ranks: read it, or Ray logs it as unhandled
        raise e.as_instanceof_cause() from None
    except (ray.exceptions.RayActorError, TimeoutError) as e:
        fail(e)
        raise ExecutorError(f"a shard died: {e}") from e


def _drain(refs: list) -> None:
    import ray

    for ref in refs:
        try:
            ray.get(ref)
        except Exception:  # noqa: S110 (the first error is the one raised)
            pass
