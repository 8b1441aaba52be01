"""Backends by name: `wb.replicator("mirrored", num_replicas=4)`."""

from __future__ import annotations

from workbench._src.core.errors import ConfigurationError, check_positive_int

# name -> (module, class, what it is).
BACKENDS = {
    "single": ("workbench._src.backends.single", "NonReplicator", "one device"),
    "mirrored": (
        "workbench._src.backends.mirrored",
        "MultiGpuReplicator",
        "synchronous, all local GPUs or virtual CPUs",
    ),
    "multi-worker": (
        "workbench._src.backends.multi_worker",
        "MultiWorkerReplicator",
        "synchronous all-reduce across worker processes",
    ),
    "async-ps": (
        "workbench._src.backends.async_ps",
        "MultiWorkerAsyncReplicator",
        "asynchronous workers with parameter servers",
    ),
    "tpu": ("workbench._src.backends.tpu", "TpuReplicator", "synchronous on TPU cores"),
}


def backend_class(name: str):
    import importlib

    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key not in BACKENDS:
        valid = "\n".join(f"  {n!r:14} {d}" for n, (_, _, d) in BACKENDS.items())
        raise ConfigurationError(
            f"Unknown replicator backend {name!r}. Valid names:\n{valid}\n"
            "Example: wb.replicator('mirrored', num_replicas=4)."
        )
    module, cls, _ = BACKENDS[key]
    return getattr(importlib.import_module(module), cls)


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
    cls = backend_class(name)
    if num_replicas is not None:
        fix = {
            "single": "leave num_replicas out ('single' runs one replica)",
            "tpu": "leave num_replicas out ('tpu' uses every core of the TPU)",
        }.get(cls.backend, f"wb.replicator({cls.backend!r}, num_replicas=2), or leave it out for all devices")
        check_positive_int("num_replicas", num_replicas, fix=fix)
    return cls.from_replicas(num_replicas, **kwargs)
