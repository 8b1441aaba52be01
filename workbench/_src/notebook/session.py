"""The notebook session's replicator: one shared state for the magic, the panel and `wb.current()`.

`%replicate --backend mirrored --replicas 4`, a choice in `wb.ui.panel()` and
`wb.use("mirrored", num_replicas=4)` all land here, so whichever the user touched last is what
the next `%%replicate` cell or Run button trains on, and an open panel shows it.

Nothing here imports TensorFlow at import time; building a replicator does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from workbench._src.backends import registry
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.replicator import Replicator
from workbench._src.launch.ray_cluster import RayCluster
from workbench._src.sinks import runstore
from workbench._src.sinks.dashboard import Dashboard

_lock = threading.RLock()
_current = None  # the session's Replicator
_choice: dict | None = None  # the options it was built from; None when set as an object
_observers: list[Callable[[Any, dict | None], None]] = []
_last_cell: str | None = None  # the last %%replicate cell's source (the panel sends it to processes)


def normalize_backend(name: str) -> str:
    """'Multi_Worker' -> 'multi-worker'; raises ConfigurationError for names nobody knows."""
    return registry.spec(name, example="%replicate --backend mirrored --replicas 4").name


def choose(
    backend: str | None = None,
    num_replicas: int | None = None,
    num_workers: int | None = None,
    num_ps: int | None = None,
    cluster: str | None = None,
):
    """Sets the session's replicator by backend name; returns it. What `%replicate --backend` does.

    Choosing the same options again returns the same replicator, so variables created in its
    context stay usable; different options build a new one.

    Args:
      backend: a backend name; None keeps the session's backend ('mirrored' when none yet).
      num_replicas: replicas (None: every device the backend can use).
      num_workers: worker processes (multi-worker, async-ps only).
      num_ps: parameter servers (async-ps only).
      cluster: "ray", "ray=ADDRESS" or "ray=local": place the worker processes on a Ray cluster.

    Example:
      >>> import workbench as wb
      >>> wb.use("mirrored", num_replicas=2).num_replicas
      2
    """
    global _current, _choice
    with _lock:
        if backend is None:
            backend = (_choice or {}).get("backend") or getattr(_current, "backend", None) or registry.DEFAULT
        backend = normalize_backend(backend)
        registry.check_counts(registry.spec(backend), num_replicas, num_workers, num_ps)
        registry.check_cluster(registry.spec(backend), cluster)
        choice = {
            "backend": backend,
            "num_replicas": num_replicas,
            "num_workers": num_workers,
            "num_ps": num_ps,
            "cluster": cluster,
        }
        if _current is not None and choice == _choice:
            return _current
        extra = {k: v for k, v in (("num_workers", num_workers), ("num_ps", num_ps)) if v is not None}
        if cluster is not None:
            extra["cluster"] = RayCluster.from_option(cluster)
        repl = registry.replicator(backend, num_replicas=num_replicas, **extra)
        _set(repl, choice)
        return repl


def use(replicator_or_backend=None, num_replicas: int | None = None, **options):
    """Sets the session's replicator (by name, as `choose`, or an existing Replicator); returns it.

    Example:
      >>> import workbench as wb
      >>> repl = wb.use("mirrored", num_replicas=2)
      >>> wb.current() is repl
      True
    """

    if isinstance(replicator_or_backend, Replicator):
        if num_replicas is not None or options:
            raise ConfigurationError(
                "wb.use(replicator) takes no other options; received "
                f"num_replicas={num_replicas!r}, {options!r}. Fix: build the replicator with them."
            )
        with _lock:
            _set(replicator_or_backend, None)
        return replicator_or_backend
    workers, ps = options.pop("num_workers", None), options.pop("num_ps", None)
    if options:
        raise ConfigurationError(
            f"wb.use() takes num_replicas, num_workers and num_ps; received {sorted(options)}. "
            "Fix: for other backend options build the replicator yourself and pass it: "
            "wb.use(wb.replicator('mirrored', num_replicas=4, num_gpus_per_replica=2))."
        )
    return choose(replicator_or_backend, num_replicas, workers, ps)


def current():
    """The session's replicator: the last one chosen with %replicate, the panel or wb.use().

    Raises:
      ConfigurationError: when none has been chosen yet (the message says how).

    Example:
      >>> import workbench as wb
      >>> repl = wb.use("single")
      >>> wb.current().backend
      'single'
    """
    with _lock:
        if _current is None:
            raise ConfigurationError(
                "No replicator has been chosen in this session yet. Fix: run "
                "`%replicate --backend mirrored --replicas 4`, pick one in wb.ui.panel(), or call "
                "wb.use('mirrored', num_replicas=4)."
            )
        return _current


def current_or_none():
    """The session's replicator, or None (for the panel and the magic, which decide themselves)."""
    return _current


def current_choice() -> dict | None:
    """The options the session's replicator was chosen with (None if set as an object or unset)."""
    with _lock:
        return dict(_choice) if _choice else None


def remember_replicate_cell(source: str) -> None:
    """The magic keeps the source of the last `%%replicate` cell it ran (transformed: magics and
    shell escapes inside are Python already): the panel trains a process backend with it."""
    global _last_cell
    _last_cell = source


def last_replicate_cell() -> str | None:
    return _last_cell


def observe(callback: Callable[[Any, dict | None], None]) -> Callable[[], None]:
    """Calls callback(replicator, choice) whenever the session's replicator changes.

    Returns a function that removes the callback (an open panel uses this to follow the magic).
    """
    with _lock:
        _observers.append(callback)
    return lambda: _observers.remove(callback) if callback in _observers else None


def reset() -> None:
    """Forgets the session's replicator (tests; a fresh start in a long-lived kernel)."""
    global _current, _choice, _last_cell
    with _lock:
        _current, _choice, _last_cell = None, None, None


def magic_line(
    backend: str,
    num_replicas: int | None = None,
    num_workers: int | None = None,
    num_ps: int | None = None,
    steps: int | None = None,
    functions: tuple[str, str] | None = ("step_fn", "input_fn"),
    background: bool = False,
    cluster: str | None = None,
    cell: bool = False,
) -> str:
    """The `%replicate` line that does the same as these options (shown by the panel to copy);
    cell=True: the first line of a `%%replicate` cell (which names no functions)."""
    parts = ["%%replicate" if cell else "%replicate"]
    if functions and not cell:
        parts += list(functions)
    parts += ["--backend", backend]
    for flag, value in (
        ("--replicas", num_replicas),
        ("--workers", num_workers),
        ("--ps", num_ps),
        ("--cluster", cluster),
        ("--steps", steps),
    ):
        if value is not None:
            parts += [flag, str(value)]
    if background:
        parts.append("--background")
    return " ".join(parts)


def train(
    repl,
    step_fn: Callable,
    input_fn: Callable,
    steps: int,
    *,
    steps_per_execution: int | str = "auto",
    background: bool = False,
    live: bool = True,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    max_restarts: int = 0,
    logdir: str | None = None,
    dashboard=None,
    cell: str | None = None,
    namespace: dict | None = None,
    name: str | None = None,
    tags=(),
):
    """Trains as the magic and the panel do: recorded in the run store, with a live dashboard.

    The Python equivalent is `repl.train(step_fn, input_fn, steps, sinks=[wb.ui.dashboard()])`
    after `%load_ext workbench` (which turns on the run store).

    Args:
      live: show the live dashboard and progress bar (a new one, displayed now).
      logdir: record this run under logdir/<run id> instead of the runs directory.
      dashboard: an existing Dashboard sink to use instead of a new one (the panel's).
      cell, namespace: a %%replicate cell's source and the notebook namespace, for backends
        whose steps run in other processes (multi-worker): the source travels, not functions.
      name, tags: the run's name (unique in the run store) and tags (`--name`, `--tags`).
      checkpoint_every, max_restarts: as repl.train's (`--checkpoint-every`, `--max-restarts`).
    """

    runstore.install()
    if dashboard is None and live:
        dashboard = Dashboard()
    sinks = [dashboard] if dashboard is not None else []
    try:
        with runstore.directory(logdir):
            options = dict(
                steps_per_execution=steps_per_execution,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every=checkpoint_every,
                max_restarts=max_restarts,
                background=background,
                sinks=sinks,
                name=name,
                tags=tuple(tags or ()),
            )
            if cell is not None and repl.runs_in_processes:
                # process backends from a notebook: the cell's source runs in every process
                run = repl.train_cell(cell, namespace, steps, **options)
            else:
                run = repl.train(step_fn, input_fn, steps, **options)
    except BaseException:
        if dashboard is not None and not dashboard.started:
            dashboard.close()  # the run never started: leave no empty dashboard behind
        raise
    if background and dashboard is not None:
        dashboard.attach_stop(run.stop)
    return run


def _set(repl, choice: dict | None) -> None:
    global _current, _choice
    old, _current, _choice = _current, repl, choice
    if old is not None and old is not repl and getattr(old, "runs_in_processes", False):
        # The replaced replicator's warm worker pool would hold memory for nothing; one of the
        # same shape is the new replicator's too (launch/pool.py), so that one stays.
        if getattr(repl, "pool_shape", None) != old.pool_shape:
            old.shutdown()
    for callback in list(_observers):
        try:
            callback(repl, choice)
        except Exception:  # noqa: BLE001 - a closed panel must not break %replicate
            pass
