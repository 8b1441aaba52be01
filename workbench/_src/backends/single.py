"""NonReplicator: one replica on one device, the reference every other backend is checked against."""

from __future__ import annotations

from workbench._src.core.errors import ConfigurationError, check_positive_int
from workbench._src.core.replicator import Replicator
from workbench._src.core.tf_setup import accelerator_devices, tf


class NonReplicator(Replicator):
    """Runs step_fn once per step on one device (the first GPU, else the CPU).

    Same API as every replicator, so code written against it runs unchanged on the others.
    """

    backend = "single"

    def __init__(self, device: str | None = None, **input_options):
        super().__init__(**input_options)
        self.device = device

    @classmethod
    def from_replicas(cls, num_replicas=None, **kwargs):
        if num_replicas is not None:
            check_positive_int(
                "num_replicas", num_replicas, fix="leave num_replicas out: 'single' runs one replica"
            )
        if num_replicas not in (None, 1):
            raise ConfigurationError(
                f"The 'single' backend runs exactly one replica; received num_replicas="
                f"{num_replicas}. Fix: use wb.replicator('mirrored', num_replicas={num_replicas})."
            )
        return cls(**kwargs)

    def _make_strategy(self):
        device = self.device or accelerator_devices()[0]
        return tf().distribute.OneDeviceStrategy(device)

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "num_replicas": 1,
            "devices": [self.strategy.extended.worker_devices[0]],
        }
