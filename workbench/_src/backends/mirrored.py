"""MultiGpuReplicator: synchronous replicas on the local GPUs, or on virtual CPUs without GPUs."""

from __future__ import annotations

from workbench._src.core.errors import ConfigurationError, DeviceError, check_positive_int
from workbench._src.core.replicator import Replicator
from workbench._src.core.tf_setup import accelerator_devices, tf, too_late_error


class MultiGpuReplicator(Replicator):
    """In-graph replication over local devices with MirroredStrategy.

    Args:
      num_gpus: devices to use; None for all (all GPUs, else all virtual CPU devices).
      num_gpus_per_replica: devices per replica, for model parallelism with
        `repl.logical_device(i)`; num_gpus must be a multiple of it.
      input_replication / input_split_fn: see wb.InputReplication.

    Each replica's variables live on its first device. Gradients and primitives are reduced
    without NCCL on CPUs (ReductionToOneDevice), which also lets one process switch freely
    between replica counts and device subsets (a scaling study does exactly that).
    """

    backend = "mirrored"

    def __init__(self, num_gpus: int | None = None, num_gpus_per_replica: int = 1, **input_options):
        super().__init__(**input_options)
        if num_gpus is not None:
            check_positive_int(
                "num_gpus", num_gpus, fix="MultiGpuReplicator(num_gpus=2), or None for all devices"
            )
        check_positive_int(
            "num_gpus_per_replica", num_gpus_per_replica, fix="num_gpus_per_replica=1 (the default)"
        )
        if num_gpus is not None and num_gpus % num_gpus_per_replica:
            raise ConfigurationError(
                f"num_gpus={num_gpus} is not a multiple of num_gpus_per_replica="
                f"{num_gpus_per_replica}; every replica needs the same number of devices."
            )
        self.num_gpus = num_gpus
        self.num_gpus_per_replica = num_gpus_per_replica
        self._devices = self._pick_devices()

    @classmethod
    def from_replicas(cls, num_replicas=None, num_gpus_per_replica=1, **kwargs):
        # Checked here, under the names the caller typed: num_gpus is derived from them.
        if num_replicas is not None:
            check_positive_int(
                "num_replicas", num_replicas, fix="num_replicas=2, or leave it out for all devices"
            )
        check_positive_int(
            "num_gpus_per_replica", num_gpus_per_replica, fix="num_gpus_per_replica=1 (the default)"
        )
        num_gpus = None if num_replicas is None else num_replicas * num_gpus_per_replica
        return cls(num_gpus=num_gpus, num_gpus_per_replica=num_gpus_per_replica, **kwargs)

    def _pick_devices(self) -> list[str]:
        available = accelerator_devices()
        wanted = self.num_gpus or len(available) // self.num_gpus_per_replica * self.num_gpus_per_replica
        if wanted > len(available) or wanted == 0:
            kind = "GPU" if "GPU" in available[0] else "CPU"
            if kind == "CPU":
                if len(available) == 1:
                    raise too_late_error(wanted=wanted, have=1)
                fix = (
                    f"ask for at most {len(available)}, or restart and call "
                    f"wb.configure_devices(cpus={wanted}) before any TensorFlow code"
                )
            else:
                fix = f"ask for at most {len(available)} GPU(s)"
            raise DeviceError(
                f"MultiGpuReplicator needs {wanted} devices ({wanted // self.num_gpus_per_replica} "
                f"replicas x {self.num_gpus_per_replica} per replica) but this process has "
                f"{len(available)} {kind} device(s): {available}. Fix: {fix}."
            )
        return available[:wanted]

    def _make_strategy(self):
        t = tf()
        primaries = self._devices[:: self.num_gpus_per_replica]
        on_gpus = "GPU" in primaries[0]
        cross_device_ops = None if on_gpus else t.distribute.ReductionToOneDevice()
        return t.distribute.MirroredStrategy(primaries, cross_device_ops=cross_device_ops)

    def _logical_devices(self, primary_device: str) -> list[str]:
        spec = tf().DeviceSpec.from_string(primary_device)
        for start in range(0, len(self._devices), self.num_gpus_per_replica):
            first = tf().DeviceSpec.from_string(self._devices[start])
            if (first.device_type, first.device_index) == (spec.device_type, spec.device_index):
                return self._devices[start : start + self.num_gpus_per_replica]
        raise DeviceError(f"{primary_device} is not one of this replicator's devices {self._devices}.")

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "num_replicas": len(self._devices) // self.num_gpus_per_replica,
            "num_gpus_per_replica": self.num_gpus_per_replica,
            "devices": list(self._devices),
        }
