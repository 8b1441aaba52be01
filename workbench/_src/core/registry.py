"""The backends: one declaration each, and the only place that knows them by name.

A backend is its in-process class (a strategy and a device map: `single.py`, `mirrored.py`, ...)
plus what the rest of the workbench needs to know about it without importing TensorFlow: which
counts it takes, whether its replicas step together, whether its steps run in processes started
from the notebook (a launch plan), and what makes it unavailable here. The session, the panel,
the magic, the CLI, the studies and the Program read these capabilities; none of them compares
a backend's name.

Adding a backend is one module (its Replicator subclass) and one `BackendSpec` here (or a
`register(...)` call, as tests/test_toy_backend.py does).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable

from workbench._src.core.errors import ConfigurationError, check_positive_int
from workbench._src.core.tf_setup import tf


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What the workbench knows about one backend.

    Attributes:
      name: the backend's name (`wb.replicator(name)`, `--backend name`).
      cls: "module:Class" of its in-process Replicator subclass (imported when first used).
      description: one line, for errors, `--help` and the panel.
      synchronous: every replica takes one step together (cross-replica primitives exist; a
        scaling study can measure it).
      takes_replicas: `num_replicas` picks devices of one process (the panel's replica slider).
      takes_workers: `num_workers` processes (the magic's and CLI's --workers).
      takes_ps: `num_ps` parameter servers (--ps).
      in_processes: with no real cluster given, its steps run in processes the notebook starts
        (the notebook holds a RemoteReplicator; the class provides a `launch_plan`).
      local_rows: the fused loop keeps each replica's metric rows on its device and sums them
        once per chunk (the strategy gives local results in device order); False keeps the
        per-step reduce (TPU; async-ps, where one process coordinates remote workers).
      fixed_replicas: the replica count when it is not the user's to choose (single: 1).
      threads_option: the constructor's option for TensorFlow threads per process (--threads).
      replicas_fix: what to say when `num_replicas` is given wrongly.
      unavailable: a cheap function returning why the backend cannot run here, or None.
    """

    name: str
    cls: str
    description: str
    synchronous: bool = True
    takes_replicas: bool = False
    takes_workers: bool = False
    takes_ps: bool = False
    in_processes: bool = False
    local_rows: bool = True
    fixed_replicas: int | None = None
    threads_option: str | None = None
    replicas_fix: str | None = None
    unavailable: Callable[[], str | None] | None = None

    def replicator_class(self):
        module, name = self.cls.split(":")
        return getattr(importlib.import_module(module), name)

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot be chosen here and now, or None when it can."""
        return self.unavailable() if self.unavailable is not None else None


def _tpu_unavailable() -> str | None:
    if os.environ.get("TPU_NAME"):
        return None

    if not tf().config.list_logical_devices("TPU"):
        return "no TPU in this process and TPU_NAME is not set"
    return None


# In the order the panel and the errors list them.
BACKENDS: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> BackendSpec:
    """Adds (or replaces) a backend; returns its spec."""
    BACKENDS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    BACKENDS.pop(name, None)


register(
    BackendSpec(
        "single",
        "workbench._src.backends.single:NonReplicator",
        "one device",
        fixed_replicas=1,
        replicas_fix="leave num_replicas out ('single' runs one replica)",
    )
)
register(
    BackendSpec(
        "mirrored",
        "workbench._src.backends.mirrored:MultiGpuReplicator",
        "synchronous, all local GPUs or virtual CPUs",
        takes_replicas=True,
    )
)
register(
    BackendSpec(
        "multi-worker",
        "workbench._src.backends.multi_worker:MultiWorkerReplicator",
        "synchronous all-reduce across worker processes",
        takes_workers=True,
        in_processes=True,
        threads_option="threads_per_worker",
    )
)
register(
    BackendSpec(
        "async-ps",
        "workbench._src.backends.async_ps:MultiWorkerAsyncReplicator",
        "asynchronous workers with parameter servers",
        synchronous=False,
        takes_workers=True,
        takes_ps=True,
        in_processes=True,
        local_rows=False,
        threads_option="threads_per_server",
    )
)
register(
    BackendSpec(
        "tpu",
        "workbench._src.backends.tpu:TpuReplicator",
        "synchronous on TPU cores",
        replicas_fix="leave num_replicas out ('tpu' uses every core of the TPU)",
        local_rows=False,
        unavailable=_tpu_unavailable,
    )
)


DEFAULT = "mirrored"  # the session's backend until one is chosen; the panel's "sync"
DEFAULT_ASYNC = "async-ps"  # the panel's "async"


def spec(name: str, *, example: str = "wb.replicator('mirrored', num_replicas=4)") -> BackendSpec:
    """The spec of backend `name` ('Multi_Worker' and 'multi-worker' are the same); one error for
    names nobody knows, wherever the name came from (`example` shows the caller's syntax)."""
    if not isinstance(name, str):
        raise ConfigurationError(f"A backend is a name such as 'mirrored'; received {name!r}.")
    key = name.strip().lower().replace("_", "-")
    if key not in BACKENDS:
        valid = "\n".join(f"  {n!r:14} {s.description}" for n, s in BACKENDS.items())
        raise ConfigurationError(
            f"Unknown replicator backend {name!r}. Valid names:\n{valid}\nExample: {example}."
        )
    return BACKENDS[key]


def names(**capabilities) -> tuple[str, ...]:
    """The backends with these capabilities, e.g. names(takes_workers=True)."""
    return tuple(n for n, s in BACKENDS.items() if all(getattr(s, k) == v for k, v in capabilities.items()))


def backend_class(name: str):
    """The in-process Replicator class of backend `name`."""
    return spec(name).replicator_class()


def replicator(name: str = "mirrored", num_replicas: int | None = None, **kwargs):
    """Makes a replicator by backend name.

    Args:
      name: one of "single", "mirrored", "multi-worker", "async-ps", "tpu" (see BACKENDS).
      num_replicas: replicas to run (mirrored: devices / num_gpus_per_replica); None for all.
      **kwargs: passed to the backend class (e.g. num_gpus_per_replica=2, input_replication).

    Example:
      >>> import workbench as wb
      >>> wb.replicator("mirrored", num_replicas=2).num_replicas
      2
    """
    backend = spec(name)
    if num_replicas is not None:
        fix = backend.replicas_fix or (
            f"wb.replicator({backend.name!r}, num_replicas=2), or leave it out for all devices"
        )
        check_positive_int("num_replicas", num_replicas, fix=fix)
    return backend.replicator_class().from_replicas(num_replicas, **kwargs)


def check_counts(
    backend: BackendSpec, num_replicas=None, num_workers=None, num_ps=None, min_workers=None
) -> None:
    """The counts a user gave fit the backend (the magic's, the panel's and the CLI's check)."""
    for name, value in (
        ("replicas", num_replicas),
        ("workers", num_workers),
        ("ps", num_ps),
        ("min-workers", min_workers),
    ):
        if value is not None:
            check_positive_int(f"--{name}", value, fix=f"--{name} 2")
    if min_workers is not None and not (backend.takes_workers and backend.synchronous):
        raise ConfigurationError(
            f"--min-workers (elastic worker counts) applies to synchronous runs on worker processes "
            f"(multi-worker), whose every worker takes a share of each step; received "
            f"backend={backend.name!r} with min-workers={min_workers}. Fix: --backend multi-worker, "
            "or drop --min-workers (an async-ps run already goes on without a lost worker)."
        )
    if min_workers is not None and min_workers > (num_workers or 2):
        raise ConfigurationError(
            f"--min-workers is the fewest workers an elastic run goes on with, so it cannot exceed "
            f"--workers; received --workers {num_workers or 2}{'' if num_workers else ' (the default)'}, "
            f"--min-workers {min_workers}. Fix: --workers {min_workers} or more, or a smaller --min-workers."
        )
    if num_workers is not None and not backend.takes_workers:
        takers = " and ".join(names(takes_workers=True))
        raise ConfigurationError(
            f"--workers applies to the {takers} backends; received backend={backend.name!r} with "
            f"workers={num_workers}. Fix: drop --workers, or use --backend multi-worker (sync) or "
            "--backend async-ps (parameter servers)."
        )
    if num_ps is not None and not backend.takes_ps:
        raise ConfigurationError(
            f"--ps (parameter servers) applies to the {' and '.join(names(takes_ps=True))} backend; "
            f"received backend={backend.name!r} with ps={num_ps}. Fix: drop --ps, or use --backend async-ps."
        )


def check_cluster(backend: BackendSpec, cluster: str | None) -> None:
    """--cluster (a Ray cluster) applies to the backends of worker processes."""
    if cluster is not None and not backend.takes_workers:
        takers = " and ".join(names(takes_workers=True))
        raise ConfigurationError(
            f"--cluster places worker processes, which the {backend.name} backend does not have; "
            f"received backend={backend.name!r} with --cluster {cluster}. Fix: --backend {takers}, "
            "or drop --cluster to use this machine's devices."
        )
