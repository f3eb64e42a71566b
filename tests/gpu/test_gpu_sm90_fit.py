"""The paged attention kernels compiled ahead of time for sm_90 (the H100; Triton's bundled
ptxas, no GPU needed) at the tiles the host picks: each program's shared memory fits the
232448 bytes an H100 program may have (tests/support/sm90_fit.py). The first H100 run failed
MLA's prefill here: 64 rows of 1024 float32 lanes asked for 532864 bytes, and the compile
below gives the same number for those tiles. About a minute of compiling on a CPU: a GPU-lane
check (run_all.sh, or RAYLANE_GPU_TESTS_DEVICE=cpu), not in `make test`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.device import in_gpu_lane

pytest.importorskip("triton")
pytestmark = in_gpu_lane

SM90_SHARED = 232448


@pytest.fixture(scope="module")
def shared() -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.sm90_fit"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_mla_prefill_fits_sm90_shared_memory(shared):
    assert shared["prefill-fp32-576-16"] <= SM90_SHARED


def test_the_first_gpu_runs_tiles_did_not_fit(shared):
    """The check can fail: the old tiles, compiled the same way, ask what the H100 reported."""
    assert shared["old-prefill-fp32-576-16"] == 532864
