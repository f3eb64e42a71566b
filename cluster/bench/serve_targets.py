"""Endpoints for `raylane bench serve`: raylane started in-process, transformers serve."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from raylane.launch import free_port


@contextlib.contextmanager
def raylane_endpoint(
    url: str | None,
    model_dir: str,
    torch_threads: int | None = None,
    direct_ingress: bool | None = None,
):
    """Yield (url, model name): the given endpoint, or a local one started for the run (as
    `raylane serve` does: its ingress replica answers HTTP itself unless `direct_ingress` is
    False)."""
    if url:
        import httpx

        yield url, httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        return
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=model_dir,
        served_model_name="bench",
        port=free_port(),
        torch_threads=torch_threads,
        direct_ingress=direct_ingress,
    )
    launch.start_ray()
    try:
        yield launch.deploy(config), "bench"
    finally:
        launch.shutdown()


@contextlib.contextmanager
def transformers_endpoint(model_dir: str):
    """`transformers serve --continuous-batching` on the same model, float32, on CPU."""
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    proc = subprocess.Popen(
        [
            exe,
            "serve",
            model_dir,
            "--continuous-batching",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}", model_dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("transformers serve exited; is `transformers[serving]` installed?")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"{url} did not come up within {timeout_s:.0f} s")
