"""The async-ps coordinator's side of a run: the program it traces and the run loop's executor
that schedules chunks of it on the workers (see backends/async_ps.py for the replicator)."""

from __future__ import annotations

import re
import threading
import time

import numpy as np

from workbench._src.core.errors import InputError, WorkerError
from workbench._src.core.inputs import InputContext, call_input_fn
from workbench._src.core.program import Program, _is_infinite, call_compiled
from workbench._src.core.tf_setup import tf


class AsyncProgram(Program):
    """A (step_fn, input_fn) pair traced on the coordinator and scheduled on the workers."""

    def __init__(self, replicator, step_fn, input_fn):  # noqa: D107 - Program's, minus its input
        if not callable(step_fn):
            Program(replicator, step_fn, input_fn)  # raises its clear error
        self.replicator, self.step_fn, self.input_fn = replicator, step_fn, input_fn
        self.steps_done = 0
        self.fused_traced = False
        self.metric_names = None
        t = tf()
        strategy = replicator.strategy
        coordinator = replicator.coordinator

        ctx = InputContext(None, replicator.num_workers, 0, replicator.num_workers, 1)

        def dataset_fn(_input_context):
            return call_input_fn(input_fn, ctx)

        def per_worker_dataset_fn():
            return strategy.distribute_datasets_from_function(dataset_fn)

        self.iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
        # An endless input (`.repeat()`) gets the fused loop without an end check, as the
        # hand-written closure has; the per-worker iterator does not tell, so ask a dataset
        # built here (graph construction only: nothing is read).
        self.infinite_input = _is_infinite(call_input_fn(input_fn, ctx))
        self._one_step = t.function(self._one_step_graph)
        self._fused = t.function(self._fused_graph)

    def _one_step_graph(self, iterator):
        t = tf()
        outputs = self.replicator.strategy.run(self.call_step_fn, args=(next(iterator),))
        self.replicator.executed_steps.assign_add(1)
        return t.nest.map_structure(lambda v: v, outputs)

    def _step_taken(self):
        self.replicator.executed_steps.assign_add(1)  # our exact count, on a parameter server

    def schedule(self, n: int):
        t = tf()
        coordinator = self.replicator.coordinator
        return call_compiled(
            lambda it, k: coordinator.schedule(self._fused, args=(it, k)), self.iterator, t.constant(n)
        )

    def run_one(self):
        coordinator = self.replicator.coordinator
        remote = call_compiled(lambda it: coordinator.schedule(self._one_step, args=(it,)), self.iterator)
        self.steps_done += 1
        return tf().nest.map_structure(lambda v: v, remote.fetch())


class CoordinatorExecutor:
    """The run loop's executor on the coordinator: chunks scheduled on whichever worker is free,
    up to two per worker in flight, fetched in order as they return."""

    rate_window_seconds = 1.0  # results return in bursts (several workers finish together)
    replicas_per_step = 1  # a step is one worker's

    def __init__(self, program):
        self.program, self.repl = program, program.replicator
        self.max_in_flight = 2 * self.repl.num_workers
        self.run = None
        self.unreachable: set[str] = set()  # workers a fetch failed with (servers we do not watch)

    def start(self, run) -> None:
        self.run = run
        self.executed_before = int(self.repl.executed_steps.numpy())

    def agree(self, k: int, stop: bool) -> tuple[int, bool]:
        return k, stop

    def submit(self, k: int):
        return self.program.schedule(k)

    def collect(self, remote):
        """(rows, steps done) of a scheduled chunk, or None when it was lost with a dead worker.

        The fetch blocks in TensorFlow (for as long as a worker is missing), so it runs on a
        daemon thread while this one watches the servers: a dead parameter server, or no worker
        left, ends the run within a fraction of a second instead of never."""
        box: dict = {}
        fetched = threading.Event()

        def fetch():
            try:
                box["value"] = remote.fetch()
            except BaseException as e:  # noqa: BLE001 - handed to the loop's thread
                box["error"] = e
            finally:
                fetched.set()

        threading.Thread(target=fetch, name="workbench fetch", daemon=True).start()
        while not fetched.wait(0.1):
            self._check_servers()
        # And once per chunk however fast it returned: a worker that died while every fetch
        # came back within the poll (the coordinator re-ran its closures elsewhere) is still
        # reported, at the step it was noticed, not never.
        self._check_servers()
        if "error" in box:
            return self._lost_or_raise(box["error"])
        rows, done = box["value"]
        done = int(done)
        self.program.steps_done += done
        self.program.fused_traced = True
        return np.asarray(rows)[:done], done

    def _lost_or_raise(self, error):
        """None (run the chunk again) when its fetch failed with a lost worker, else raises.
        Usually the coordinator re-runs a dead worker's chunks itself; a chunk caught
        mid-transfer (its result still on the worker when it died) fails like this instead."""
        self._check_servers()  # a dead server explains a fetch failure best
        t = tf()
        if not isinstance(error, (t.errors.UnavailableError, t.errors.CancelledError, t.errors.AbortedError)):
            raise _translated_input_error(error) from None
        if self.repl.servers is not None:
            return None  # our own servers: the PS and a worker are alive (checked above)
        name = _worker_lost_with(str(error))
        if name:
            # Servers we do not watch (a Ray pool's actors, a real cluster's hosts): the error
            # names the worker and no parameter server. A lost PS is the launcher's to report,
            # or TensorFlow's next error names it.
            if name not in self.unreachable and self.run is not None:
                self.unreachable.add(name)  # (once per worker: TensorFlow keeps retrying it)
                self.run.publish(
                    "message", text=f"{name} is unreachable: its steps run again on the other workers"
                )
            return None
        raise _translated_input_error(error) from None

    def parallelism(self) -> int:
        return max(1, self.repl.live_workers())

    def extra_columns(self) -> dict:
        return {"workers": self.repl.live_workers()}

    def _check_servers(self) -> None:
        if self.repl.servers is not None:  # (a real cluster's servers are not ours to watch)
            self.repl.servers.check(self.run)

    def explain(self, error: BaseException) -> BaseException:
        """A failure while a server is dying (e.g. during a checkpoint save) is the server's death."""
        if isinstance(error, WorkerError):
            return error
        deadline = time.monotonic() + 2.0  # the exit status of a killed server takes a moment
        while time.monotonic() < deadline:
            try:
                self._check_servers()
            except WorkerError as dead:
                return dead
            time.sleep(0.1)
        return error

    def healthy(self) -> bool:
        try:
            self._check_servers()  # (a worker lost in the last chunk is reported)
        except WorkerError:
            return False
        return True

    def close(self) -> None:
        run = self.run
        if run is None or not self.healthy():
            return
        try:
            run.executed_steps = int(self.repl.executed_steps.numpy()) - self.executed_before
        except Exception:  # noqa: BLE001 - a server going away now: the history is exact anyway
            return
        if run.executed_steps != run.steps:
            run.publish(
                "message",
                text=f"workers executed {run.executed_steps} steps for the {run.steps} in the history: "
                "parameter-server execution is at-least-once (steps lost with a worker run again)",
            )


_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def _worker_lost_with(text: str) -> str | None:
    """ "worker N" when a fetch's error names that worker and no parameter server ("... from
    remote target /job:worker/replica:0/task:1 ..."; the coordinator itself is /job:chief)."""
    tasks = {(job, int(index)) for job, index in _TASK.findall(text) if job != "chief"}
    if not tasks or any(job != "worker" for job, _ in tasks):
        return None
    return f"worker {min(index for _, index in tasks)}"


def _translated_input_error(error):
    t = tf()
    if isinstance(error, t.errors.OutOfRangeError):
        return InputError(
            "input_fn's dataset ran out on a worker. Fix: add `.repeat()` to the dataset for as many "
            "steps as you run."
        )
    return error
