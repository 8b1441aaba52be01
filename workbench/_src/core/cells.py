"""Cells: running a cell's source (the one place that does), and what a `%%replicate` cell owns
on its replicator, released when the same cell runs again.

`execute_source` runs a cell's (or a `workbench run` file's) source in a namespace; everything
that runs a cell (the magic, the study and compare forms, worker processes, the CLI) goes
through it, so a cell's mistakes read the same everywhere.

A replicator remembers every variable created in `repl.context()` (the default checkpoint saves
them) and every compiled (step_fn, input_fn) program (so `repl.train` continues a data stream).
A notebook re-runs cells: without this, each run of a `%%replicate` cell would add a new model's
variables and a new program to the same replicator, so memory grows with every re-run and a
default checkpoint would save the stale models too.

So an execution of a `%%replicate` cell owns what appears on its replicator while it runs: the
variables the cell body creates, the optimizer slots its first steps build, and the programs it
trains. Running the same cell again first stops its previous run if that is still going
(`--background`), then drops those variables and programs from the replicator. The objects
themselves live on while the notebook still refers to them (a model kept under another name
keeps working); the replicator just stops tracking them.

"The same cell" is the frontend's cell id (JupyterLab, Notebook 7 and VS Code send one with each
execution); where there is none (a terminal IPython, `run_cell_magic` in tests) every
`%%replicate` cell shares one slot, so each replaces the previous one's state.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

from workbench._src.core import reaper
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.tracebacks import remember_source

# replicator -> {cell key: _Owned}; weak, so a replicator nobody uses is not kept alive here
CELL_FILENAME = "<%%replicate cell>"


def execute_source(source, namespace: dict, filename: str = CELL_FILENAME) -> dict:
    """Runs `source` (a string, or a code object already compiled) in `namespace`; returns it."""
    if isinstance(source, str):
        remember_source(filename, source)  # (the lines a worker's traceback shows)
    code = compile(source, filename, "exec") if isinstance(source, str) else source
    namespace.setdefault("__name__", "__main__")
    exec(code, namespace)
    return namespace


def functions_defined(namespace: dict, where: str = "The %%replicate cell"):
    """(step_fn, input_fn) a cell defined; a ConfigurationError naming what is missing."""

    missing = [n for n in ("step_fn", "input_fn") if not callable(namespace.get(n))]
    if missing:
        raise ConfigurationError(
            f"{where} must define step_fn(batch) and input_fn(ctx); {' and '.join(missing)} is not "
            "defined (or not a function). Fix: define both, e.g.\n"
            "  def input_fn(ctx): return dataset.repeat().batch(64)\n"
            "  def step_fn(x, y): ...; return {'loss': loss}"
        )
    return namespace["step_fn"], namespace["input_fn"]


def functions_from_setup(built):
    """(step_fn, input_fn) from what setup(repl) returned."""

    if isinstance(built, dict) and "step_fn" in built and "input_fn" in built:
        return built["step_fn"], built["input_fn"]
    if isinstance(built, (tuple, list)) and len(built) == 2:
        return tuple(built)
    raise ConfigurationError(
        "setup(repl) must return (step_fn, input_fn) or {'step_fn': ..., 'input_fn': ...}; "
        f"received {type(built).__name__}: {built!r:.80}."
    )


def build_cell(repl, source, namespace: dict, filename: str = CELL_FILENAME):
    """The cell recipe, written once: runs a cell's (or a script's) source inside repl.context()
    with `repl` bound (unless the namespace has its own), and returns the (step_fn, input_fn)
    it defined."""
    namespace.setdefault("repl", repl)
    with repl.context():
        execute_source(source, namespace, filename)
    return functions_defined(namespace, where=filename)


_ledgers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()
STOP_TIMEOUT_S = 60.0


def cell_key(shell) -> str | None:
    """The id of the cell being executed, if the frontend sent one (IPython >= 8 keeps it)."""
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    return getattr(getattr(result, "info", None), "cell_id", None)


class _Owned:
    """One cell execution's share of a replicator: filled in when its window closes."""

    def __init__(self, repl):
        self.repl = repl
        self._before_variables = list(repl._created_variables)  # identities, until close()
        self._before_programs = set(repl._programs)
        self.variables: list | None = None
        self.programs: list = []
        self.run = None

    def track(self, run) -> None:
        """The run this cell started: a background one closes the window when it ends."""
        self.run = run
        run.subscribe(lambda event: self.close() if event.kind == "ended" else None)

    def close(self) -> None:
        """Records what appeared since the cell started (idempotent)."""
        with _lock:
            if self.variables is not None:
                return
            before = {id(v) for v in self._before_variables}
            self.variables = [v for v in self.repl._created_variables if id(v) not in before]
            self.programs = [k for k in self.repl._programs if k not in self._before_programs]
            self._before_variables, self._before_programs = [], set()

    def release(self) -> None:
        """Stops the cell's run if still going; the replicator forgets the cell's state."""
        if self.run is not None and not self.run.ended:
            self.run.stop()
            try:
                self.run.wait(STOP_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the old run's failure is not this cell's error
                pass
        self.close()
        owned = {id(v) for v in self.variables}
        # in place: repl.context() appends to this very list object
        self.repl._created_variables[:] = [v for v in self.repl._created_variables if id(v) not in owned]
        programs = [self.repl._programs.pop(key) for key in self.programs if key in self.repl._programs]
        if self.run is None or self.run.ended:  # a run that would not stop keeps its iterator
            reaper.discard_programs(programs)  # no 10-40 s freeze when their iterators are deleted


@contextlib.contextmanager
def owned_by_cell(repl, key: str | None):
    """Releases what the previous execution of cell `key` left on `repl`, then records this one.

    Yields the record; call `record.track(run)` for a run started inside. The window closes on
    exit unless a tracked run is still running (then it closes when that run ends).
    """
    with _lock:
        ledger = _ledgers.setdefault(repl, {})
        previous = ledger.pop(key, None)
    if previous is not None:
        previous.release()
    record = _Owned(repl)
    with _lock:
        ledger[key] = record
    try:
        yield record
    finally:
        if record.run is None or record.run.ended:
            record.close()
