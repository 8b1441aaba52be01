"""TpuReplicator: TPUStrategy, or a clear error where no TPU is reachable."""

from __future__ import annotations

import os

from workbench._src.core.errors import ConfigurationError, TpuUnavailableError, check_positive_int
from workbench._src.core.replicator import Replicator
from workbench._src.core.tf_setup import tf


class TpuReplicator(Replicator):
    """Synchronous replicas on the cores of a TPU (a Cloud TPU VM, a pod slice, Colab).

    Args:
      tpu: the TPU's name or grpc address, as TPUClusterResolver takes it; None for a TPU
        attached to this machine (TPU VM) or named by the TPU_NAME environment variable.
    """

    backend = "tpu"

    def __init__(self, tpu: str | None = None, **input_options):
        super().__init__(**input_options)
        self.tpu = tpu
        _ = self.strategy  # connect now: a missing TPU should fail here, not at the first step

    @classmethod
    def from_replicas(cls, num_replicas=None, **kwargs):
        if num_replicas is not None:
            check_positive_int(
                "num_replicas", num_replicas, fix="leave num_replicas out: 'tpu' uses every core"
            )
            raise ConfigurationError(
                "The 'tpu' backend uses every core of the TPU it connects to; received "
                f"num_replicas={num_replicas}. Fix: leave num_replicas out."
            )
        return cls(**kwargs)

    def _make_strategy(self):
        t = tf()
        local = t.config.list_logical_devices("TPU")
        if self.tpu is None and not local and not os.environ.get("TPU_NAME"):
            raise _unavailable(self.tpu, "no TPU device in this process and TPU_NAME is not set")
        try:
            resolver = t.distribute.cluster_resolver.TPUClusterResolver(tpu=self.tpu or "")
            if not local:
                t.config.experimental_connect_to_cluster(resolver)
            t.tpu.experimental.initialize_tpu_system(resolver)
        except Exception as e:  # TensorFlow raises several unrelated types here
            raise _unavailable(self.tpu, f"{type(e).__name__}: {e}") from None
        return t.distribute.TPUStrategy(resolver)

    def describe(self) -> dict:
        return {"backend": self.backend, "num_replicas": self.num_replicas, "tpu": self.tpu}


def _unavailable(tpu, why: str) -> TpuUnavailableError:
    return TpuUnavailableError(
        f"No TPU is reachable from this process (tpu={tpu!r}: {why}). The TPU backend needs a "
        "Cloud TPU VM, a TPU named by tpu=... or TPU_NAME, or a TPU runtime in Colab. Fix: run "
        "there, or use wb.replicator('mirrored') for local GPUs / virtual CPUs (same step_fn)."
    )
