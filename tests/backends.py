"""Every backend the conformance tests run over, the process ones marked slow (they start
worker processes). A new backend gets a line here; missing hardware skips, never fails."""

from __future__ import annotations

import pytest

import workbench as wb

IN_PROCESS = [
    pytest.param(("single", None), id="single"),
    pytest.param(("mirrored", 2), id="mirrored-2"),
    pytest.param(("mirrored", 4), id="mirrored-4"),
    pytest.param(("mirrored", 8), id="mirrored-8"),
    pytest.param(("tpu", None), id="tpu"),
]
# Steps in worker processes. async-ps equals one device only with one worker (two step apart).
PROCESS = [
    pytest.param(("multi-worker", 2), id="multi-worker-2", marks=pytest.mark.slow),
    pytest.param(("async-ps", 1), id="async-ps-1", marks=pytest.mark.slow),
]
ALL = IN_PROCESS + PROCESS


def make(name: str, replicas: int | None):
    """The backend's replicator; skips the test where its hardware is missing (TPU)."""
    try:
        return wb.replicator(name, num_replicas=replicas)
    except wb.TpuUnavailableError as e:
        pytest.skip(f"no TPU here: {str(e)[:80]}")
