"""Importing TensorFlow and fixing the device layout before TensorFlow initialises.

Virtual CPU devices stand in for accelerators on machines without any. TensorFlow only accepts
that configuration before its runtime starts (the first op, tensor or device listing), so every
workbench entry point imports TensorFlow through `tf()` here, which applies the layout first.
"""

from __future__ import annotations

import os
import threading

from workbench._src.errors import DeviceError

DEFAULT_VIRTUAL_CPUS = 8

_lock = threading.Lock()
_requested_cpus: int | None = None  # set by configure_devices before TensorFlow starts
_configured = False
_module = None


def tf():
    """Returns the tensorflow module, with the workbench's device layout applied first."""
    if _module is not None:  # the fast path; also what traced code (autograph) sees
        return _module
    return _import_tensorflow()


def _import_tensorflow():
    global _module
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep CUDA-probe noise out of notebooks
    import logging

    import tensorflow

    # tf.distribute logs its device lists and reduction plans at INFO on the "tensorflow"
    # logger; in a notebook that lands under every cell. Keep warnings; a user who wants the
    # chatter sets the level back (tf.get_logger().setLevel("INFO")).
    tf_logger = logging.getLogger("tensorflow")
    if tf_logger.level in (logging.NOTSET, logging.INFO, logging.DEBUG):
        tf_logger.setLevel(logging.WARNING)
    _apply_layout(tensorflow)
    _module = tensorflow
    return tensorflow


def configure_devices(cpus: int | None = None) -> dict:
    """Splits the CPU into `cpus` virtual devices so mirrored replicas have somewhere to run.

    Call it before anything touches TensorFlow (first cell of a notebook). It is done
    automatically with 8 virtual CPUs when a workbench function first needs TensorFlow on a
    machine without GPUs; call it yourself for another count.

    Args:
      cpus: number of virtual CPU devices; default 8 when there is no GPU, 1 otherwise.

    Returns:
      `device_summary()`: what this process can now use.

    Example:
      >>> import workbench as wb
      >>> wb.configure_devices(cpus=4)["virtual_cpus"]
      4
    """
    global _requested_cpus
    if cpus is not None and (not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1):
        raise DeviceError(
            f"configure_devices(cpus=...) takes a positive integer; received cpus={cpus!r}. "
            "Example: wb.configure_devices(cpus=8)."
        )
    with _lock:
        if _configured:
            have = _logical_cpu_count()
            if cpus is not None and cpus != have:
                raise too_late_error(wanted=cpus, have=have)
        else:
            _requested_cpus = cpus
    tf()
    return device_summary()


def too_late_error(wanted: int, have: int) -> DeviceError:
    return DeviceError(
        f"TensorFlow was initialised with {have} CPU device(s) before the workbench could split "
        f"the CPU into {wanted} virtual devices (they can only be configured before the first "
        "TensorFlow op). Fix: restart the kernel (or process) and run "
        f"`import workbench as wb; wb.configure_devices(cpus={wanted})` (or `%load_ext workbench`) "
        "before any other TensorFlow code."
    )


def _apply_layout(tensorflow) -> None:
    global _configured
    with _lock:
        if _configured:
            return
        _configured = True
        if tensorflow.config.list_physical_devices("GPU"):
            return  # real accelerators: leave TensorFlow's own layout alone
        wanted = _requested_cpus or DEFAULT_VIRTUAL_CPUS
        cpu = tensorflow.config.list_physical_devices("CPU")[0]
        try:
            tensorflow.config.set_logical_device_configuration(
                cpu, [tensorflow.config.LogicalDeviceConfiguration()] * wanted
            )
        except RuntimeError:
            # TensorFlow already started: keep what it has; replicators that need more devices
            # raise too_late_error with the fix.
            pass


def _logical_cpu_count() -> int:
    return len(tf().config.list_logical_devices("CPU"))


def device_summary() -> dict:
    """What this process can run replicas on: GPUs, TPUs, virtual CPUs and physical cores."""
    t = tf()
    gpus = [d.name for d in t.config.list_logical_devices("GPU")]
    tpus = [d.name for d in t.config.list_logical_devices("TPU")]
    cpus = [d.name for d in t.config.list_logical_devices("CPU")]
    return {
        "gpus": gpus,
        "tpus": tpus,
        "cpus": cpus,
        "virtual_cpus": len(cpus),
        "physical_cores": os.cpu_count(),
        # 0: TensorFlow's default, one thread per core; replicas on virtual CPUs share this pool
        "intra_op_threads": t.config.threading.get_intra_op_parallelism_threads() or os.cpu_count(),
    }


def accelerator_devices() -> list[str]:
    """The devices mirrored replicas go on: GPUs when there are any, else the (virtual) CPUs."""
    t = tf()
    gpus = [d.name for d in t.config.list_logical_devices("GPU")]
    return gpus or [d.name for d in t.config.list_logical_devices("CPU")]
