"""A (step_fn, input_fn) pair compiled for one replicator: the input iterator and tf.functions.

Two compiled functions share one iterator, so `repl.run` and `repl.train` continue the same data
stream and a second `train` continues where the first stopped:
  one step   strategy.run(step_fn) on the next batch; per-replica outputs (repl.run).
  fused      a tf.while_loop of up to n steps in one call; each step's scalar outputs are packed
             into one vector per replica and summed across replicas in a single reduce, so
             per-step metrics cost one small reduction, not one per metric. n is a tensor: one
             trace serves every chunk length. An infinite input (cardinality INFINITE) gets the
             plain `for i in tf.range(n): strategy.run(step, args=(next(iterator),))` loop; a
             finite or unknown one checks `get_next_as_optional` each step and stops cleanly.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import numbers
import re
from collections.abc import Callable

import numpy as np

from workbench._src import compat
from workbench._src.core import reaper, step_clock
from workbench._src.core.errors import InputError, StepFunctionError, WorkbenchError
from workbench._src.core.inputs import SPLIT_ASSERT_MARKER, distribute_input
from workbench._src.core.optimizer import OptimizerNeedsBuild
from workbench._src.core.tf_setup import tf

BATCH_SIZE_KEY = "__batch_size__"


class Program:
    # The input never runs out (tf.data.INFINITE_CARDINALITY): the fused loop needs no end check.
    # A class default, so subclasses with their own input (async-ps) keep the checked loop.
    infinite_input = False
    # The fused loop reads the clock in every step (step_clock.py) for run.breakdown(); the run
    # loop sets it from RunOptions.breakdown. A subclass whose chunks run elsewhere may refuse.
    can_time = True
    timing = False
    last_marks = None  # the last chunk's clock readings [steps, step_clock.MARKS], when timed
    collective_bytes = 0  # bytes step_fn's collectives carry per replica and step (timed trace)

    def __init__(self, replicator, step_fn: Callable, input_fn: Callable):
        if not callable(step_fn):
            raise StepFunctionError(
                f"step_fn must be a function step_fn(batch) -> outputs; received {type(step_fn).__name__}."
            )
        self.replicator = replicator
        self.step_fn = step_fn
        self.input_fn = input_fn
        self._open_input(skip=0)
        self.steps_done = 0  # steps this program has run (all calls), also restored from checkpoints
        self.input_position = 0  # batches its input has given (restored: where a checkpoint left it)
        self.fused_traced = False  # the fused loop has run once: later calls do not trace it again
        self.traced_variants: set = set()  # timing on/off: each is its own trace
        self.executed_variants: set = set()  # run at least once (the first run instantiates it)
        self.metric_names: list[str] | None = None  # scalar outputs, found while tracing
        t = tf()
        self._one_step = t.function(self._one_step_graph)
        self._fused = t.function(self._fused_graph)

    def _open_input(self, skip: int, notes: list | None = None) -> None:
        replicator = self.replicator
        self.dataset = distribute_input(
            replicator.strategy,
            self.input_fn,
            replicator.input_replication,
            replicator.input_split_fn,
            num_workers=replicator.num_workers,
            worker_id=replicator.worker_id,
            skip=skip,
            notes=notes,
        )
        self.infinite_input = _is_infinite(self.dataset)
        with _no_cyclic_gc():  # (a collection here could free an old iterator on this thread)
            self.iterator = iter(self.dataset)
        # Deleting an idle distributed iterator waits 10-40 s for tf.data's autotuning thread
        # (reaper.py): the reaper deletes it when this program is garbage.
        reaper.adopt(self)

    def fast_forward(self, batches: int) -> list[str]:
        """Re-opens the input `batches` batches in (a resumed run continues the data where its
        checkpoint left it: core/resume.py); returns why that may not be exact ([] if it is)."""
        notes: list[str] = []
        if batches:
            reaper.discard_programs([self])  # the unused iterator goes on the reaper thread
            self._open_input(skip=batches, notes=notes)
        self.input_position = batches
        return notes

    # ----- what step_fn sees --------------------------------------------------------------
    def call_step_fn(self, batch):
        args = _arguments_for(self.step_fn, batch)
        outputs = self.step_fn(*args)
        return _validated_outputs(outputs, getattr(self.step_fn, "__name__", "step_fn"))

    def _metrics_step(self, batch):
        t = tf()
        outputs = self.call_step_fn(batch)
        flat = _named_leaves(outputs)
        scalars = [(name, v) for name, v in flat if v.shape.rank == 0]
        names = [name for name, _ in scalars]
        if self.metric_names is None:
            self.metric_names = names
        first = t.nest.flatten(batch)[0]
        batch_size = t.cast(t.shape(first)[0], t.float32) if first.shape.rank else t.constant(1.0)
        values = [t.cast(v, t.float32) for _, v in scalars]
        return t.stack(values + [batch_size])

    def _timed_metrics_step(self, batch):
        """_metrics_step, and the seconds this replica spent inside collectives (step_clock)."""
        with step_clock.CollectiveTimer() as timer:
            row = self._metrics_step(batch)
        self.collective_bytes = timer.bytes  # (while tracing; every replica traces the same)
        return row, timer.seconds()

    # ----- compiled functions -------------------------------------------------------------
    def _one_step_graph(self, iterator):
        return self.replicator.strategy.run(self.call_step_fn, args=(next(iterator),))

    def _fused_graph(self, iterator, n, timed=False):
        # timed (a Python bool: its own trace) adds clock readings to every step, in a float64
        # TensorArray `marks` of [begin, ready, end, comm] rows (step_clock.py says what each is).
        t = tf()
        strategy = self.replicator.strategy
        clock = step_clock
        marks = t.TensorArray(
            t.float64, size=n if timed else 0, dynamic_size=timed and not self.infinite_input
        )
        step = self._timed_metrics_step if timed else self._metrics_step
        if self.infinite_input and self.replicator.spec.local_rows:
            # The hand-written loop, with the metric rows summed over replicas once per chunk, not
            # once per step: each local replica keeps its own rows on its own device, and a single
            # reduce at the end sums them (under multi-worker, one collective per chunk instead of
            # one more per step beside the gradients'). Written here, not in a helper method: a
            # helper is converted by AutoGraph's recursive conversion, which in a kernel under
            # JupyterLab twice left it unconverted ("Iterating over a symbolic tf.Tensor" at its
            # loop, not understood); this function's own conversion never failed.
            devices = strategy.extended.worker_devices  # this process's replicas, in local order
            tables = []
            for device in devices:
                with t.device(device):
                    tables.append(t.TensorArray(t.float32, size=n))
            for i in t.range(n):
                if timed:
                    begin = t.timestamp()  # (no wait for the previous step: see step_clock.py)
                    with t.control_dependencies([begin]):
                        batch = next(iterator)
                    ready = clock.stamp_after(batch)
                    rows_here, comm = strategy.run(step, args=(batch,))
                    local = strategy.experimental_local_results(rows_here)
                    comms = strategy.experimental_local_results(comm)
                    end = clock.stamp_after([local, comms])
                    marks = marks.write(i, t.stack([begin, ready, end, t.add_n(comms) / len(comms)]))
                else:
                    per_replica = strategy.run(step, args=(next(iterator),))
                    local = strategy.experimental_local_results(per_replica)
                tables = [table.write(i, row) for table, row in zip(tables, local)]
                self._step_taken()
            stacks = []
            for device, table in zip(devices, tables):
                with t.device(device):
                    stacks.append(table.stack())
            rows = strategy.experimental_distribute_values_from_function(
                lambda ctx: stacks[ctx.replica_id_in_sync_group % len(stacks)]
            )
            summed = strategy.reduce("SUM", rows, axis=None)
            return (summed, n, marks.stack()) if timed else (summed, n)
        if self.infinite_input:
            # The loop a TensorFlow expert writes by hand: no end-of-input check in the body.
            rows = t.TensorArray(t.float32, size=n)
            for i in t.range(n):
                if timed:
                    begin = t.timestamp()  # (no wait for the previous step: see step_clock.py)
                    with t.control_dependencies([begin]):
                        batch = next(iterator)
                    ready = clock.stamp_after(batch)
                    rows_here, comm = strategy.run(step, args=(batch,))
                    comms = strategy.experimental_local_results(comm)
                    computed = clock.stamp_after([strategy.experimental_local_results(rows_here), comms])
                    summed = strategy.reduce("SUM", rows_here, axis=None)
                    end = clock.stamp_after(summed)  # the metric reduction is communication too
                    spent = t.add_n(comms) / len(comms) + (end - computed)
                    marks = marks.write(i, t.stack([begin, ready, end, spent]))
                else:
                    summed = strategy.reduce("SUM", strategy.run(step, args=(next(iterator),)), axis=None)
                rows = rows.write(i, summed)
                self._step_taken()
            return (rows.stack(), n, marks.stack()) if timed else (rows.stack(), n)
        # A finite (or unknown) input may end inside the chunk: stop there, cleanly.
        rows = t.TensorArray(t.float32, size=0, dynamic_size=True)
        done = t.constant(0)
        begin = t.constant(0.0, t.float64)  # (AutoGraph: read after the loop's `break`, so defined before)
        for i in t.range(n):
            if timed:
                begin = t.timestamp()  # (no wait for the previous step: see step_clock.py)
                with t.control_dependencies([begin]):
                    optional = iterator.get_next_as_optional()
                    has_value = optional.has_value()
            else:
                optional = iterator.get_next_as_optional()
                has_value = optional.has_value()
            if not has_value:
                break
            if timed:
                batch = optional.get_value()
                ready = clock.stamp_after(batch)
                rows_here, comm = strategy.run(step, args=(batch,))
                comms = strategy.experimental_local_results(comm)
                computed = clock.stamp_after([strategy.experimental_local_results(rows_here), comms])
                summed = strategy.reduce("SUM", rows_here, axis=None)
                end = clock.stamp_after(summed)
                spent = t.add_n(comms) / len(comms) + (end - computed)
                marks = marks.write(i, t.stack([begin, ready, end, spent]))
            else:
                summed = strategy.reduce("SUM", strategy.run(step, args=(optional.get_value(),)), axis=None)
            rows = rows.write(i, summed)
            self._step_taken()
            done = i + 1
        return (rows.stack(), done, marks.stack()) if timed else (rows.stack(), done)

    def _step_taken(self):
        """Traced once per step of the fused loop; a subclass may count steps here (async-ps does)."""
        return None  # a body of only a docstring makes AutoGraph warn that it cannot convert it

    # ----- host side ----------------------------------------------------------------------

    def trace(self) -> None:
        """Traces the fused loop without running a step: wrapped optimizers build their slot
        variables while it traces (the first real call reuses the trace)."""
        t = tf()
        call_compiled(lambda it, n: self._fused.get_concrete_function(it, n), self.iterator, t.constant(1))

    def run_one(self) -> list:
        t = tf()
        try:
            out = call_compiled(self._one_step, self.iterator)
        except t.errors.OutOfRangeError:
            raise InputError(
                f"input_fn's dataset ran out after {self.steps_done} step(s). Fix: add "
                "`.repeat()` to the dataset for as many steps as you run."
            ) from None
        except t.errors.InvalidArgumentError as e:
            raise _translated(e) from None
        self.steps_done += 1
        self.input_position += 1
        return list(self.replicator.strategy.experimental_local_results(out))

    def run_fused(self, n: int, timed: bool = False, trace_other: bool = True) -> tuple[np.ndarray, int]:
        """Runs up to n steps; returns (rows [steps, metrics + batch size] summed over replicas, steps).

        timed: this chunk reads the clock in every step (`last_marks`; step_clock.py). With
        `timing` on, the first call also traces the other variant (unless not `trace_other`: a
        run that times every step), so that switching between them later does not trace inside
        a measured chunk (its first run still instantiates it: ~0.1 s for a small model, which
        the breakdown leaves out of its sample).
        """
        t = tf()
        timed = bool(timed and self.can_time)
        try:
            out = call_compiled(self._fused, self.iterator, t.constant(n), timed)
            self.traced_variants.add(timed)
            if trace_other and self.timing and self.can_time and (not timed) not in self.traced_variants:
                call_compiled(self._fused.get_concrete_function, self.iterator, t.constant(n), not timed)
                self.traced_variants.add(not timed)
        except t.errors.InvalidArgumentError as e:
            raise _translated(e) from None
        rows, done = out[0], out[1]
        self.executed_variants.add(timed)
        self.fused_traced = True
        done = int(done)
        self.last_marks = out[2].numpy()[:done] if timed else None
        self.steps_done += done
        self.input_position += done
        return rows.numpy()[:done], done


def _is_infinite(dataset) -> bool:
    """True when the distributed dataset reports tf.data.INFINITE_CARDINALITY (e.g. `.repeat()`
    without a count); unknown or finite cardinality, or no report at all, is False."""
    try:
        cardinality = dataset.cardinality
    except (AttributeError, ValueError):  # not built / not a tf.distribute dataset
        return False
    if callable(cardinality):  # a plain tf.data.Dataset
        cardinality = cardinality()
    try:
        return int(cardinality) == int(tf().data.INFINITE_CARDINALITY)
    except (TypeError, ValueError):
        return False


def call_compiled(function, *args):
    """Calls a compiled step; builds wrapped optimizers that tracing found unbuilt, then retraces."""
    for _ in range(100):  # one retrace per optimizer, at most
        try:
            with _no_cyclic_gc():
                return function(*args)
        except Exception as error:  # noqa: BLE001 - re-raised below unless it is ours
            original = _original_error(error)
            if isinstance(original, OptimizerNeedsBuild):
                original.optimizer.build(original.variables)
                continue
            if isinstance(original, WorkbenchError) and original is not error:
                raise original from None  # our own message, not autograph's re-wrapping
            raise
    raise RuntimeError("wrapped optimizers kept asking to be built")


@contextlib.contextmanager
def _no_cyclic_gc():
    """Keeps Python's cycle collector out of compiled calls.

    Measured: a collection that happened to run inside a MirroredStrategy replica thread while it
    traced freed an old input iterator there; the iterator's destructor waited for its tf.data
    threads, which waited for the tracing, which waited for that replica thread: a deadlock (the
    full test suite hung at 0% CPU). Outside compiled calls the same destructor only delays.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _original_error(error: BaseException) -> BaseException:
    """The exception step_fn raised, under autograph's StagingError re-wrapping if any."""
    seen = error
    while seen is not None:
        if isinstance(seen, (WorkbenchError, OptimizerNeedsBuild)):
            return seen
        seen = seen.__context__
    return error


def _translated(error):
    if SPLIT_ASSERT_MARKER in str(error):
        message = re.split(r"[\]\n]", str(error).split(SPLIT_ASSERT_MARKER, 1)[1], maxsplit=1)[0]
        return InputError(
            f"A global batch from input_fn does not divide evenly{message}. Received a batch "
            "whose leading dimension is not a multiple of the replica count (often the last, "
            "short batch of a finite dataset)."
        )
    return error


def _arguments_for(step_fn: Callable, batch) -> tuple:
    """One argument (the batch), or the batch's parts when step_fn takes them separately."""
    try:
        params = list(inspect.signature(step_fn).parameters.values())
    except (TypeError, ValueError):
        return (batch,)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    is_tuple = isinstance(batch, (tuple, list))
    if len(required) == 1 or (len(required) == 0 and positional):
        return (batch,)
    if is_tuple and (
        len(required) <= len(batch) <= len(positional) or varargs and len(required) <= len(batch)
    ):
        return tuple(batch)
    names = ", ".join(p.name for p in positional)
    got = f"a {type(batch).__name__} of {len(batch)} parts" if is_tuple else f"one {type(batch).__name__}"
    raise StepFunctionError(
        f"step_fn({names}) takes {len(required)} argument(s), but each input element is {got} "
        f"({_describe(batch)}). Fix: write step_fn(batch) and unpack inside, or make input_fn "
        f"yield a tuple with one part per argument."
    )


def _describe(batch) -> str:
    t = tf()
    try:
        return str(t.nest.map_structure(lambda v: getattr(v, "shape", type(v).__name__), batch))
    except (TypeError, ValueError):
        return type(batch).__name__


def _validated_outputs(outputs, where: str):
    t = tf()
    if outputs is None:
        return {}

    def check(path, value):
        if isinstance(value, (t.Tensor, t.Variable)) or compat.is_composite_tensor(value):
            return value
        if isinstance(value, (numbers.Number, np.ndarray, np.generic)) and not isinstance(value, bool):
            return t.convert_to_tensor(value)
        keras_value = getattr(value, "value", None)  # a keras.Variable
        if keras_value is not None and isinstance(keras_value, (t.Tensor, t.Variable)):
            return keras_value
        name = f"output '{path}'" if path else "the output"
        raise StepFunctionError(
            f"{where} must return tensors (any nesting of dicts, lists, tuples); {name} is a "
            f"{type(value).__module__}.{type(value).__qualname__}: {value!r:.80}. Fix: return "
            "tf.Tensor values, e.g. {'loss': loss}; keep Python objects outside step_fn."
        )

    return _map_with_paths(check, outputs)


def _named_leaves(outputs) -> list:
    t = tf()
    if isinstance(outputs, (t.Tensor, t.Variable)):
        return [("output", outputs)]
    leaves = []
    _map_with_paths(lambda path, v: leaves.append((path or "output", v)), outputs)
    return leaves


def _map_with_paths(fn, obj, path: str = ""):
    """map_structure over dicts/lists/tuples, passing each leaf's 'a/0/b' path to fn."""
    join = (lambda key: f"{path}/{key}") if path else str
    if isinstance(obj, dict):
        return type(obj)((k, _map_with_paths(fn, v, join(k))) for k, v in sorted(obj.items()))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_with_paths(fn, v, join(k)) for k, v in zip(obj._fields, obj)))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_with_paths(fn, v, join(i)) for i, v in enumerate(obj))
    return fn(path, obj)
