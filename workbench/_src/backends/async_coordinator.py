"""The async-ps coordinator's side of a run: the program it traces and the run loop's executor
that schedules chunks of it on the workers (see backends/async_ps.py for the replicator)."""

from __future__ import annotations

import collections
import gc
import re
import threading
import time

from workbench._src.backends.async_breakdown import AsyncBreakdown
from workbench._src.backends.placed_workers import PlacedWorkers
from workbench._src.backends.worker_watch import WorkerWatch
from workbench._src.core.errors import InputError, WorkerError
from workbench._src.core.inputs import InputContext, call_input_fn
from workbench._src.core.program import Program, _is_infinite, call_compiled
from workbench._src.core.run_stats import heal_line
from workbench._src.core.tf_setup import tf
from workbench._src.launch.runtime import is_launched

# Seconds the chunks in flight when a worker is declared lost may still come back: those on the
# other workers are done by then (a chunk is ~CHUNK_SECONDS), those on the lost one never are.
LOST_CHUNK_GRACE = 1.0
# While a worker is lost, a chunk waited for this many times as long as chunks usually are (and at
# least LOST_CHUNK_GRACE) is presumed on it: a model whose chunks take seconds is not re-run forever.
LOST_CHUNK_USUAL_WAITS = 3
STOP_GRACE = 3.0  # seconds the chunks in flight may still come back once a stop is asked for
FETCH_FLOOR = 0.25  # seconds any chunk is waited for past a grace: a finished one comes back


class AsyncProgram(Program):
    """A (step_fn, input_fn) pair traced on the coordinator and scheduled on the workers."""

    # Its chunks read the clock on the workers; communication is timed apart (async_breakdown.py).

    def __init__(self, replicator, step_fn, input_fn):  # noqa: D107 - Program's, minus its input
        if not callable(step_fn):
            Program(replicator, step_fn, input_fn)  # raises its clear error
        self.replicator, self.step_fn, self.input_fn = replicator, step_fn, input_fn
        self.steps_done = 0
        self.input_position = 0  # (not kept: see fast_forward)
        self.fused_traced = False
        self.traced_variants: set = set()
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

    def trace(self) -> None:
        """Nothing before the first scheduled chunk: tracing here would need a worker's iterator,
        and the coordinator's wrapped optimizers are built when that chunk is traced."""

    def fast_forward(self, batches: int) -> list[str]:
        """A resumed async run starts each worker's input from its first batch: its workers take
        batches in no fixed order, so no position would make it the run it continues."""
        if not batches:
            return []
        return [
            "async-ps resumes the variables and the step count; each worker's input starts again "
            "from its first batch (asynchronous workers take batches in no fixed order)"
        ]

    def _one_step_graph(self, iterator):
        t = tf()
        outputs = self.replicator.strategy.run(self.call_step_fn, args=(next(iterator),))
        self.replicator.executed_steps.assign_add(1)
        return t.nest.map_structure(lambda v: v, outputs)

    def _step_taken(self):
        self.replicator.executed_steps.assign_add(1)  # our exact count, on a parameter server

    def schedule(self, n: int, timed: bool = False):
        t = tf()
        coordinator = self.replicator.coordinator
        self.traced_variants.add(timed)
        return call_compiled(
            lambda it, k: coordinator.schedule(self._fused, args=(it, k, timed)), self.iterator, t.constant(n)
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
        # Workers a fetch failed with (servers we do not watch), and when: one not replaced since
        # leaves its pool not whole (said at close()).
        self.unreachable: dict[str, float] = {}
        self.replaced_at: dict[str, float] = {}  # worker name -> when its replacement answered
        self.watch: WorkerWatch | None = None  # probes the workers of a cluster we did not start
        self.placed: PlacedWorkers | None = None  # servers a placement watches for us (a Ray pool)
        self._stop_seen: float | None = None  # when this run's stop request was first seen
        self._left_behind = False
        self._waits: collections.deque = collections.deque(maxlen=20)  # recent chunks' fetch waits (s)
        self.breakdown: AsyncBreakdown | None = None

    def start(self, run) -> None:
        self.run = run
        if self.program.timing:
            self.breakdown = AsyncBreakdown(self.program, run)
        self.executed_before = int(self.repl.executed_steps.numpy())
        if self.repl.servers is None:
            self.placed = PlacedWorkers()
        timeout = self.repl.plan.worker_timeout
        if self.repl.servers is None and timeout and self.repl.worker_addresses:
            addresses = self.repl.worker_addresses
            self.watch = WorkerWatch({f"worker {i}": a for i, a in enumerate(addresses)}, timeout)

    def agree(self, k: int, stop: int) -> tuple[int, int]:
        return k, stop

    def submit(self, k: int):
        # With the breakdown on, every chunk reads the clock (async_breakdown.py), not a sample as
        # elsewhere: one variant of the loop, traced once a run. An untimed variant beside it was
        # a second function on every parameter server, which keeps its part of each function for
        # the life of the process (decision 19: 2 MiB a run for a small MLP), and a second trace
        # in every run; the readings cost microseconds a step against the milliseconds of its
        # parameter-server traffic. The first chunk traces: not a step's time.
        timed = self.breakdown is not None
        first_run = timed and timed not in self.program.traced_variants
        return self.program.schedule(k, timed), time.monotonic(), first_run

    def collect(self, handle):
        """(rows, steps done) of a scheduled chunk, or None when it was lost with a dead worker.

        The fetch blocks in TensorFlow (for as long as a worker is missing), so it runs on a
        daemon thread while this one watches the servers: a dead parameter server, or no worker
        left, ends the run within a fraction of a second instead of never."""
        remote, submitted, first_run = handle
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
        waiting_since = time.monotonic()
        while not fetched.wait(0.1):
            self._check_servers()
            if self._abandon(submitted, waiting_since):
                return None  # (TensorFlow may still run it, later: execution is at-least-once)
        # And once per chunk however fast it returned: a worker that died while every fetch
        # came back within the poll (the coordinator re-ran its closures elsewhere) is still
        # reported, at the step it was noticed, not never.
        self._check_servers()
        if "error" in box:
            return self._lost_or_raise(box["error"])
        self._waits.append(time.monotonic() - waiting_since)
        import numpy as np  # (here: `import workbench` loads no numpy)

        rows, done = box["value"][:2]
        done = int(done)
        if self.breakdown is not None:
            self.breakdown.chunk(done, np.asarray(box["value"][2])[:done], first_run)  # (timed: submit)
        self.program.steps_done += done
        if not self.program.fused_traced:
            self.program.fused_traced = True
            # Free the tracing's garbage now, while every worker answers. A function freed later
            # by the cycle collector is removed from every worker's context by an RPC that holds
            # the GIL: with a worker's host cut off, that froze the whole coordinator (Ctrl-C
            # included) until TCP gave up, minutes later.
            gc.collect()
        return np.asarray(rows)[:done], done

    def _abandon(self, submitted: float, waiting_since: float) -> bool:
        """True when the chunk being waited for will not come back in time: it is on a worker
        declared lost (sent before the loss, it is still waiting LOST_CHUNK_GRACE s after it; sent
        after, it has waited LOST_CHUNK_USUAL_WAITS times as long as chunks usually do), or a stop
        was asked for and it has not come back within STOP_GRACE s of it (Ctrl-C ends the run in
        seconds even while a worker is cut).

        Each grace is one for all the chunks in flight at the event, not one each: a cut-off
        worker holds every chunk it ran whose result was not yet fetched from it, and a grace
        apiece added up (Ctrl-C during a cut once took 12 s; after a loss, the run made no step
        for 3 s per such chunk). Past it, a chunk still gets FETCH_FLOOR s: a healthy worker's
        finished chunk comes back in milliseconds."""
        now = time.monotonic()
        run = self.run
        if run is not None and run.stop_requested:
            if self._stop_seen is None:
                self._stop_seen = now
            if now - self._stop_seen >= STOP_GRACE and now - waiting_since >= FETCH_FLOOR:
                if not self._left_behind:  # (said once, however many chunks are left)
                    self._left_behind = True
                    run.publish(
                        "message",
                        text=f"stopping: a chunk that has not come back within {STOP_GRACE:g} s (a "
                        "worker that does not answer) is left behind; the history ends before it",
                    )
                return True
        # A worker is lost when the watch declares it (worker_timeout without an answer) or when
        # the placement saw it die (Ray's word for an actor or its node: seconds, not a minute).
        losses = [source.latest_loss() for source in (self.watch, self.placed) if source is not None]
        lost_at = max((t for t in losses if t is not None), default=None)
        if lost_at is None:
            return False
        if submitted < lost_at:  # (it may be one of those on the lost worker)
            return now - lost_at >= LOST_CHUNK_GRACE and now - waiting_since >= FETCH_FLOOR
        waits = sorted(self._waits)
        usual = waits[len(waits) // 2] if waits else 0.0
        return now - waiting_since >= max(LOST_CHUNK_GRACE, LOST_CHUNK_USUAL_WAITS * usual)

    def _say_worker_changes(self) -> None:
        watch, run = self.watch, self.run
        for name, change in watch.changes():
            address = watch.workers[name]
            if change == "lost":
                text = (
                    f"{name} at {address} has not answered for {watch.timeout:g} s (worker_timeout): "
                    f"declared lost; the run goes on with {watch.live()} of {len(watch.workers)} workers"
                )
            else:
                text = f"{name} at {address} answers again: it rejoins the run"
            if run is not None:
                run.publish("message", text=text)
        if watch.live() == 0:
            silent = ", ".join(f"{name} at {address}" for name, address in watch.workers.items())
            raise WorkerError(
                f"every worker of the run stopped answering for worker_timeout={watch.timeout:g} s: "
                f"{silent}. Nothing trains without a worker. Fix: check that the worker hosts are up "
                "and reachable from this one, then run again (from the last checkpoint, if you saved one).",
                task=next(iter(watch.workers)),
            )

    def _lost_or_raise(self, error):
        """None (run the chunk again) when its fetch failed with a lost worker, else raises.
        Usually the coordinator re-runs a dead worker's chunks itself; a chunk caught
        mid-transfer (its result still on the worker when it died) fails like this instead."""
        self._check_servers()  # a dead server explains a fetch failure best
        t = tf()
        if not isinstance(error, (t.errors.UnavailableError, t.errors.CancelledError, t.errors.AbortedError)):
            # A chunk's result is a handle on the worker process that ran it: fetched from the new
            # process serving a replaced worker's address, it is unknown there (seen once in a
            # full suite). That worker answers: the chunk just runs again.
            if _stale_handle_on(str(error)):
                return None
            raise _translated_input_error(error) from None
        if self.repl.servers is not None:
            return None  # our own servers: the PS and a worker are alive (checked above)
        name = _worker_lost_with(str(error))
        if name:
            # Servers we do not watch (a Ray pool's actors, a real cluster's hosts): the error
            # names the worker and no parameter server. A lost PS is the launcher's to report,
            # or TensorFlow's next error names it.
            said = name in self.unreachable or (self.placed is not None and name in self.placed.gone())
            self.unreachable[name] = time.monotonic()
            if not said and self.run is not None:  # (once per worker: TensorFlow keeps retrying it)
                self.run.publish("message", text=f"{name} is unreachable: its steps run again on the other workers")
            return None
        raise _translated_input_error(error) from None

    def parallelism(self) -> int:
        return max(1, self._live_workers())

    def extra_columns(self) -> dict:
        return {"workers": self._live_workers()}

    def _live_workers(self) -> int:
        if self.placed is None or not self.placed.lost:
            return self.watch.live() if self.watch is not None else self.repl.live_workers()
        silent = set(self.watch.lost) if self.watch is not None else set()  # (a copy: the watch's thread)
        return self.repl.num_workers - len(silent | self.placed.gone())

    def _check_servers(self) -> None:
        if self.repl.servers is not None:  # our own children (placements/local/servers.py)
            for r in self.repl.servers.check(self.run):
                process = {"role": "worker", "index": r.index, "pid": r.child.pid}
                self._record_replacement(r.index, r.cause, r.seconds, r.lost_step, process)
            return
        if self.placed is not None and self.run is not None:  # a placement's (a Ray pool's actors)
            for heal in self.placed.read(self.run, self._live_workers):
                self._record_replacement(**heal)
            if self.placed.lost and self._live_workers() == 0 and not self.placed.coming():
                raise WorkerError(
                    f"every async-ps worker has died (all {self.repl.num_workers}) and none could be "
                    "replaced; training cannot go on. Fix: see the lines above for why each was not, "
                    "and run again, from the last checkpoint if you saved one.",
                    task="worker",
                )
        if self.watch is not None:
            self._say_worker_changes()

    def _record_replacement(self, index: int, cause: str, seconds: float, lost_at: int, process: dict) -> None:
        """A lost worker's replacement answers (its server listens at the lost one's address): the
        run is whole again. It is a heal in run.restarts, marked on the step axis as a restart is,
        but nothing was resumed or re-run (the other workers went on): `step` is the step it
        rejoined at, `seconds` from the loss to the new server answering."""
        run = self.run
        if run is None:
            return
        self.replaced_at[f"worker {index}"] = time.monotonic()
        record = {
            "member": f"worker {index}",
            "cause": cause,
            "step": run.steps,
            "seconds": round(seconds, 2),
            "lost_at": lost_at,
            "replaced": True,
        }
        run.restarts.append(record)
        run.publish("restart", run_step=run.steps, snapshot=run.snapshot, process=process, **record)  # (no rows go)
        run.publish("message", text=heal_line(record, run.restarts))

    def _say_pool_not_whole(self) -> None:
        """A worker a fetch failed with that no replacement answered for since: the launcher
        retires the pool after the run (an event it reads, not a line: the loss was said). Only a
        launched coordinator has a launcher: a real cluster's run keeps no such event."""
        if not is_launched():
            return
        for name, at in self.unreachable.items():
            if self.run is not None and self.replaced_at.get(name, at) <= at:
                self.run.publish("pool", worker_unreachable=int(name.split()[-1]))

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
        if self.watch is not None:
            self.watch.stop()
        self._say_pool_not_whole()
        if self.breakdown is not None and self.healthy():
            self.breakdown.close()
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


_STALE_HANDLE = "Unable to find the relevant tensor remote_handle"  # (TensorFlow's eager service)


def _stale_handle_on(text: str) -> str | None:
    """ "worker N" when a fetch asked that worker for a result it does not hold: the process at
    its address is a replacement, not the one that ran the chunk."""
    return _worker_lost_with(text) if _STALE_HANDLE in text else None


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
