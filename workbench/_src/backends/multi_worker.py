"""MultiWorkerReplicator: synchronous all-reduce across worker processes (MultiWorkerMirroredStrategy).

TF2's multi-worker training is multi-client: every worker process runs the same program and the
collectives meet in the middle. So one class has two faces:

  in the cluster   (inside a worker the workbench started, or any process given `cluster=`):
                   a normal Replicator over MultiWorkerMirroredStrategy; context, primitives,
                   run and train work as on every backend.
  launcher         (a notebook kernel or script with cluster=None): starts `num_workers` local
                   worker processes on 127.0.0.1, sends each the work, streams the chief's
                   per-step metrics back into a wb.Run, and stops every process whatever happens.

How work reaches the workers (see docs/design-decisions.md): a `%%replicate` cell's source (run
inside each worker's repl.context()), or functions pickled by value with cloudpickle (so
functions defined in a notebook travel): `repl.train(setup=build)` where build(repl) makes the
model and returns (step_fn, input_fn), or self-contained step_fn/input_fn. TensorFlow state
(models, variables) never travels: each worker builds its own, and the chief's trained weights
come back at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import queue
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

from workbench._src.cluster_resolver import cluster_resolver
from workbench._src.errors import ConfigurationError, WorkerError
from workbench._src.replicator import Replicator
from workbench._src.tf_setup import tf

WORKER_MODULE = "workbench._src.launch.worker_main"
_launched_worker = False  # True in a worker process the workbench started
_worker_instance = None  # that worker's in-cluster replicator
IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


class MultiWorkerReplicator(Replicator):
    """Synchronous replicas in several worker processes, all-reducing over TensorFlow's gRPC runtime.

    Args:
      num_workers: worker processes (cluster=None: started here on 127.0.0.1).
      devices_per_worker: replicas per worker: its GPUs (split evenly by default), else 1 CPU.
      cluster: join a real cluster instead: "TF_CONFIG" (the environment variable), "slurm",
        a TF_CONFIG dict {"cluster": ..., "task": ...}, or a tf.distribute cluster resolver.
        Every process of that cluster runs the same program (e.g. `workbench run FILE.py`).
      startup_timeout: seconds for every worker to start and connect; then a clear error
        (TensorFlow alone waits forever for a peer that never comes).
      heartbeat_timeout: a local worker silent this long is declared frozen and the run stopped.
      threads_per_worker: TensorFlow intra/inter-op threads in each local worker (None: TF's).
    """

    backend = "multi-worker"

    def __init__(
        self,
        num_workers: int = 2,
        devices_per_worker: int | None = None,
        cluster=None,
        *,
        startup_timeout: float = 120.0,
        heartbeat_timeout: float = 10.0,
        threads_per_worker: int | None = None,
        **input_options,
    ):
        super().__init__(**input_options)
        for name, value in (("num_workers", num_workers), ("devices_per_worker", devices_per_worker)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigurationError(f"{name} must be a positive integer; received {name}={value!r}.")
        self._resolver = cluster_resolver(cluster) if cluster is not None else None
        self._in_cluster = cluster is not None or _launched_worker
        self._num_workers = num_workers
        self.devices_per_worker = devices_per_worker or 1
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.threads_per_worker = threads_per_worker
        self._agree_fn = None

    @classmethod
    def from_replicas(cls, num_replicas=None, num_workers=None, devices_per_worker=None, **kwargs):
        per_worker = devices_per_worker or 1
        if num_workers is None:
            num_workers = (num_replicas // per_worker) if num_replicas else 2
        if num_replicas is not None and num_replicas != num_workers * per_worker:
            raise ConfigurationError(
                f"multi-worker runs num_workers x devices_per_worker replicas; received "
                f"replicas={num_replicas}, workers={num_workers}, devices per worker={per_worker}. "
                f"Fix: give --workers {num_replicas // per_worker or 1} alone, or matching numbers."
            )
        return cls(num_workers=num_workers, devices_per_worker=devices_per_worker, **kwargs)

    # ----- what both faces share ---------------------------------------------------------
    @property
    def runs_in_processes(self) -> bool:
        """True for the launcher: steps run in worker processes, not in this one."""
        return not self._in_cluster

    @property
    def in_cluster(self) -> bool:
        """True inside a worker (or a process given `cluster=`): the strategy runs here."""
        return self._in_cluster

    @property
    def num_workers(self) -> int:
        if self._in_cluster:
            spec = self._resolver_or_default().cluster_spec().as_dict()
            return len(spec.get("worker", [])) + len(spec.get("chief", []))
        return self._num_workers

    @property
    def worker_id(self) -> int:
        if not self._in_cluster:
            return 0
        resolver = self._resolver_or_default()
        if resolver.task_type == "chief":
            return 0
        has_chief = "chief" in resolver.cluster_spec().as_dict()
        return int(resolver.task_id) + (1 if has_chief else 0)

    @property
    def num_replicas(self) -> int:
        if self._in_cluster:
            return self.strategy.num_replicas_in_sync
        return self._num_workers * self.devices_per_worker

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "num_replicas": self.num_replicas,
            "num_workers": self.num_workers,
            "devices_per_worker": self.devices_per_worker,
            "synchronous": True,
        }

    # ----- in the cluster ----------------------------------------------------------------
    def _resolver_or_default(self):
        if self._resolver is None:
            self._resolver = tf().distribute.cluster_resolver.TFConfigClusterResolver()
        return self._resolver

    @property
    def strategy(self):
        if not self._in_cluster:
            raise ConfigurationError(
                "This multi-worker replicator launches its workers as separate processes, so this "
                "process has no strategy to run steps on; step_fn and the primitives run inside "
                "the workers. Fix: train with a %%replicate cell, repl.train(setup=build, steps=N) "
                "or repl.train(step_fn, input_fn, steps=N) (functions travel to the workers), or "
                "run code on every worker with repl.run_on_workers(fn)."
            )
        if self._strategy is None:
            self._strategy = self._make_strategy()
        return self._strategy

    def _make_strategy(self):
        t = tf()
        options = t.distribute.experimental.CommunicationOptions(
            implementation=t.distribute.experimental.CommunicationImplementation.RING
        )
        resolver = self._resolver_or_default()
        # TensorFlow's join waits forever for a peer that never starts, holding the interpreter
        # (no Python thread or signal handler runs meanwhile), so the deadline is kept by a
        # small watchdog process. Local launches have the launcher's own deadline instead.
        watchdog = None if _launched_worker else _start_join_watchdog(resolver, self.startup_timeout)
        try:
            return t.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver, communication_options=options
            )
        finally:
            if watchdog is not None:
                watchdog.stdin.close()  # joined (or failed): the watchdog exits
                watchdog.wait()

    @staticmethod
    def _unreachable_peers(resolver) -> list[str]:
        from workbench._src.launch.processes import port_open

        missing = []
        for job, addresses in resolver.cluster_spec().as_dict().items():
            items = addresses.items() if isinstance(addresses, dict) else enumerate(addresses)
            for index, address in items:
                if job == resolver.task_type and int(index) == int(resolver.task_id):
                    continue
                host, port = address.rsplit(":", 1)
                if not port_open(int(port), host):
                    missing.append(f"{job} {index} at {address}")
        return missing

    def _agree_on_chunk(self, steps: int, stop: bool) -> tuple[int, bool]:
        if not self._in_cluster or self.num_workers == 1:
            return steps, stop
        t = tf()
        strategy = self.strategy
        if self._agree_fn is None:

            def replica_fn(values):
                # identity places the value on this replica's device (a bare argument has none,
                # and the collective then has no destination).
                return t.distribute.get_replica_context().all_reduce("sum", t.identity(values))

            self._agree_fn = t.function(lambda values: strategy.run(replica_fn, args=(values,)))
        # The chief proposes the chunk length; any worker may ask to stop.
        mine = t.constant([1.0 if stop else 0.0, float(steps) if self.worker_id == 0 else 0.0])
        total = strategy.experimental_local_results(self._agree_fn(mine))[0].numpy()
        per_worker = strategy.num_replicas_in_sync / self.num_workers  # each local replica adds once
        return int(round(total[1] / per_worker)), bool(total[0] > 0)

    def _checkpoint_write_directory(self, directory: str) -> str:
        if self._in_cluster and self.worker_id != 0:
            return tempfile.mkdtemp(prefix=f"workbench-ckpt-worker{self.worker_id}-")
        return directory

    # ----- the launcher ------------------------------------------------------------------
    @contextlib.contextmanager
    def context(self):
        """In the cluster: the strategy's scope. In the launcher: a plain local build (recorded).

        The launcher builds the cell's model here too, so the notebook has `model` to inspect,
        and the chief's trained weights are loaded into it when training ends.
        """
        if self._in_cluster:
            with super().context():
                yield self
            return
        with self._recording_variables():
            yield self

    def run(self, step_fn: Callable, input_fn: Callable):
        """One step on every replica. From the launcher: in fresh workers; per-replica outputs."""
        if self._in_cluster:
            return super().run(step_fn, input_fn)
        per_worker = self.run_on_workers(_OneStep(step_fn, input_fn))
        return [out for worker in per_worker for out in worker]

    def run_on_workers(self, fn: Callable, *, timeout: float | None = None) -> list:
        """Runs fn(repl) in every worker (inside the cluster); returns their results in worker order.

        fn and what it refers to are pickled by value (cloudpickle); results come back pickled.
        """
        if self._in_cluster:
            return [fn(self)]
        results = self._launch(_CallWork(fn), run=None, timeout=timeout)
        return [results[f"worker:{i}"] for i in range(self._num_workers)]

    def train(
        self, step_fn=None, input_fn=None, steps: int | None = None, *, setup=None, warmup: int = 0, **options
    ):
        """Trains on the workers; returns the wb.Run (history streamed from the chief).

        Args:
          step_fn, input_fn: as on every backend; pickled by value to the workers, so they must
            not hold TensorFlow state built here: use `setup` for that.
          setup: setup(repl) runs on each worker inside repl.context(), builds the model and
            optimizer and returns (step_fn, input_fn) (or a dict with those keys).
          warmup: steps each worker runs first, in the same processes, that the run does not
            record: they absorb tracing, so every recorded step is timed. A launched run's
            `compile_seconds` is the warm-up's (inside a cluster the run's own is 0, as for any
            run of an already traced program). Scaling studies use it.
          Other options: as `Replicator.train` (steps_per_execution, reduce, checkpoint_dir,
          background, sinks, name, ...).
        """
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ConfigurationError(f"warmup must be an integer >= 0 (steps); received warmup={warmup!r}.")
        if self._in_cluster:
            if setup is not None:
                with self.context():
                    step_fn, input_fn = _unpack_setup(setup(self))
            if warmup:
                _warm_up(self, step_fn, input_fn, warmup, options)
            return super().train(step_fn, input_fn, steps, **options)
        if setup is None and (step_fn is None or input_fn is None):
            raise ConfigurationError(
                "train needs step_fn and input_fn, or setup=build where build(repl) returns them; "
                f"received step_fn={step_fn!r}, input_fn={input_fn!r}, setup=None."
            )
        work = _TrainWork(step_fn=step_fn, input_fn=input_fn, setup=setup)
        work.warmup = warmup
        return self._train_launched(work, steps, options, local_variables=None)

    def train_cell(self, source: str, namespace: dict, steps: int, **options):
        """The `%%replicate` cell on this backend: run it here (to define names), then on every worker.

        The cell runs in this process inside repl.context() first, so mistakes show at once and
        the notebook gets its `model`; then every worker runs the same source in its own
        context, with the notebook's picklable names (functions, classes, modules, arrays).
        When training ends the chief's weights are loaded into the variables the cell made here.
        """
        if self._in_cluster:
            namespace.setdefault("repl", self)
            with self.context():
                exec(compile(source, "<%%replicate cell>", "exec"), namespace)
            return super().train(namespace["step_fn"], namespace["input_fn"], steps, **options)
        setup, local_variables = self.setup_from_cell(source, namespace)
        return self._train_launched(_TrainWork(setup=setup), steps, options, local_variables=local_variables)

    def setup_from_cell(self, source: str, namespace: dict):
        """Runs a cell's source here, in this launcher's local context, so its mistakes show at
        once and the notebook gets its names (and `model`); returns (a CellSetup that rebuilds
        the cell in each worker, with the notebook's picklable names, the variables it made here).
        """
        namespace.setdefault("repl", self)
        first = len(self._created_variables)
        with self.context():
            exec(compile(source, "<%%replicate cell>", "exec"), namespace)
        shipped, _skipped = picklable_namespace(namespace)
        return CellSetup(source, shipped), self._created_variables[first:]

    def __reduce__(self):
        # Pickled into a worker (inside a function that mentions `repl`), the launcher's
        # replicator becomes that worker's in-cluster replicator.
        return (worker_replicator, ())

    # ----- launching -----------------------------------------------------------------------
    def _train_launched(self, work, steps, options, local_variables):
        from workbench._src.train_loop import _check_options, drive, new_run

        background = options.pop("background", False)
        sinks = options.pop("sinks", ())
        name = options.pop("name", None)
        _check_options(
            steps,
            options.get("steps_per_execution", "auto"),
            options.get("reduce"),
            options.get("on_nonfinite", "stop"),
            options.get("checkpoint_every"),
            options.get("checkpoint_dir"),
        )
        if options.get("checkpoint_dir"):
            options["checkpoint_dir"] = os.path.abspath(os.fspath(options["checkpoint_dir"]))
        work.steps, work.options = steps, options
        spe = options.get("steps_per_execution", "auto")
        run = new_run(self, work.step_fn, work.input_fn, steps, spe, sinks, name)

        def go():
            run.status = "running"
            run.started_at = time.time()
            try:
                results = self._launch(work, run)
                chief = results["worker:0"]
                status, reason = chief["status"], chief["reason"]
                run.compile_seconds = chief.get("compile_seconds")
                if status == "stopped" and getattr(run, "_interrupted", False):
                    status = "interrupted"
                if local_variables and chief.get("weights"):
                    _load_weights(local_variables, chief["weights"], run)
            except BaseException as e:  # noqa: BLE001 - recorded, then re-raised for the caller
                run.error = e
                if isinstance(e, WorkerError):
                    e.run = run
                status, reason = "failed", f"{type(e).__name__}: {e}"
            run._finish(status, reason)

        return drive(run, go, background)

    def _launch(self, work, run=None, timeout: float | None = None) -> dict:
        """Starts the workers, hands them `work`, follows them to the end; returns task -> result."""
        import cloudpickle  # noqa: F401 - fail early if missing

        from workbench._src.launch.channel import Channel
        from workbench._src.launch.processes import ProcessGroup, free_ports

        payload = dumps_for_workers(work)
        group = ProcessGroup(self.backend)
        channel = Channel(group)
        watch = _Watch(self, group, channel, run, payload, timeout)
        try:
            ports = free_ports(self._num_workers)
            cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
            for i in range(self._num_workers):
                env = {
                    **channel.env(),
                    "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
                    **self._worker_device_env(i),
                }
                group.start("worker", i, WORKER_MODULE, env)
            return watch.follow()
        finally:
            group.stop(grace=1.0)  # MWMS ignores SIGTERM: the SIGKILL after the grace does it
            channel.close()

    def _worker_device_env(self, index: int) -> dict:
        env = {"WORKBENCH_WORKER_DEVICES": str(self.devices_per_worker)}
        if self.threads_per_worker:
            env["WORKBENCH_WORKER_THREADS"] = str(self.threads_per_worker)
        gpus = tf().config.list_physical_devices("GPU")
        if gpus:
            if len(gpus) < self._num_workers * self.devices_per_worker:
                raise ConfigurationError(
                    f"{self._num_workers} workers x {self.devices_per_worker} GPU(s) need "
                    f"{self._num_workers * self.devices_per_worker} GPUs; this machine has {len(gpus)}."
                )
            first = index * self.devices_per_worker
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + j) for j in range(self.devices_per_worker))
        else:
            if self.devices_per_worker != 1:
                raise ConfigurationError(
                    f"devices_per_worker={self.devices_per_worker} needs GPUs; without them each "
                    "worker runs one CPU replica. Fix: devices_per_worker=1 and more workers."
                )
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env


class _Watch:
    """Follows one launch: hands out work, relays events, notices deaths, freezes and stalls."""

    def __init__(self, repl, group, channel, run, payload, timeout):
        self.repl, self.group, self.channel, self.run = repl, group, channel, run
        self.payload, self.timeout = payload, timeout
        self.tasks = [f"worker:{i}" for i in range(repl._num_workers)]
        self.heard: dict[str, float] = {}
        self.ready: set[str] = set()
        self.results: dict = {}
        self.stop_sent = False
        self.started = time.monotonic()

    def follow(self) -> dict:
        while len(self.results) < len(self.tasks):
            try:
                task, message = self.channel.messages.get(timeout=0.1)
            except queue.Empty:
                task, message = None, None
            if message is not None:
                self._handle(task, message)
            self._check()
        return self.results

    def _handle(self, task: str, message: dict) -> None:
        kind = message.get("type")
        self.heard[task] = time.monotonic()
        if kind == "hello":
            self.channel.send(task, {"type": "work", "payload": self.payload})
        elif kind == "ready":
            self.ready.add(task)
            if len(self.ready) == len(self.tasks) and self.run is not None:
                seconds = time.monotonic() - self.started
                self.run.startup_seconds = seconds
                self.run.publish("message", text=f"{len(self.tasks)} workers connected in {seconds:.1f} s")
        elif kind == "event":
            self._relay(task, message)
        elif kind == "result":
            self.results[task] = message["value"]
        elif kind == "done":
            self._child(task).expected_exit = True
        elif kind == "error":
            self._fail_after_error(task, message)
        elif kind == "disconnected" and task not in self.results:
            time.sleep(0.3)  # let the exit status arrive so the error can say how it ended
            self._check()

    def _relay(self, task: str, message: dict) -> None:
        run, event_kind, data = self.run, message["kind"], message["data"]
        if run is None:
            return
        if task != "worker:0":  # every worker computes the same reduced metrics: the chief's suffice
            if event_kind == "message":
                run.publish("message", text=f"{_label(task)}: {data.get('text')}")
            return
        if event_kind == "metrics":
            run.record_rows(data["rows"])
        elif event_kind == "started":
            run.publish("started", name=run.name, config=run.config, first_step=data.get("first_step", 1))
        elif event_kind in ("checkpoint", "message"):
            run.publish(event_kind, **data)

    def _check(self) -> None:
        now = time.monotonic()
        dead = self.group.unexpected_exits()
        if dead:
            # A witness that reported the collective failure and exited is not the culprit:
            # collect pending reports first, then prefer a process killed by a signal.
            errors = self._drain_errors(0.5)
            dead = self.group.unexpected_exits()
            if not dead:
                if errors:
                    self._report_errors(errors)
                return
            child = next((c for c in dead if c.popen.returncode < 0), dead[0])
            self._raise(
                f"{_label(f'{child.role}:{child.index}')} (pid {child.pid}) {child.exit_description()}"
                f"{self._at_step()}; every worker of the run was stopped.",
                f"{child.role}:{child.index}",
            )
        for task in self.tasks:
            last = self.heard.get(task)
            if last is not None and task not in self.results and now - last > self.repl.heartbeat_timeout:
                self._raise(
                    f"{_label(task)} (pid {self._child(task).pid}) stopped responding: no heartbeat for "
                    f"{now - last:.0f} s (frozen, stopped or starved){self._at_step()}; every worker "
                    "of the run was stopped.",
                    task,
                )
        if len(self.ready) < len(self.tasks) and now - self.started > self.repl.startup_timeout:
            missing = [t for t in self.tasks if t not in self.ready]
            names = ", ".join(_label(t) for t in missing)
            self._raise(
                f"{names} did not start within startup_timeout={self.repl.startup_timeout:.0f} s "
                f"({len(self.ready)} of {len(self.tasks)} ready). Fix: a busy machine needs a longer "
                "startup_timeout; otherwise see the worker log below.",
                missing[0],
            )
        if self.timeout is not None and now - self.started > self.timeout:
            self._raise(f"the workers did not finish within timeout={self.timeout} s.", None)
        if self.run is not None and self.run.stop_requested and not self.stop_sent:
            self.channel.broadcast({"type": "stop"})
            self.stop_sent = True

    def _fail_after_error(self, task: str, message: dict) -> None:
        # A worker whose peer died or froze reports the collective failure first; give the
        # process table, heartbeats and the other workers' reports a moment, then name the
        # culprit rather than the witness.
        self._child(task).expected_exit = True  # it exits after reporting
        errors = {task: message, **self._drain_errors(0.7)}
        self._check()  # a worker that died without reporting is the culprit
        now = time.monotonic()
        for other in self.tasks:
            silent = now - self.heard.get(other, now)
            if other not in errors and other not in self.results and silent > 2.0:
                self._raise(
                    f"{_label(other)} (pid {self._child(other).pid}) stopped responding (no heartbeat "
                    f"for {silent:.0f} s){self._at_step()}; {_label(task)} then failed: "
                    f"{message['summary']}",
                    other,
                )
        self._report_errors(errors)

    def _drain_errors(self, seconds: float) -> dict:
        """Reads the channel for `seconds`; returns the error reports (task -> message)."""
        errors = {}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                task, message = self.channel.messages.get(timeout=0.05)
            except queue.Empty:
                continue
            self.heard[task] = time.monotonic()
            if message.get("type") == "error":
                errors[task] = message
                self._child(task).expected_exit = True
            elif message.get("type") == "result":
                self.results[task] = message["value"]
        return errors

    def _report_errors(self, errors: dict) -> None:
        first = min(errors)  # the same mistake on every worker: report the chief's copy
        self._raise(
            f"{_label(first)} failed{self._at_step()}: {errors[first]['summary']}\n--- its traceback ---\n"
            f"{_trim_traceback(errors[first].get('traceback', ''))}",
            None,
        )

    def _at_step(self) -> str:
        return f" at step {self.run.steps}" if self.run is not None and self.run.steps else ""

    def _child(self, task: str):
        role, index = task.split(":")
        return next(c for c in self.group.children if c.role == role and c.index == int(index))

    def _raise(self, text: str, task: str | None) -> None:
        log = ""
        if task is not None:
            tail = self._child(task).log_tail()
            if tail:
                log = f"\n--- last lines of {_label(task)}'s log ---\n{tail}"
        raise WorkerError(f"Multi-worker run failed: {text}{log}", task=_label(task) if task else None)


def _start_join_watchdog(resolver, timeout: float):
    import subprocess
    import sys

    addresses = {
        f"{job} {index}": address
        for job, tasks in resolver.cluster_spec().as_dict().items()
        for index, address in (tasks.items() if isinstance(tasks, dict) else enumerate(tasks))
        if not (job == resolver.task_type and int(index) == int(resolver.task_id))
    }
    me = f"{resolver.task_type} {resolver.task_id}"
    return subprocess.Popen(
        [sys.executable, "-m", "workbench._src.launch.join_watchdog", str(os.getpid()), str(timeout), me,
         json.dumps(addresses)],
        stdin=subprocess.PIPE,
    )  # fmt: skip


def _label(task: str) -> str:
    return task.replace(":", " ")


def _trim_traceback(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _load_weights(local_variables, weights, run) -> None:
    loaded = 0
    for variable, (_name, value) in zip(local_variables, weights):
        if tuple(variable.shape) == tuple(value.shape):
            variable.assign(value)
            loaded += 1
    if loaded != len(local_variables):
        run.publish(
            "message",
            text=f"loaded {loaded} of {len(local_variables)} trained variables into this notebook "
            "(the cell built different variables here than on the chief)",
        )
    else:
        run.publish("message", text=f"loaded the chief's trained weights into {loaded} variables here")


def _unpack_setup(built):
    if isinstance(built, dict) and "step_fn" in built and "input_fn" in built:
        return built["step_fn"], built["input_fn"]
    if isinstance(built, (tuple, list)) and len(built) == 2:
        return tuple(built)
    raise ConfigurationError(
        "setup(repl) must return (step_fn, input_fn) or {'step_fn': ..., 'input_fn': ...}; "
        f"received {type(built).__name__}: {built!r:.80}."
    )


# ----- what travels to the workers ---------------------------------------------------------------
class _TrainWork:
    """Train on a worker: from a setup function (a cell's is a CellSetup) or self-contained functions."""

    def __init__(self, step_fn=None, input_fn=None, setup=None):
        self.step_fn, self.input_fn, self.setup = step_fn, input_fn, setup
        self.steps, self.options, self.warmup = None, {}, 0

    def __call__(self, repl, link):
        from workbench._src import session

        session._set(repl, None)  # wb.current() in the cell or script is this worker's replicator
        if self.setup is not None:
            with repl.context():
                step_fn, input_fn = _unpack_setup(self.setup(repl))
        else:
            step_fn, input_fn = self.step_fn, self.input_fn
        chief = repl.worker_id == 0

        def forward(event):
            if chief or event.kind == "message":
                link.send({"type": "event", "kind": event.kind, "step": event.step, "data": event.data})

        warm = _warm_up(repl, step_fn, input_fn, self.warmup, self.options) if self.warmup else None
        run = repl.train(step_fn, input_fn, self.steps, background=True, sinks=[forward], **self.options)

        def listen():  # the launcher's stop requests (run.stop(), the Stop button, an interrupt)
            with contextlib.suppress(EOFError, OSError):
                while True:
                    if link.recv().get("type") == "stop":
                        run.stop()

        threading.Thread(target=listen, name="workbench stop listener", daemon=True).start()
        run.wait()
        weights = None
        if chief:
            weights = [(v.name, v.numpy()) for v in repl._created_variables]
        compile_seconds = (warm or run).compile_seconds
        return {
            "status": run.status,
            "reason": run.stop_reason,
            "steps": run.steps,
            "weights": weights,
            "compile_seconds": compile_seconds,
        }


def _warm_up(repl, step_fn, input_fn, steps: int, options: dict):
    """Untimed, unrecorded steps before a run (tracing happens here); returns that run."""
    same = {k: options[k] for k in ("steps_per_execution", "reduce") if k in options}
    return repl.train(step_fn, input_fn, steps, name="warm-up", **same)


class CellSetup:
    """A `%%replicate` cell as a setup function: setup(repl) runs the cell's source with the
    notebook's picklable names and `repl` bound to the caller's replicator, and returns the
    step_fn and input_fn it defines. It pickles (the source travels, not code objects), so
    worker processes can build the cell's model themselves."""

    def __init__(self, source: str, namespace: dict | None, filename: str = "<%%replicate cell>"):
        self.source, self.namespace, self.filename = source, namespace, filename

    def __call__(self, repl):
        namespace = {**(self.namespace or {}), "repl": repl}
        namespace.setdefault("__name__", "__main__")
        exec(compile(self.source, self.filename, "exec"), namespace)
        step_fn, input_fn = namespace.get("step_fn"), namespace.get("input_fn")
        if not callable(step_fn) or not callable(input_fn):
            raise ConfigurationError(
                f"{self.filename} must define step_fn(batch) and input_fn(ctx); it defines "
                f"{', '.join(n for n in ('step_fn', 'input_fn') if callable(namespace.get(n))) or 'neither'}."
            )
        return step_fn, input_fn


class _CallWork:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, repl, link):
        return self.fn(repl)


class _OneStep:
    def __init__(self, step_fn, input_fn):
        self.step_fn, self.input_fn = step_fn, input_fn

    def __call__(self, repl):
        outputs = repl.run(self.step_fn, self.input_fn)
        return tf().nest.map_structure(lambda v: v.numpy(), outputs)


def worker_replicator():
    """This worker process's in-cluster replicator (what a pickled launcher replicator becomes)."""
    global _worker_instance
    if _worker_instance is None:
        if not _launched_worker:
            raise ConfigurationError(
                "A multi-worker replicator was unpickled outside a workbench worker process."
            )
        _worker_instance = MultiWorkerReplicator(num_workers=1)  # counts come from TF_CONFIG
    return _worker_instance


def mark_launched_worker() -> None:
    global _launched_worker
    _launched_worker = True


# ----- pickling --------------------------------------------------------------------------------
def _is_tensorflow_state(obj) -> bool:
    module = type(obj).__module__ or ""
    root = module.split(".", 1)[0]
    if root not in ("tensorflow", "keras", "tf_keras"):
        return False
    return not isinstance(obj, type) and not callable(getattr(obj, "__code__", None))


def _stateless_pickler_class():
    import cloudpickle

    class StatelessPickler(cloudpickle.Pickler):
        """cloudpickle that refuses TensorFlow state (models, variables, optimizers) and says so."""

        def reducer_override(self, obj):
            if _is_tensorflow_state(obj) and not _is_harmless_tf_value(obj):
                raise pickle.PicklingError(
                    f"a {type(obj).__module__}.{type(obj).__qualname__} object (TensorFlow state)"
                )
            return super().reducer_override(obj)

    return StatelessPickler


def _is_harmless_tf_value(obj) -> bool:
    t = tf()
    return isinstance(obj, (t.DType, t.TensorShape, t.TensorSpec))


def dumps_for_workers(obj) -> bytes:
    """cloudpickle bytes of obj for the workers; a clear error when it drags TF state along."""
    import io

    buffer = io.BytesIO()
    try:
        _stateless_pickler_class()(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise ConfigurationError(
            f"What the workers must run cannot be sent to them: it refers to {e}. Models, "
            "variables and optimizers built in this process cannot travel to worker processes; "
            "each worker builds its own. Fix: build them inside the %%replicate cell, or pass "
            "setup=build to repl.train, where build(repl) creates the model and optimizer and "
            "returns (step_fn, input_fn)."
        ) from None
    return buffer.getvalue()


def picklable_namespace(namespace: dict) -> tuple[dict, list[str]]:
    """The notebook names a worker can receive (functions, classes, modules, data); and the rest."""
    import io

    pickler_class = _stateless_pickler_class()
    kept, skipped = {}, []
    for name, value in namespace.items():
        if name.startswith("_") or name in IPYTHON_NAMES or isinstance(value, Replicator):
            continue
        try:
            pickler_class(io.BytesIO(), protocol=pickle.DEFAULT_PROTOCOL).dump(value)
        except Exception:  # noqa: BLE001 - anything unpicklable stays in the notebook
            skipped.append(name)
            continue
        kept[name] = value
    return kept, skipped


def format_exception(error: BaseException) -> dict:
    return {
        "type": "error",
        "summary": f"{type(error).__name__}: {error}",
        "traceback": "".join(traceback.format_exception(error)),
    }
