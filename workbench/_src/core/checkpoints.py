"""Checkpoints of a run: what is saved, where, and how it is restored.

Layout (issue 17): the objects the run was told to save sit at the top level of the checkpoint
under the names given (`checkpoint={"model": model, "optimizer": opt}` -> `model`, `optimizer`),
beside the workbench's own `step` (int64, the exact step count) and TensorFlow's `save_counter`.
So TensorFlow's own restore code reads it unchanged:

    tf.train.Checkpoint(model=new_model, optimizer=new_opt).restore(tf.train.latest_checkpoint(d))

Without `checkpoint=` the run saves the variables created in repl.context() as the list
`variables` (in creation order): `tf.train.Checkpoint(variables=[...same order...])` reads it.
Checkpoints written before issue 17 nested everything under `run` (`Checkpoint(run=items,
step=step)`); both readers here recognise that layout and load it too.

`Saver` is the run loop's checkpoint writer (tf.train.CheckpointManager's files, written by a
compiled save); `restore_latest` is `Replicator.restore`;
`check_writable_directory` is the run loop's (and the launcher's) early check of checkpoint_dir.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading

from workbench._src import compat
from workbench._src.core.checkpoint_files import CheckpointFiles, checkpoint_of_step
from workbench._src.core.errors import ConfigurationError, WorkerError
from workbench._src.core.optimizer import ReplicatedOptimizer
from workbench._src.core.resume import STATE_NAME, RunState
from workbench._src.core.save_buffer import keep_save_buffer_allocated
from workbench._src.core.tf_setup import tf

STEP = "step"  # the workbench's step counter entry
LEGACY_ROOT = "run"  # where checkpoints written before issue 17 nested the saved objects
DEFAULT_NAME = "variables"  # the default: every variable created in repl.context(), in order
# Names the checkpoint's top level already uses: ours, the legacy root, TensorFlow's own counter.
RESERVED = {
    STEP: "the workbench's exact step count (int64), saved with every checkpoint",
    STATE_NAME: "the run state a resumed run continues from (the input's position, the run's goal)",
    LEGACY_ROOT: "where older workbench versions nested everything they saved",
    "save_counter": "tf.train.Checkpoint's own save counter",
}


class Saver:
    """tf.train.CheckpointManager over the run's trackables (top level) plus the exact step count.

    Args:
      program: the run's compiled program (its steps_done is saved and restored).
      directory: checkpoint_dir: restored from, and written to unless write_directory differs.
      items: the trackables to save by name (`named_items`).
      resume: restore_if_any() restores the latest checkpoint in `directory` when True, the
        checkpoint of that step when a step number (int, not bool), nothing when False.
      write_directory: where this process writes (multi-worker: every worker saves, as the save
        is collective, but only the chief's copy is kept; every worker restores from `directory`).
    """

    def __init__(self, program, directory, items: dict, resume: bool | int = True, write_directory=None):
        t = tf()
        self.directory = os.fspath(directory)
        self.program = program
        self.resume = resume
        # (checked now, before the run: a failing run saves what it has, over the folder's latest)
        self._resume_path = None if isinstance(resume, bool) else checkpoint_of_step(self.directory, resume)
        self.items = items
        self.step = t.Variable(0, dtype=t.int64, trainable=False)
        self.state = RunState()  # the input's position and the run's goal (core/resume.py)
        self.step_checkpoint = t.train.Checkpoint(
            **self.items, **{STEP: self.step, STATE_NAME: self.state.trackable}
        )
        self.files = CheckpointFiles(os.fspath(write_directory or directory))
        self._write = None  # the compiled write, traced at the first save
        self._copy_and_write = None  # the same in two parts (copy, write): for a background write
        self._traced_write = None  # its write, traced
        self._writing: threading.Event | None = None  # set when the background write is done
        self._write_error: BaseException | None = None  # what the last background write raised
        # What the run loop is training towards: saved so that a resumed run given the same
        # steps finishes this one (0: nothing unfinished, e.g. once the run has finished).
        self.goal_step = 0
        self.asked_steps = 0
        self._saved = None  # (step, goal) of the last save

    def restore_if_any(self) -> Restored | None:
        """Restores the checkpoint `resume` names (the latest, or the one of a step) when this
        program has not stepped yet, with the input fast-forwarded to where it was; else None."""
        if self.resume is False or self.program.steps_done:
            return None
        latest = self._resume_path or tf().train.latest_checkpoint(self.directory)
        if not latest:
            return None
        _reader_for(latest, self.items, self.step, self.state).restore(latest).expect_partial()
        step = int(self.step.numpy())
        position, goal, asked = self.state.read()
        if not position and STATE_NAME not in saved_names(latest):
            position = step  # saved before the run state existed: one batch per step
        self.program.steps_done = step
        notes = self.program.fast_forward(position)
        self._saved = (step, goal)
        return Restored(step, position, goal, asked, notes)

    @property
    def latest_checkpoint(self) -> str | None:
        """The last checkpoint this saver wrote (None before its first save)."""
        return self.files.latest

    def save(self, background: bool = False, on_saved=None) -> str | None:
        """Saves the current step; returns its path once it is whole, or None when nothing is new
        or (background=True) it is being written on a thread: `on_saved(path)` is called there
        when it is whole. A background save copies the values here, at the step boundary (reads
        share the variables' buffers, and TensorFlow copies a buffer before updating it while a
        read holds it), and leaves the write (SaveV2, the `checkpoint` state file) to the thread,
        so training goes on meanwhile. Every save first waits for the one still being written."""
        self.wait(raise_error=True)
        mark = (self.program.steps_done, self.goal_step)
        if self.files.latest and self._saved == mark:
            return None  # nothing new since the last save
        t = tf()
        self.step.assign(self.program.steps_done)
        self.state.set(self.program.input_position, self.goal_step, self.asked_steps)
        path = self.files.path(self.program.steps_done)
        if background and self._write is not None:  # (the first save traces, here)
            if self._copy_and_write is None:
                self._copy_and_write = _copy_then_write(self.step_checkpoint)
                # (each run: a pipeline built since may have reset it; core/save_buffer.py)
                keep_save_buffer_allocated()
            if self._copy_and_write:
                copy, write = self._copy_and_write
                values = copy()
                if self._traced_write is None:  # traced here, on the run's thread, as the first save
                    self._traced_write = write.get_concrete_function(t.constant(path), values)
                self._saved = mark
                self._writing = threading.Event()
                _in_background(self._write_in_background, self._traced_write, path, values, on_saved)
                return None
        if self._write is None:
            self._write = t.function(_single_file_write(self.step_checkpoint))
        self._write(t.constant(path))
        self.files.saved(path)
        self._saved = mark
        return path

    def _write_in_background(self, write, path: str, values, on_saved) -> None:
        try:
            write(tf().constant(path), values)
            self.files.saved(path)
        except BaseException as error:  # noqa: BLE001 - raised by the next save, on the run's thread
            self._write_error = error
            return
        finally:
            self._writing.set()
        if on_saved is not None:
            on_saved(path)

    def wait(self, raise_error: bool = False) -> None:
        """Returns once no save is being written; raise_error: raises what a background write
        raised (else it stays for the next save to raise)."""
        if self._writing is not None:
            self._writing.wait()
            self._writing = None
        if raise_error and self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise error


# One writer thread for every run of the process, started at the first background save: handing
# it a write costs the run's thread microseconds, where starting a thread per save took up to
# milliseconds on a loaded machine (the start waits for the new thread to be scheduled).
_writes: queue.SimpleQueue = queue.SimpleQueue()
_writer_lock = threading.Lock()
_writer: threading.Thread | None = None


def _in_background(function, *args) -> None:
    global _writer
    with _writer_lock:
        if _writer is None or not _writer.is_alive():
            _writer = threading.Thread(target=_write_forever, name="workbench checkpoint writer", daemon=True)
            _writer.start()
    _writes.put((function, args))


def _write_forever() -> None:
    while True:
        function, args = _writes.get()
        function(*args)


def _copy_then_write(checkpoint):
    """(copy, write): `copy()` counts the save and returns a copy of every value to save (called
    at the step boundary); `write(prefix, values)` writes them as _single_file_write does. False
    where the save is not one plain tensor per key (compat.checkpoint_tensors_by_key): those
    saves stay whole on the run's thread."""
    t = tf()
    counter = checkpoint.save_counter
    keys: list[str] = []

    def copy():
        counter.assign_add(1)
        tensors = compat.checkpoint_tensors_by_key(checkpoint)
        if tensors is None:
            return []
        keys[:] = sorted(tensors)
        return [t.identity(tensors[k]) for k in keys]

    copy = t.function(copy)
    copy.get_concrete_function()  # (traced now: the keys are known from here on)
    if not keys:
        return False

    def write(prefix, values):
        return _save_v2(prefix, keys, values)

    return copy, t.function(write)


def _save_v2(prefix, keys: list[str], values: list):
    """Inside a traced save: one SaveV2 op writing `values` under `keys` (the two files of a
    checkpoint); returns `prefix` once they are written."""
    t = tf()
    with t.device("/cpu:0"):
        saved = t.raw_ops.SaveV2(prefix=prefix, tensor_names=keys, shape_and_slices=[""] * len(keys), tensors=values)
        with t.control_dependencies([saved]):
            return t.identity(prefix)


def _single_file_write(checkpoint):
    """The save of `checkpoint` as a function to compile once: an eager write reads every
    variable through Python (15 ms for a small MLP with Adam here, 31 ms through
    tf.train.CheckpointManager); a traced `checkpoint.write` runs the same ops in one call (5 ms),
    most of it TensorFlow's temp-folder-and-merge; one SaveV2 op over the same keys writes the same
    two files (`prefix.index`, `prefix.data-00000-of-00001`) in 0.3-1.5 ms
    (compat.checkpoint_tensors_by_key; TensorFlow's own write where the save is not that simple).
    Nothing is lost without the temp folder: a save cut short leaves files the `checkpoint` state
    file does not name yet (CheckpointFiles.saved writes it after). The save counter is kept as
    CheckpointManager keeps it, so plain TensorFlow sees the same checkpoint."""
    counter = checkpoint.save_counter  # (created now, outside the trace)

    def write(prefix):
        counter.assign_add(1)
        tensors = compat.checkpoint_tensors_by_key(checkpoint)
        if tensors is None:
            return checkpoint.write(prefix)
        keys = sorted(tensors)
        return _save_v2(prefix, keys, [tensors[k] for k in keys])

    return write


@dataclasses.dataclass
class Restored:
    """What a resumed run continues from: the step, the input's position (batches), the goal and
    steps of the run that saved it (0, 0 when it had finished), and why the input may not
    resume exactly ([] when it does)."""

    step: int
    input_position: int
    goal_step: int
    asked_steps: int
    notes: list


def named_items(replicator, items, variables: list | None = None) -> dict:
    """What a checkpoint saves, by top-level name; refuses names the layout already uses.
    Default: `variables`, else every variable created in the replicator's context, in order."""
    if items is None:
        return {DEFAULT_NAME: list(replicator._created_variables if variables is None else variables)}
    if isinstance(items, tf().train.Checkpoint):
        # Its own children (what it was built with), without its private save counter.
        items = {k: v for k, v in compat.checkpoint_children(items).items() if k != "save_counter"}
    if not isinstance(items, dict):
        raise ConfigurationError(
            "checkpoint must be a dict of trackables, e.g. {'model': model, 'optimizer': opt}, or a "
            f"tf.train.Checkpoint; received {type(items).__name__}: {items!r:.80}."
        )
    clashes = sorted(set(items) & set(RESERVED))
    if clashes:
        what = "; ".join(f"{name!r} is {RESERVED[name]}" for name in clashes)
        raise ConfigurationError(
            f"checkpoint names {clashes} clash with the checkpoint's own entries ({what}). Received "
            f"checkpoint keys {sorted(items)}. Fix: rename them (e.g. 'my_{clashes[0]}'); the step "
            "count is saved anyway and plain TensorFlow reads it as "
            "tf.train.Checkpoint(step=tf.Variable(0, dtype=tf.int64))."
        )
    # A wrapped optimizer is not itself trackable: its Keras optimizer holds the state.

    return {k: v.optimizer if isinstance(v, ReplicatedOptimizer) else v for k, v in items.items()}


def saved_names(path: str) -> dict[str, list[str]]:
    """The top-level names of a checkpoint's object graph, each with its own children's names:
    {"model": [...], "optimizer": [...], "step": [], ...}."""
    nodes = compat.checkpoint_object_graph(tf().train.load_checkpoint(path)).nodes
    return {c.local_name: [g.local_name for g in nodes[c.node_id].children] for c in nodes[0].children}


def is_legacy(path: str) -> bool:
    """True for a checkpoint written before issue 17 (everything nested under `run`)."""
    return LEGACY_ROOT in saved_names(path)


def _reader_for(path: str, items: dict, step, state: RunState | None = None):
    """The tf.train.Checkpoint that reads `path` into `items` and `step` (and the run state, when
    given and saved), for either layout."""
    t = tf()
    if is_legacy(path):
        return t.train.Checkpoint(**{LEGACY_ROOT: t.train.Checkpoint(**items), STEP: step})
    extra = {STATE_NAME: state.trackable} if state is not None else {}
    return t.train.Checkpoint(**items, **{STEP: step}, **extra)


def restore_latest(replicator, directory, items=None) -> int:
    """`Replicator.restore`: the latest checkpoint in `directory` into `items` (default: the
    variables created in repl.context()); returns the step it was saved at."""
    t = tf()
    directory = os.fspath(directory)
    if items is not None:
        items = named_items(replicator, items)  # a name clash is refused first
    latest = t.train.latest_checkpoint(directory)
    if not latest:
        raise ConfigurationError(
            f"No checkpoint to restore in {directory!r}. Fix: give the folder that "
            "train(checkpoint_dir=...) wrote (it holds a 'checkpoint' file and ckpt-N files)."
        )
    if items is None and not replicator._created_variables:
        raise ConfigurationError(
            "Nothing to restore into: no variable was created in this replicator's context. "
            "Fix: build the model (and optimizer) in `with repl.context():` first, as the run "
            "that saved the checkpoint did, or pass checkpoint={'model': model, ...}."
        )
    if items is None:
        items = named_items(replicator, None)
    step = t.Variable(0, dtype=t.int64, trainable=False)
    try:
        status = _reader_for(latest, items, step).restore(latest)
        status.expect_partial()  # e.g. an evaluation model without the optimizer's slots
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:  # ValueError: a variable of another shape
        raise ConfigurationError(
            f"The checkpoint {latest} does not match the variables built here: "
            f"{str(e).rstrip('.')}. Fix: build "
            "the model the same way as the run that saved it (same layers, same order), and pass "
            f"the same checkpoint names it saved ({_saved_names(latest)})."
        ) from None
    return int(step.numpy())


def _saved_names(path: str) -> str:
    """The names a checkpoint saved its objects under (old layout: those under `run`), for errors."""
    try:
        names = saved_names(path)
    except Exception:  # noqa: BLE001 - only decorates an error message
        return "unknown"
    if LEGACY_ROOT in names:
        return ", ".join(names[LEGACY_ROOT]) + " (old layout, nested under 'run')"
    return ", ".join(n for n in names if n not in RESERVED) or "none"


def check_writable_directory(path) -> str:
    """The absolute path of a checkpoint (or runs) folder, created if missing; refused early when
    it is a file or cannot be written, instead of failing at the first save, steps later.

    URLs (gs://, s3://, hdfs://...) are returned unchanged: TensorFlow's file systems check them.
    """
    raw = os.fspath(path)
    if "://" in raw:
        return raw
    absolute = os.path.abspath(os.path.expanduser(raw))
    fix = "Fix: pass checkpoint_dir= a folder you can write (it is created if missing)."
    if os.path.exists(absolute) and not os.path.isdir(absolute):
        raise ConfigurationError(
            f"checkpoint_dir must be a folder, but {absolute!r} is a file (received "
            f"checkpoint_dir={raw!r}). {fix}"
        )
    try:
        os.makedirs(absolute, exist_ok=True)
    except OSError as e:
        raise ConfigurationError(
            f"checkpoint_dir {absolute!r} cannot be created: {e.strerror or e} (received "
            f"checkpoint_dir={raw!r}). {fix}"
        ) from None
    if not os.access(absolute, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"checkpoint_dir {absolute!r} is not writable by this process (received "
            f"checkpoint_dir={raw!r}). {fix}"
        )
    return absolute


def with_checkpoint_hint(error: BaseException, saver) -> BaseException:
    """A WorkerError names the last checkpoint to go on from (or says how to keep one)."""

    if not isinstance(error, WorkerError) or not error.args:
        return error
    latest = saver.latest_checkpoint if saver is not None else None
    hint = (
        checkpoint_hint(latest)
        or " Pass checkpoint_dir= (and checkpoint_every=) to keep a checkpoint next time."
    )
    error.args = (f"{error.args[0]}{hint}", *error.args[1:])
    return error


def checkpoint_hint(latest: str | None) -> str:
    """What a failed run's error says about its last checkpoint ('' when there is none)."""
    if not latest:
        return ""
    return (
        f" The last checkpoint is {latest}: build the model on a new replicator and call "
        f"repl.restore({os.path.dirname(latest)!r}), or train again with checkpoint_dir= that "
        "folder to go on."
    )
