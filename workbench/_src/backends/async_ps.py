"""MultiWorkerAsyncReplicator: asynchronous workers with parameter servers.

TensorFlow's ParameterServerStrategy + ClusterCoordinator, single-client: this process (the
notebook kernel or the script) is the coordinator. It traces step_fn, schedules chunks of steps
on whichever worker is free, and the workers read and update variables that live on the
parameter servers, each at its own pace. With cluster=None the workbench starts the workers and
parameter servers as local TensorFlow servers on 127.0.0.1; with a cluster it uses those.

Because the coordinator traces everything here, models and optimizers built in `repl.context()`
in the notebook are real parameter-server variables and the same step_fn/input_fn as on every
other backend train unchanged; nothing is pickled.

What asynchronous training changes, and how the workbench deals with it:
  - no replica steps with another, so the cross-replica primitives (all_sum, broadcast, ...)
    raise an error naming the backends where they work; wrap_optimizer applies each worker's
    own gradient (there is no mean to take);
  - execution is at-least-once: a chunk lost with a dead worker is run again elsewhere. The
    history has exactly `steps` rows (one per scheduled step that returned); a counter of our
    own, a plain variable on a parameter server, counts the steps really executed (Keras's
    optimizer.iterations undercounts here, its increment is not atomic across workers);
  - a dead worker is survivable (the run goes on, the event is in run.events and the history's
    `workers` column); a dead parameter server is not: the run stops within seconds with an
    error that points at the last checkpoint.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gc
import json
import os
import time
import warnings
import weakref

import numpy as np

from workbench._src.errors import ConfigurationError, InputError, WorkerError
from workbench._src.program import Program, call_compiled
from workbench._src.replicator import Replicator
from workbench._src.tf_setup import tf

SERVER_MODULE = "workbench._src.launch.server_main"
CHUNK_SECONDS = 0.2
_connected = None  # weakref to the replicator whose cluster this process uses (one at a time)


_warned_about_rename = False


def _warn_about_rename() -> None:
    global _warned_about_rename
    _warned_about_rename = True
    warnings.warn(
        "This process is now the coordinator of an async-ps cluster. Connecting renames its "
        "TensorFlow job from 'localhost' to 'chief', so variables created in this process before "
        "(a model trained on another backend, say) can no longer be read. Evaluate or save them "
        "before the first async-ps run, or build them again afterwards.",
        UserWarning,
        stacklevel=4,
    )


class MultiWorkerAsyncReplicator(Replicator):
    """Asynchronous data parallelism: workers step independently on parameter-server variables.

    Args:
      num_workers: worker servers (cluster=None: started here on 127.0.0.1).
      num_ps: parameter servers; variables are spread over them.
      cluster: a real cluster instead: "TF_CONFIG", "slurm", a TF_CONFIG-style dict, or a
        tf.distribute cluster resolver whose spec has "worker" and "ps" jobs. This process
        is the coordinator ("chief").
      startup_timeout: seconds for the local servers to come up.
      threads_per_server: TensorFlow threads in each local server (None: TensorFlow's choice).
    """

    backend = "async-ps"
    synchronous = False

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        cluster=None,
        *,
        startup_timeout: float = 60.0,
        threads_per_server: int | None = None,
        **input_options,
    ):
        super().__init__(**input_options)
        for name, value in (("num_workers", num_workers), ("num_ps", num_ps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{name} must be a positive integer; received {name}={value!r}.")
        self._num_workers, self.num_ps = num_workers, num_ps
        self._cluster_option = cluster
        self.startup_timeout = startup_timeout
        self.threads_per_server = threads_per_server
        self.coordinator = None
        self.group = None  # the local servers' ProcessGroup
        self.cluster_spec: dict | None = None

    @classmethod
    def from_replicas(cls, num_replicas=None, num_workers=None, num_ps=None, **kwargs):
        workers = num_workers or num_replicas or 2
        if num_replicas is not None and num_replicas != workers:
            raise ConfigurationError(
                f"async-ps runs one replica per worker; received replicas={num_replicas} and "
                f"workers={num_workers}. Fix: give --workers {num_replicas} alone."
            )
        return cls(num_workers=workers, num_ps=num_ps or 1, **kwargs)

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def num_replicas(self) -> int:
        return self._num_workers  # one independent replica per worker

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "num_replicas": self._num_workers,
            "num_workers": self._num_workers,
            "num_ps": self.num_ps,
            "synchronous": False,
        }

    # ----- the cluster -------------------------------------------------------------------
    def _make_strategy(self):
        global _connected
        t = tf()
        previous = _connected() if _connected is not None else None
        if previous is not None and previous is not self:
            # One process talks to one cluster: connecting rewires TensorFlow's context.
            previous.shutdown(reason="another async-ps replicator connected")
        resolver = self._resolver()
        if not _warned_about_rename:
            _warn_about_rename()
        strategy = t.distribute.ParameterServerStrategy(resolver)
        self.coordinator = t.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            # Our own exact step counter (see the module docstring): a raw variable on a PS.
            self.executed_steps = t.Variable(0, dtype=t.int64, trainable=False, name="workbench_steps")
        _connected = weakref.ref(self)
        return strategy

    def _resolver(self):
        t = tf()
        if self._cluster_option is not None:
            from workbench._src.cluster_resolver import cluster_resolver

            resolver = cluster_resolver(self._cluster_option)
            spec = resolver.cluster_spec().as_dict()
            self._num_workers = len(spec.get("worker", []))
            self.num_ps = len(spec.get("ps", []))
            return resolver
        from workbench._src.launch.processes import ProcessGroup, free_ports, port_open

        ports = free_ports(self._num_workers + self.num_ps + 1)
        cluster = {
            "worker": [f"127.0.0.1:{p}" for p in ports[: self._num_workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[self._num_workers : -1]],
            "chief": [f"127.0.0.1:{ports[-1]}"],  # this process, the coordinator
        }
        self.cluster_spec = cluster
        group = ProcessGroup(self.backend, stop_at_exit=False)  # they exit when this process ends
        self.group = group
        env = {"WORKBENCH_CLUSTER": json.dumps(cluster), "CUDA_VISIBLE_DEVICES": ""}
        if self.threads_per_server:
            env["WORKBENCH_WORKER_THREADS"] = str(self.threads_per_server)
        started = time.monotonic()
        try:
            for role in ("ps", "worker"):
                for i in range(len(cluster[role])):
                    group.start(role, i, SERVER_MODULE, env)
            pending = {
                (c.role, c.index): int(cluster[c.role][c.index].rsplit(":", 1)[1]) for c in group.children
            }
            while pending:
                dead = group.unexpected_exits()
                if dead:
                    c = dead[0]
                    raise WorkerError(
                        f"async-ps {c.label} {c.exit_description()} while starting.\n{c.log_tail()}",
                        task=f"{c.role} {c.index}",
                    )
                if time.monotonic() - started > self.startup_timeout:
                    names = ", ".join(f"{r} {i}" for r, i in pending)
                    raise WorkerError(
                        f"async-ps servers {names} did not start within startup_timeout="
                        f"{self.startup_timeout:.0f} s. Fix: a busy machine needs a longer startup_timeout.",
                        task=names,
                    )
                pending = {k: p for k, p in pending.items() if not port_open(p)}
                time.sleep(0.1)
        except BaseException:
            group.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return t.distribute.cluster_resolver.SimpleClusterResolver(
            t.train.ClusterSpec(cluster), rpc_layer="grpc", task_type="chief", task_id=0
        )

    def shutdown(self, reason: str = "shutdown() called") -> None:
        """Stops the local servers; the next use starts a fresh cluster (variables are lost)."""
        global _connected
        # Drop what refers to the remote functions and variables while the servers still
        # answer, so TensorFlow's clean-up does not flood the log with connection errors.
        # (Not coordinator._cluster.stop(): it waits forever for a dead worker's handler.)
        self._programs.clear()
        self._created_variables.clear()
        self._strategy, self.coordinator = None, None
        gc.collect()
        if self.group is not None:
            self.group.stop(grace=1.0)
            self.group = None
        self._shutdown_reason = reason
        if _connected is not None and _connected() is self:
            _connected = None

    def _check_servers(self, run=None) -> None:
        """Raises for a dead parameter server; reports dead workers once (the run goes on)."""
        if self.group is None:
            return
        for child in self.group.unexpected_exits():
            child.expected_exit = True  # reported once
            if child.role == "ps":
                raise WorkerError(
                    f"parameter server {child.index} (pid {child.pid}) {child.exit_description()}: the "
                    "variables it held are gone, so asynchronous training cannot go on.",
                    task=f"ps {child.index}",
                )
            if run is not None:
                alive = len([c for c in self.group.alive() if c.role == "worker"])
                run.publish(
                    "message",
                    text=f"worker {child.index} (pid {child.pid}) {child.exit_description()} at step "
                    f"{run.steps}; {alive} worker(s) left: the coordinator runs its unfinished steps on them",
                    worker_lost=child.index,
                )

    def live_workers(self) -> int:
        if self.group is None:
            return self._num_workers
        return len([c for c in self.group.children if c.role == "worker" and c.popen.poll() is None])

    # ----- what does not exist asynchronously ---------------------------------------------
    def _not_async(self, name: str):
        raise ConfigurationError(
            f"repl.{name} combines values across replicas that step together; under async-ps every "
            "worker steps on its own, so there is nothing to combine with. It works on the "
            "synchronous backends: single, mirrored, multi-worker, tpu. Fix: use one of those, or "
            "keep cross-replica code out of step_fn here."
        )

    def all_reduce(self, x, op="sum"):
        self._not_async("all_reduce")

    def all_sum(self, x):
        self._not_async("all_sum")

    def all_gather(self, x, axis=0):
        self._not_async("all_gather")

    def broadcast(self, x, source=0):
        self._not_async("broadcast")

    def map_reduce(self, fn, x, op="sum"):
        self._not_async("map_reduce")

    def map_gather(self, fn, x):
        self._not_async("map_gather")

    # ----- running -----------------------------------------------------------------------
    def _program(self, step_fn, input_fn):
        key = (step_fn, input_fn)
        if key not in self._programs:
            self._programs[key] = AsyncProgram(self, step_fn, input_fn)
        return self._programs[key]

    def run(self, step_fn, input_fn):
        """One step on one worker (whichever is free); returns [its outputs]."""
        return [self._program(step_fn, input_fn).run_one()]

    def train(self, step_fn, input_fn, steps: int, **options):
        """Trains asynchronously; returns the wb.Run. Options as `Replicator.train`."""
        return train_async(self, step_fn, input_fn, steps, **options)


class AsyncProgram(Program):
    """A (step_fn, input_fn) pair traced on the coordinator and scheduled on the workers."""

    def __init__(self, replicator, step_fn, input_fn):  # noqa: D107 - Program's, minus its input
        if not callable(step_fn):
            Program(replicator, step_fn, input_fn)  # raises its clear error
        self.replicator, self.step_fn, self.input_fn = replicator, step_fn, input_fn
        self.steps_done = 0
        self.metric_names = None
        t = tf()
        strategy = replicator.strategy
        coordinator = replicator.coordinator
        from workbench._src.inputs import InputContext, call_input_fn

        ctx = InputContext(None, replicator.num_workers, 0, replicator.num_workers, 1)

        def dataset_fn(_input_context):
            return call_input_fn(input_fn, ctx)

        def per_worker_dataset_fn():
            return strategy.distribute_datasets_from_function(dataset_fn)

        self.iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
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


def train_async(
    repl,
    step_fn,
    input_fn,
    steps: int,
    *,
    steps_per_execution="auto",
    reduce=None,
    checkpoint_dir=None,
    checkpoint=None,
    checkpoint_every=None,
    resume=True,
    on_nonfinite="stop",
    background=False,
    sinks=(),
    name=None,
):
    """The async run loop: keeps every worker busy with chunks, records results as they return."""
    from workbench._src.checkpoints import Saver
    from workbench._src.train_loop import _check_options, drive, new_run

    _check_options(steps, steps_per_execution, reduce, on_nonfinite, checkpoint_every, checkpoint_dir)
    program = repl._program(step_fn, input_fn)
    run = new_run(repl, step_fn, input_fn, steps, steps_per_execution, sinks, name)
    saver = Saver(repl, program, checkpoint_dir, checkpoint) if checkpoint_dir else None
    loop = _AsyncLoop(run, repl, program, steps, steps_per_execution, saver, checkpoint_every, on_nonfinite)
    return drive(run, loop.run_catching, background, on_nonfinite)


class _AsyncLoop:
    def __init__(self, run, repl, program, steps, steps_per_execution, saver, checkpoint_every, on_nonfinite):
        self.run, self.repl, self.program, self.steps = run, repl, program, steps
        self.fixed_k = None if steps_per_execution == "auto" else steps_per_execution
        self.saver, self.checkpoint_every, self.on_nonfinite = saver, checkpoint_every, on_nonfinite
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="workbench fetch")
        self.recent: collections.deque = collections.deque()  # (time, examples) of recent results

    def run_catching(self) -> None:
        from workbench._src.train_loop import begin

        run = self.run
        run.status = "running"
        run.started_at = time.time()
        server_lost = False
        executed_before = int(self.repl.executed_steps.numpy())
        try:
            begin(run, self.saver, self.program)
            status, reason = self._loop()
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised by the caller
            server_lost = isinstance(e, WorkerError)
            if server_lost:
                e.run = run
                where = (
                    f" The last checkpoint is in {self.saver.directory} (step {self.saver.step.numpy()}): "
                    "build the model under a new replicator and call repl.restore(that directory), "
                    "or go on training with repl.train(..., checkpoint_dir=that directory)."
                    if self.saver and self.saver.manager.latest_checkpoint
                    else " Pass checkpoint_dir= (and checkpoint_every=) to keep one next time."
                )
                e.args = (f"{e.args[0]} Training stopped at step {run.steps}.{where}",)
                self.repl.shutdown(reason=str(e))
            run.error = e
            status, reason = "failed", f"{type(e).__name__}: {e}"
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if not server_lost:
            with contextlib.suppress(Exception):
                run.executed_steps = int(self.repl.executed_steps.numpy()) - executed_before
                if run.executed_steps != run.steps:
                    run.publish(
                        "message",
                        text=f"workers executed {run.executed_steps} steps for the {run.steps} in the history: "
                        "parameter-server execution is at-least-once (steps lost with a worker run again)",
                    )
            if self.saver and status != "non-finite":
                path = self.saver.save()
                if path:
                    run.publish("checkpoint", path=path, final=True)
        run._finish(status, reason)

    def _loop(self):
        run, program, repl = self.run, self.program, self.repl
        target = program.steps_done + self.steps
        scheduled = program.steps_done
        in_flight: list = []  # (remote value, k)
        k = self.fixed_k or 1
        start = last = time.perf_counter()
        first = True
        status, reason = "finished", None
        max_in_flight = 2 * repl.num_workers
        while True:
            stopping = run.stop_requested or status != "finished" or reason is not None
            while not stopping and scheduled < target and len(in_flight) < max_in_flight:
                chunk = min(k, target - scheduled, self._steps_to_next_checkpoint(scheduled))
                in_flight.append((program.schedule(chunk), chunk))
                scheduled += chunk
                if first:
                    break  # the first chunk traces: wait for it before scheduling more
            if not in_flight:
                break
            remote, chunk = in_flight.pop(0)
            fetched = self._fetch(remote)
            if fetched is None:  # lost with a dead worker and not re-run by TensorFlow: run it again
                in_flight.append((program.schedule(chunk), chunk))
                run.publish(
                    "message", text=f"a chunk of {chunk} steps was lost with a worker; scheduled again"
                )
                continue
            rows, done = fetched
            now = time.perf_counter()
            if first:
                run.compile_seconds = now - start
            self._record(rows, program.steps_done + 1, last - start, now - start, timed=not first)
            program.steps_done += done
            last = now
            bad = self._first_nonfinite(rows, program.steps_done - done + 1)
            if bad and self.on_nonfinite != "ignore" and reason is None:
                status, reason = "non-finite", bad
            if done < chunk and reason is None:
                reason = f"input exhausted after step {program.steps_done}"
            if self.checkpoint_every and self.saver and program.steps_done % self.checkpoint_every == 0:
                path = self.saver.save()
                if path:
                    run.publish("checkpoint", path=path, final=False)
            if self.fixed_k is None and not first:
                per_worker_step = (now - start) / max(1, program.steps_done) * repl.live_workers()
                k = int(min(1000, k * 10, max(1, CHUNK_SECONDS / max(per_worker_step, 1e-9))))
            first = False
        if run.stop_requested and status == "finished" and program.steps_done < target:
            status = "interrupted" if getattr(run, "_interrupted", False) else "stopped"
            reason = f"stopped at step {program.steps_done}"
        return status, reason

    def _fetch(self, remote):
        future = self.executor.submit(remote.fetch)
        while True:
            self.repl._check_servers(self.run)
            try:
                rows, done = future.result(timeout=0.1)
                return np.asarray(rows)[: int(done)], int(done)
            except concurrent.futures.TimeoutError:
                continue
            except Exception as e:  # noqa: BLE001
                self.repl._check_servers(self.run)  # a dead PS explains a fetch failure best
                t = tf()
                lost = (t.errors.UnavailableError, t.errors.CancelledError, t.errors.AbortedError)
                if isinstance(e, lost) and self.repl.group is not None:
                    # Usually the coordinator re-runs a dead worker's chunks itself; a chunk caught
                    # mid-transfer can still fail like this. The PS is alive (checked above).
                    if self.repl.live_workers() == 0:
                        raise WorkerError("every async-ps worker has died; training cannot go on.") from None
                    return None
                raise _translated_input_error(e) from None

    def _steps_to_next_checkpoint(self, scheduled: int) -> int:
        if not self.checkpoint_every:
            return 1000
        return self.checkpoint_every - scheduled % self.checkpoint_every

    def _record(self, rows, first_step, t0, t1, timed):
        names = self.program.metric_names or []
        n = len(rows)
        if not n:
            return
        per_step = (t1 - t0) / n
        workers = self.repl.live_workers()
        # Results return in bursts (several workers finish together), so throughput is taken
        # over the last second of results rather than between two fetches.
        self.recent.append((t1, float(rows[:, -1].sum())))
        while len(self.recent) > 2 and t1 - self.recent[1][0] >= 1.0:
            self.recent.popleft()
        window = t1 - self.recent[0][0]
        examples = sum(e for _, e in list(self.recent)[1:])
        rate = examples / window if timed and window > 0 and len(self.recent) > 1 else float("nan")
        out = []
        for i in range(n):
            row = {
                "step": first_step + i,
                "wall_time": t0 + per_step * (i + 1),
                "examples_per_sec": rate,
                "workers": workers,
            }
            for j, metric in enumerate(names):
                row[metric] = float(rows[i, j])
            out.append(row)
        self.run.record_rows(out)

    def _first_nonfinite(self, rows, first_step):
        from workbench._src.train_loop import first_nonfinite

        names = self.program.metric_names
        return first_nonfinite(rows, first_step, names, self.on_nonfinite, self.saver is not None)


def _translated_input_error(error):
    t = tf()
    if isinstance(error, t.errors.OutOfRangeError):
        return InputError(
            "input_fn's dataset ran out on a worker. Fix: add `.repeat()` to the dataset for as many "
            "steps as you run."
        )
    return error


def server_environment_cluster() -> dict:
    return json.loads(os.environ["WORKBENCH_CLUSTER"])
