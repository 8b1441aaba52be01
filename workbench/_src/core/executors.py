"""What runs a run's chunks for the loop (core/run_loop.py): the `Executor` protocol, and the
in-process one, a Program's fused tf.function here (single, mirrored, tpu, and each worker of a
multi-worker run). async-ps's `CoordinatorExecutor` is in backends/async_coordinator.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from workbench._src.core.breakdown import BreakdownRecorder
from workbench._src.core.run import Run


class Executor(Protocol):
    """What runs a run's chunks for ChunkLoop (InProcessExecutor here; the async-ps
    CoordinatorExecutor in backends/async_coordinator.py)."""

    max_in_flight: int  # chunks submitted before the first is collected
    rate_window_seconds: float  # 0: each chunk's own time gives its throughput
    replicas_per_step: int  # metric rows arrive summed over this many replicas

    def start(self, run: Run) -> None: ...
    # One k and stop kind (run.NO_STOP / STOP / PREEMPT: the most urgent wins) for all processes.
    def agree(self, k: int, stop: int) -> tuple[int, int]: ...
    def submit(self, k: int): ...  # starts a chunk of k steps; returns a handle
    def collect(self, handle): ...  # (rows, steps run), or None when lost with a dead worker
    def parallelism(self) -> int: ...
    def extra_columns(self) -> dict: ...  # added to every history row (async-ps: live workers)
    def explain(self, error: BaseException) -> BaseException: ...  # the error to fail the run with
    def healthy(self) -> bool: ...  # whether a checkpoint can still be saved after a failure
    def close(self) -> None: ...


def no_agreement(k: int, stop: int) -> tuple[int, int]:
    return k, stop


class InProcessExecutor:
    """Runs chunks of a Program's fused loop here, one at a time.

    `agree`: how the processes of a run agree on each chunk's length and on stopping
    (multi-worker replicas must run chunks of the same length and stop together; one process
    agrees with itself).
    """

    max_in_flight = 1
    rate_window_seconds = 0.0  # each chunk's own time gives its throughput

    def __init__(self, program, agree: Callable[[int, int], tuple[int, int]] = no_agreement):
        self.program = program
        self.agree = agree
        self.replicas_per_step = program.replicator.num_replicas  # metrics arrive summed over them
        self.breakdown = None  # a BreakdownRecorder while a run with breakdown=True goes

    def start(self, run) -> None:
        if self.program.timing and self.program.can_time:
            self.breakdown = BreakdownRecorder(run, worker=self.program.replicator.worker_id)

    def submit(self, k: int):
        if self.breakdown is not None:  # a sample of chunks reads the clock (core/breakdown.py)
            return self.breakdown.run_chunk(self.program, k)
        return self.program.run_fused(k)  # runs now; program.steps_done advances

    def collect(self, handle):
        return handle

    def parallelism(self) -> int:
        return 1

    def extra_columns(self) -> dict:
        return {}

    def explain(self, error: BaseException) -> BaseException:
        """The error to fail the run with (a backend may name a dead process instead)."""
        return error

    def healthy(self) -> bool:
        """Whether a checkpoint can still be saved after a failure."""
        return True

    def close(self) -> None:
        if self.breakdown is not None:
            self.breakdown.close()
