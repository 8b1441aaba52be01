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

from workbench._src.backends import replicator
from workbench._src.backends.async_ps import MultiWorkerAsyncReplicator
from workbench._src.backends.mirrored import MultiGpuReplicator
from workbench._src.backends.multi_worker import MultiWorkerReplicator
from workbench._src.backends.single import NonReplicator
from workbench._src.backends.tpu import TpuReplicator
from workbench._src.core.errors import (
    ConfigurationError,
    DeviceError,
    InputError,
    NonFiniteError,
    ReplicaContextError,
    StepFunctionError,
    TpuUnavailableError,
    WorkbenchError,
    WorkerError,
)
from workbench._src.core.inputs import InputContext, InputReplication
from workbench._src.core.replicator import Replicator
from workbench._src.core.run import Event, Run
from workbench._src.core.tf_setup import configure_devices, device_summary
from workbench._src.placements.ray.cluster import RayCluster
from workbench._src.notebook.extension import (
    current,
    load_ipython_extension,
    load_run,
    runs,
    set_runs_dir,
    ui,
    use,
)
from workbench._src.numerics.batchnorm import CrossReplicaBatchNorm
from workbench._src.numerics.batchnorm_report import BatchNormReport, batchnorm_report
from workbench._src.numerics.differences import compare_numerics, plot_numerics
from workbench._src.numerics.loss_scaling import LossScalingReport, check_loss_scaling
from workbench._src.store.compare import Comparison, compare_runs
from workbench._src.store.runhistory import delete_runs, rename_run, tag_run
from workbench._src.studies.scaling import ScalingStudy, scaling_study

__version__ = "0.1.0"

__all__ = [
    "BatchNormReport",
    "Comparison",
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
