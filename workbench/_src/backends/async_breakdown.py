"""run.breakdown() under async-ps: where a worker's step goes when variables live on parameter
servers.

Every chunk scheduled on the workers reads the clock (step_clock.py; every one, not a sample: see
CoordinatorExecutor.submit), so input, the step and the loop's own time are measured on the worker
that ran them. What differs is communication: no collective runs (each worker applies its own
gradient); the traffic is the step's reads of every variable from the parameter servers and the
write of its update. Those reads and writes sit inside the step's ops, so they are timed as a
sub-program: a function scheduled on a worker that reads every trainable variable into it (PROBES
times, the median), and a step's traffic is taken as twice that (the update sends as many bytes
back). Compute is the rest of the step. One row: the workers' chunks are pooled (the coordinator
does not learn which worker ran a chunk); the host's own time around chunks is not a worker's, so
`other` is the loop's time between steps only.
"""

from __future__ import annotations

import statistics

import numpy as np

from workbench._src.core import step_clock
from workbench._src.core.breakdown import BreakdownRecorder
from workbench._src.core.tf_setup import tf

PROBES = 3


class AsyncBreakdown:
    def __init__(self, program, run):
        self.program = program
        self.recorder = BreakdownRecorder(run, worker=0)
        self.traffic: float | None = None  # seconds per step moving variables to and from the ps

    def chunk(self, steps: int, marks, first_run: bool) -> None:
        """A chunk came back: its clock readings; `first_run`: the loop's first run (traced
        there: not a step's time)."""
        if first_run or not len(marks):
            self.recorder.chunk(0.0, 0.0, steps, None, traced=first_run)
            return
        if self.traffic is None:
            self.traffic = 2 * self._read_seconds()
        marks = np.array(marks, dtype=np.float64)
        marks[:, 3] = self.traffic
        # The worker's own clock only: the chunk "began" at its first reading, "ended" at its last,
        # and no time between chunks (they overlap, on several workers with their own clocks).
        self.recorder.previous_end = None
        self.recorder.chunk(marks[0, 0], marks[-1, 2], steps, marks, traced=False)

    def close(self) -> None:
        self.recorder.close()

    def _read_seconds(self) -> float:
        variables = [v for v in self.program.replicator._created_variables if getattr(v, "trainable", True)]
        if not variables:
            return 0.0
        # (Once per model on this cluster: every traced probe stays in the servers' memory.)
        model = tuple((tuple(v.shape), v.dtype.name) for v in variables)
        known = self.program.replicator.variable_read_seconds
        if model not in known:
            known[model] = self._measured_read_seconds(variables)
        return known[model]

    def _measured_read_seconds(self, variables) -> float:
        t = tf()

        @t.function
        def read_all():
            begin = t.timestamp()
            with t.control_dependencies([begin]):
                sums = [t.reduce_sum(t.cast(v, t.float32)) for v in variables]
            return step_clock.stamp_after(sums) - begin

        coordinator = self.program.replicator.coordinator
        seconds = [float(coordinator.schedule(read_all).fetch()) for _ in range(PROBES)]
        return statistics.median(seconds)
