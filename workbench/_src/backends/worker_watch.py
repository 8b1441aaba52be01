"""async-ps's `worker_timeout`: which workers of a cluster we did not start still answer.

TensorFlow's ClusterCoordinator re-runs the closures of a worker whose RPCs *fail*, but a worker
whose host is cut off, or whose process is frozen, fails nothing: its closure waits in gRPC for
minutes, and the run loop waits for that closure's result. So the coordinator probes every
worker's address (backends/peer_probe.py: a frozen process still accepts TCP, but its gRPC server
does not answer) and declares lost a worker that has not answered for `worker_timeout` seconds;
the run loop then runs that worker's chunk again on the others, and the run goes on (the promise
of parameter-server training). A lost worker that answers again has rejoined: TensorFlow sends it
closures again once its stuck call returns.

Servers this process started (on one host: launch/placement.py `Role.started_by`) are its
children, watched by their exit instead; a frozen one is not seen (the coordinator waits, as
TensorFlow does).
"""

from __future__ import annotations

import threading
import time

from workbench._src.backends.peer_probe import PEER, probe

DEFAULT_WORKER_TIMEOUT = 60.0
PROBE_INTERVAL = 2.0


class WorkerWatch:
    """Probes `workers` ({"worker 0": "host:port", ...}) on a daemon thread.

    `lost` holds the workers silent for `timeout` seconds (and when they were declared lost);
    `changes()` gives what happened since its last call, for the run's thread to say.
    """

    def __init__(self, workers: dict[str, str], timeout: float, interval: float = PROBE_INTERVAL):
        self.workers, self.timeout, self.interval = dict(workers), timeout, interval
        now = time.monotonic()
        self._last_answer = {name: now for name in self.workers}
        self.lost: dict[str, float] = {}  # name -> monotonic time it was declared lost
        self._changes: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="workbench worker watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(self.interval):
            for name, address in self.workers.items():
                # (a probe of a cut-off host takes its whole timeout: keep it under the interval)
                answered = probe(address, timeout=min(1.0, self.interval)) == PEER
                now = time.monotonic()
                with self._lock:
                    if answered:
                        self._last_answer[name] = now
                        if self.lost.pop(name, None) is not None:
                            self._changes.append((name, "rejoined"))
                    elif name not in self.lost and now - self._last_answer[name] >= self.timeout:
                        self.lost[name] = now
                        self._changes.append((name, "lost"))

    def changes(self) -> list[tuple[str, str]]:
        """[(worker name, "lost" | "rejoined"), ...] since the last call."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def live(self) -> int:
        with self._lock:
            return len(self.workers) - len(self.lost)

    def latest_loss(self) -> float | None:
        """When the most recent of the workers lost now was declared lost (None: none is)."""
        with self._lock:
            return max(self.lost.values(), default=None)

    def stop(self) -> None:
        self._done.set()  # (the thread is a daemon: a probe in progress never holds the exit)
