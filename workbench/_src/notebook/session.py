"""The notebook session's replicator: one shared state for the magic, the panel and `wb.current()`.

`%replicate --backend mirrored --replicas 4`, a choice in `wb.ui.panel()` and
`wb.use("mirrored", num_replicas=4)` all land here, so whichever the user touched last is what
the next `%%replicate` cell or Run button trains on, and an open panel shows it.

Nothing here imports TensorFlow at import time; building a replicator does.
"""

from __future__ import annotations

from collections.abc import Callable

from workbench._src.core import registry
from workbench._src.core.current import (
    current,
    current_choice,
    current_or_none,
    forget,
    lock,
    observe,
    set_current,
)
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.replicator import Replicator
from workbench._src.placements.ray.cluster import RayCluster
from workbench._src.sinks import runstore
from workbench._src.sinks.dashboard import Dashboard

__all__ = [
    "choose",
    "current",
    "current_choice",
    "current_or_none",
    "equivalent_magic",
    "magic_line",
    "observe",
    "train",
    "use",
]

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
    min_workers: int | None = None,
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
      min_workers: multi-worker only: the fewest workers an elastic run goes on with when the
        cluster has no room for all (with max_restarts); see wb.MultiWorkerReplicator.

    Example:
      >>> import workbench as wb
      >>> wb.use("mirrored", num_replicas=2).num_replicas
      2
    """
    with lock:
        now, chosen = current_or_none(), current_choice()
        if backend is None:
            backend = (chosen or {}).get("backend") or getattr(now, "backend", None) or registry.DEFAULT
        backend = normalize_backend(backend)
        registry.check_counts(registry.spec(backend), num_replicas, num_workers, num_ps, min_workers)
        registry.check_cluster(registry.spec(backend), cluster)
        choice = {
            "backend": backend,
            "num_replicas": num_replicas,
            "num_workers": num_workers,
            "num_ps": num_ps,
            "cluster": cluster,
            "min_workers": min_workers,
        }
        if now is not None and choice == chosen:
            return now
        counts = (("num_workers", num_workers), ("num_ps", num_ps), ("min_workers", min_workers))
        extra = {k: v for k, v in counts if v is not None}
        if cluster is not None:
            extra["cluster"] = RayCluster.from_option(cluster)
        repl = registry.replicator(backend, num_replicas=num_replicas, **extra)
        set_current(repl, choice)
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
        set_current(replicator_or_backend, None)
        return replicator_or_backend
    workers, ps = options.pop("num_workers", None), options.pop("num_ps", None)
    if options:
        raise ConfigurationError(
            f"wb.use() takes num_replicas, num_workers and num_ps; received {sorted(options)}. "
            "Fix: for other backend options build the replicator yourself and pass it: "
            "wb.use(wb.replicator('mirrored', num_replicas=4, num_gpus_per_replica=2))."
        )
    return choose(replicator_or_backend, num_replicas, workers, ps)


def remember_replicate_cell(source: str) -> None:
    """The magic keeps the source of the last `%%replicate` cell it ran (transformed: magics and
    shell escapes inside are Python already): the panel trains a process backend with it."""
    global _last_cell
    _last_cell = source


def last_replicate_cell() -> str | None:
    return _last_cell


def reset() -> None:
    """Forgets the session's replicator (tests; a fresh start in a long-lived kernel)."""
    global _last_cell
    forget()
    _last_cell = None


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
    max_restarts: int | None = None,
    min_workers: int | None = None,
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
        ("--min-workers", min_workers),
        ("--ps", num_ps),
        ("--cluster", cluster),
        ("--steps", steps),
        ("--max-restarts", max_restarts),
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


def equivalent_magic(
    backend: str,
    replicas: int,
    workers: int,
    ps: int,
    cluster: str = "",
    *,
    steps: int,
    max_restarts: int = 0,
    min_workers: int | None = None,
) -> str:
    """The magic that does what Run does with this choice (the panel's counts that the backend
    takes). A process backend builds the model in each of its processes, from the cell that
    builds it (Run sends the last one): its line heads that `%%replicate` cell. Pasted as a line
    it would train notebook functions whose model lives here, which cannot travel."""
    spec = registry.spec(backend)
    counts = (
        replicas if spec.takes_replicas else None,
        workers if spec.takes_workers else None,
        ps if spec.takes_ps else None,
    )
    where = (cluster or None) if spec.takes_workers else None
    restarts = (max_restarts or None) if spec.takes_workers else None
    elastic = min_workers if spec.takes_workers and spec.synchronous else None
    return magic_line(
        backend, *counts, steps=steps, background=True, cluster=where, cell=spec.in_processes,
        max_restarts=restarts, min_workers=elastic,
    )  # fmt: skip
