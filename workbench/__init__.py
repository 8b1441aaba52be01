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
from workbench._src.backends.mirrored import MultiGpuReplicator
from workbench._src.backends.single import NonReplicator
from workbench._src.backends.tpu import TpuReplicator
from workbench._src.errors import (
    ConfigurationError,
    DeviceError,
    InputError,
    NonFiniteError,
    ReplicaContextError,
    StepFunctionError,
    TpuUnavailableError,
    WorkbenchError,
)
from workbench._src.inputs import InputContext, InputReplication
from workbench._src.replicator import Replicator
from workbench._src.run import Event, Run
from workbench._src.tf_setup import configure_devices, device_summary

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "DeviceError",
    "Event",
    "InputContext",
    "InputError",
    "InputReplication",
    "MultiGpuReplicator",
    "NonFiniteError",
    "NonReplicator",
    "ReplicaContextError",
    "Replicator",
    "Run",
    "StepFunctionError",
    "TpuReplicator",
    "TpuUnavailableError",
    "WorkbenchError",
    "configure_devices",
    "device_summary",
    "replicator",
]
