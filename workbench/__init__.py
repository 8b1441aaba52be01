"""Replicator Workbench: run a single-device TensorFlow step on many devices, from a notebook.

The TF-Replicator programming model over tf.distribute:

    import workbench as wb
    repl = wb.replicator("mirrored", num_replicas=4)
    with repl.context():
        model = make_model()
        optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))
    run = repl.train(step_fn, input_fn, steps=300)
    run.history

Importing this package does not import TensorFlow; the first function that needs it does.
"""

# The one module imported with the package: it installs the hook that holds back TensorFlow's
# start-up lines when the user's own `import tensorflow` comes after `import workbench` (the
# README's order), which lazy names alone would not (core/tf_setup.py; a few ms, no TensorFlow).
from workbench._src.core import tf_setup as _tf_setup  # noqa: F401

# Each public name and the module that defines it, imported when the name is first used
# (PEP 562): `import workbench` itself loads no TensorFlow, numpy or pandas, and only the modules
# of the names a notebook uses. `__all__` lists them as before; `from workbench import *` and
# `dir(workbench)` see them all.
_PUBLIC = {
    "replicator": "workbench._src.core.registry",
    "MultiWorkerAsyncReplicator": "workbench._src.backends.async_ps",
    "MultiGpuReplicator": "workbench._src.backends.mirrored",
    "MultiWorkerReplicator": "workbench._src.backends.multi_worker",
    "NonReplicator": "workbench._src.backends.single",
    "TpuReplicator": "workbench._src.backends.tpu",
    "CapacityError": "workbench._src.core.errors",
    "ConfigurationError": "workbench._src.core.errors",
    "DeviceError": "workbench._src.core.errors",
    "InputError": "workbench._src.core.errors",
    "NonFiniteError": "workbench._src.core.errors",
    "ReplicaContextError": "workbench._src.core.errors",
    "StepFunctionError": "workbench._src.core.errors",
    "TpuUnavailableError": "workbench._src.core.errors",
    "WorkbenchError": "workbench._src.core.errors",
    "WorkerError": "workbench._src.core.errors",
    "InputContext": "workbench._src.core.inputs",
    "InputReplication": "workbench._src.core.inputs",
    "Replicator": "workbench._src.core.replicator",
    "Event": "workbench._src.core.run",
    "Run": "workbench._src.core.run",
    "configure_devices": "workbench._src.core.tf_setup",
    "device_summary": "workbench._src.core.tf_setup",
    "RayCluster": "workbench._src.placements.ray.cluster",
    "current": "workbench._src.notebook.extension",
    "load_ipython_extension": "workbench._src.notebook.extension",
    "load_run": "workbench._src.notebook.extension",
    "runs": "workbench._src.notebook.extension",
    "set_runs_dir": "workbench._src.notebook.extension",
    "ui": "workbench.ui",  # (the subpackage itself)
    "use": "workbench._src.notebook.extension",
    "CrossReplicaBatchNorm": "workbench._src.numerics.batchnorm",
    "BatchNormReport": "workbench._src.numerics.batchnorm_report",
    "batchnorm_report": "workbench._src.numerics.batchnorm_report",
    "compare_numerics": "workbench._src.numerics.differences",
    "plot_numerics": "workbench._src.numerics.differences",
    "LossScalingReport": "workbench._src.numerics.loss_scaling",
    "check_loss_scaling": "workbench._src.numerics.loss_scaling",
    "Comparison": "workbench._src.store.compare",
    "compare_runs": "workbench._src.store.compare",
    "delete_runs": "workbench._src.store.runhistory",
    "rename_run": "workbench._src.store.runhistory",
    "tag_run": "workbench._src.store.runhistory",
    "ScalingStudy": "workbench._src.studies.scaling",
    "scaling_study": "workbench._src.studies.scaling",
}


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    import importlib

    imported = importlib.import_module(module)
    value = imported if module == f"{__name__}.{name}" else getattr(imported, name)
    globals()[name] = value  # (the next lookup is a plain attribute)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__version__ = "0.1.0"

__all__ = [
    "BatchNormReport",
    "Comparison",
    "CapacityError",
    "ConfigurationError",
    "CrossReplicaBatchNorm",
    "DeviceError",
    "Event",
    "InputContext",
    "InputError",
    "InputReplication",
    "LossScalingReport",
    "MultiGpuReplicator",
    "MultiWorkerAsyncReplicator",
    "MultiWorkerReplicator",
    "NonFiniteError",
    "NonReplicator",
    "RayCluster",
    "ReplicaContextError",
    "Replicator",
    "Run",
    "ScalingStudy",
    "StepFunctionError",
    "TpuReplicator",
    "TpuUnavailableError",
    "WorkbenchError",
    "WorkerError",
    "batchnorm_report",
    "check_loss_scaling",
    "compare_numerics",
    "compare_runs",
    "configure_devices",
    "current",
    "delete_runs",
    "device_summary",
    "load_ipython_extension",
    "load_run",
    "plot_numerics",
    "rename_run",
    "replicator",
    "runs",
    "scaling_study",
    "set_runs_dir",
    "tag_run",
    "ui",
    "use",
]
