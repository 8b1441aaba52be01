"""What travels from a launcher to its processes, and back.

Out: a *work* object, pickled by value with cloudpickle (so functions and classes defined in a
notebook travel), called in each process as work(repl, link):
  TrainWork  build (a setup function, e.g. a cell's CellSetup, or self-contained step_fn and
             input_fn), train with the process replicator, stream the run's events, return the
             status and (from the chief) the trained weights;
  CallWork   fn(repl) -> result (repl.run_on_workers, repl.run from the launcher).
TensorFlow state (models, variables, optimizers) never travels: each process builds its own. A
custom pickler refuses it and the error says how to fix it.

Back, over the channel: {"type": "event", kind, step, data} for the run's events,
{"type": "result", value}, and {"type": "error", ...} made by `format_exception`.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import time
import traceback
import types

from workbench._src.core import errors
from workbench._src.core.cells import CELL_FILENAME, execute_source, functions_defined
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.replicator import Replicator
from workbench._src.core.run_loop import PreemptOnSigterm
from workbench._src.core.tf_setup import tf
from workbench._src.core.tracebacks import cause_line, remember_shipped_code, shown_text
from workbench._src.launch.runtime import TASK_ENV

IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


class TrainWork:
    """Train in a launched process, forwarding the run's events to the launcher."""

    def __init__(self, step_fn=None, input_fn=None, setup=None, steps=None, options=None):
        self.step_fn, self.input_fn, self.setup = step_fn, input_fn, setup
        self.steps, self.options = steps, dict(options or {})
        self.replicator_options: dict = {}

    def __call__(self, repl, link):
        from workbench._src.core.current import set_current

        set_current(repl, None)  # wb.current() in the cell or script is this process's replicator
        for name, value in self.replicator_options.items():
            setattr(repl, name, value)
        chief = repl.worker_id == 0

        def forward(event):
            # Every worker's own breakdown row travels too: run.breakdown() has one per worker.
            if chief or event.kind in ("message", "breakdown"):
                link.send({"type": "event", "kind": event.kind, "step": event.step, "data": event.data})

        timing: dict = {}
        setup = _TimedSetup(self.setup, timing) if self.setup is not None else None
        run = repl.train(
            self.step_fn, self.input_fn, self.steps, setup=setup,
            background=True, sinks=[forward], **self.options,
        )  # fmt: skip
        # The launcher's stop requests (run.stop(), the Stop button, an interrupt, its own
        # preemption) come through the link's one reader (channel.ParentLink.start_reader), for
        # this run only.
        def stop(preempt=None):
            run.preempt(preempt) if preempt else run.stop()

        link.on_stop = stop
        if link.stop_pending:
            stop(link.stop_pending if isinstance(link.stop_pending, str) else None)
        try:
            with PreemptOnSigterm(f"SIGTERM to {_task_label(repl)}", run):
                run._done.wait()
        finally:
            link.on_stop = None
        if run.status == "failed":
            raise run.error
        weights = [(v.name, v.numpy()) for v in repl._created_variables] if chief else None
        return {
            "status": run.status,
            "reason": run.stop_reason,
            "steps": run.steps,
            "weights": weights,
            "compile_seconds": run.compile_seconds,
            "build_seconds": timing.get("build_seconds"),
            "executed_steps": getattr(run, "executed_steps", None),
        }


def _task_label(repl) -> str:
    task = os.environ.get(TASK_ENV, "")
    return task.replace(":", " ") if task else f"worker {repl.worker_id}"


class _TimedSetup:
    """setup(repl), timed: the 'build' phase of a run's start (run.startup)."""

    def __init__(self, setup, timing: dict):
        self.setup, self.timing = setup, timing

    def __call__(self, repl):
        started = time.perf_counter()
        try:
            return self.setup(repl)
        finally:
            self.timing["build_seconds"] = time.perf_counter() - started


class CallWork:
    """fn(repl) in a launched process; the result comes back pickled."""

    def __init__(self, fn):
        self.fn = fn
        self.replicator_options: dict = {}

    def __call__(self, repl, link):
        for name, value in self.replicator_options.items():
            setattr(repl, name, value)
        return self.fn(repl)


class OneStep:
    """repl.run(step_fn, input_fn) in a launched process, outputs as numpy."""

    def __init__(self, step_fn, input_fn):
        self.step_fn, self.input_fn = step_fn, input_fn

    def __call__(self, repl):

        outputs = repl.run(self.step_fn, self.input_fn)
        return tf().nest.map_structure(lambda v: v.numpy(), outputs)


class CellSetup:
    """A `%%replicate` cell as a setup function: setup(repl) runs the cell's source with the
    notebook's picklable names and `repl` bound to the caller's replicator, and returns the
    step_fn and input_fn it defines. It pickles (the source travels, not code objects), so
    worker processes can build the cell's model themselves."""

    def __init__(
        self, source: str, namespace: dict | None, filename: str = CELL_FILENAME, import_paths: tuple = ()
    ):
        self.source, self.namespace, self.filename = source, namespace, filename
        # Folders its `import`s look in first, wherever it runs (a script's own folder, for the
        # helper modules beside it: a worker process started elsewhere would not find them).
        self.import_paths = tuple(import_paths)

    def __call__(self, repl):
        for folder in reversed(self.import_paths):
            if folder not in sys.path:
                sys.path.insert(0, folder)
        namespace = {**(self.namespace or {}), "repl": repl}
        execute_source(self.source, namespace, self.filename)
        return functions_defined(namespace, where=self.filename)


def load_weights(local_variables, weights, run) -> None:
    """The chief's trained weights into the variables a cell built in the notebook."""
    loaded = 0
    for variable, (_name, value) in zip(local_variables, weights):
        if tuple(variable.shape) == tuple(value.shape):
            variable.assign(value)
            loaded += 1
    if loaded != len(local_variables):
        run.publish(
            "message",
            text=f"loaded {loaded} of {len(local_variables)} trained variables into this notebook "
            "(the cell built different variables here than in the worker processes)",
        )
    else:
        run.publish("message", text=f"loaded the trained weights into {loaded} variables here")


# ----- pickling --------------------------------------------------------------------------------
def _is_tensorflow_state(obj) -> bool:
    module = type(obj).__module__ or ""
    root = module.split(".", 1)[0]
    if root not in ("tensorflow", "keras", "tf_keras"):
        return False
    return not isinstance(obj, type) and not callable(getattr(obj, "__code__", None))


def _is_harmless_tf_value(obj) -> bool:

    t = tf()
    return isinstance(obj, (t.DType, t.TensorShape, t.TensorSpec))


def _stateless_pickler_class():
    import cloudpickle

    class StatelessPickler(cloudpickle.Pickler):
        """cloudpickle that refuses TensorFlow state (models, variables, optimizers) and says so."""

        def reducer_override(self, obj):
            if isinstance(obj, types.CodeType):
                # cloudpickle sends a function's code by value as "<dynamic-code>" (a payload
                # that does not say where it was defined; a worker then does not read, or
                # AutoGraph-convert, its source): this process keeps where each one came from,
                # to name the frames of a worker's traceback (tracebacks.frames_named).
                remember_shipped_code(obj)
            if _is_tensorflow_state(obj) and not _is_harmless_tf_value(obj):
                raise pickle.PicklingError(
                    f"a {type(obj).__module__}.{type(obj).__qualname__} object (TensorFlow state)"
                )
            return super().reducer_override(obj)

    return StatelessPickler


def dumps_for_workers(obj) -> bytes:
    """cloudpickle bytes of obj for the workers; a clear error when it drags TF state along."""
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
    """An error message for the channel; a workbench error keeps its class and message."""

    kind = type(error).__name__
    return {
        "type": "error",
        "summary": f"{kind}: {error}",
        "error_class": kind if isinstance(getattr(errors, kind, None), type) else None,
        "message": str(error),
        "task": getattr(error, "task", None),  # a WorkerError's process, e.g. "ps 0"
        "traceback": "".join(traceback.format_exception(error)),
        # The cause's own sentence and the frames of the user's code, for the notebook's first line
        "cause": cause_line(error),
        "shown": shown_text(error),
    }
