"""Importing TensorFlow and fixing the device layout before TensorFlow initialises.

Virtual CPU devices stand in for accelerators on machines without any. TensorFlow only accepts
that configuration before its runtime starts (the first op, tensor or device listing), so every
workbench entry point imports TensorFlow through `tf()` here, which applies the layout first.

TensorFlow's start-up lines (absl banner, oneDNN, CUDA probe) are held back whenever TensorFlow
is imported after the workbench: by `tf()`, or by the user's own `import tensorflow` (or `import
keras`) after `import workbench`, through a one-shot import hook installed when this module is
imported. What TensorFlow printed before the workbench was imported cannot be taken back.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile
import threading

from workbench._src.core.errors import DeviceError

DEFAULT_VIRTUAL_CPUS = 8
TF_LOGS_ENV = "WORKBENCH_TF_LOGS"  # =1: show TensorFlow's start-up logs (CUDA probe, oneDNN, absl)

_lock = threading.Lock()
_requested_cpus: int | None = None  # set by configure_devices before TensorFlow starts
_configured = False
_module = None


def tf():
    """Returns the tensorflow module, with the workbench's device layout applied first."""
    if _module is not None:  # the fast path; also what traced code (autograph) sees
        return _module
    return _import_tensorflow()


def tf_logs_wanted() -> bool:
    """WORKBENCH_TF_LOGS=1: the user wants TensorFlow's own start-up logs (nothing is hidden)."""
    return os.environ.get(TF_LOGS_ENV, "").strip().lower() not in ("", "0", "false", "no")


def hold_back_cpp_logs(env) -> None:
    """TF_CPP_MIN_LOG_LEVEL=2 in `env` (os.environ, or a child's) unless one is set already (the
    user's is kept): TensorFlow's C++ INFO and WARNING lines held back. TensorFlow reads it at
    import, so the fork server's value must be its children's (placements/local/fork_server.py)."""
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _import_tensorflow():
    global _module
    if tf_logs_wanted():
        import tensorflow

        _apply_layout(tensorflow)
        _module = tensorflow
        return tensorflow
    # Before TensorFlow is imported, or it has no effect; a value the user set is kept.
    hold_back_cpp_logs(os.environ)
    import logging

    with _start_up_noise_hidden():
        import tensorflow

        _apply_layout(tensorflow)  # lists the GPUs: where CUDA's probe logs its errors

    # tf.distribute logs its device lists and reduction plans at INFO on the "tensorflow"
    # logger; in a notebook that lands under every cell. Keep warnings; a user who wants the
    # chatter sets the level back (tf.get_logger().setLevel("INFO")).
    tf_logger = logging.getLogger("tensorflow")
    if tf_logger.level in (logging.NOTSET, logging.INFO, logging.DEBUG):
        tf_logger.setLevel(logging.WARNING)
    tf_logger.addFilter(_own_retracing_hidden)
    _module = tensorflow
    return tensorflow


# Functions of ours compiled once per run by design (a checkpoint's save is compiled for its own
# variables): TensorFlow counts traces by the Python code, so from the 5th checkpointing run in a
# process it warned, in red, that this code "triggered tf.function retracing". The user's own
# functions still get the warning.
OWN_PER_RUN_FUNCTIONS = ("_single_file_write.<locals>.", "_copy_then_write.<locals>.")


def _own_retracing_hidden(record) -> bool:
    text = record.getMessage()
    return not ("triggered tf.function retracing" in text and any(f in text for f in OWN_PER_RUN_FUNCTIONS))


# `import tensorflow` imports Keras (TensorFlow's __init__ loads it eagerly), and Keras imports
# scikit-learn (for its scikit-learn wrappers) and matplotlib.pyplot (for its image-gallery
# plots), each under `try: ... except ImportError`. Together they are a third of the import:
# ~1.2 of ~3.8 CPU-seconds here (bench/bench_startup.py). A process the workbench launched (a
# worker, a coordinator, a TensorFlow server) serves steps and never uses either feature.
KERAS_EXTRAS = ("sklearn", "matplotlib")


@contextlib.contextmanager
def keras_extras_skipped():
    """Imports of TensorFlow inside this block leave out Keras's optional scikit-learn and
    matplotlib features (for launched processes only). The packages stay importable: only
    `keras.wrappers.SKLearn*` and `keras.visualization` lack them in this process; a later
    `import sklearn` or `import matplotlib` (a user's input_fn) works as usual."""
    hidden = [name for name in KERAS_EXTRAS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # Python's own "not importable" marker: ImportError, no search
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


# What TensorFlow's C++ side prints on every start of a CPU-only machine, before its log level
# applies (absl logs to stderr until initialised: the banner comes once per TensorFlow library).
_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|^[IWE]\d{4} [\d:.]+\s+\d+ (port\.cc|cudart_stub\.cc|cuda_platform\.cc|cuda_executor\.cc"
    r"|cuda_diagnostics\.cc|cuda_dnn\.cc|cuda_fft\.cc|cuda_blas\.cc|gpu_device\.cc|cpu_feature_guard\.cc)"
    r":\d+\]"
    r"|^To enable the following instructions: .* in other operations, rebuild TensorFlow"
    r"|^This TensorFlow binary is optimized to use available CPU instructions"
)


_holding = False  # a hold is active (tf() importing TensorFlow through the import hook)


@contextlib.contextmanager
def _start_up_noise_hidden():
    """Holds back what TensorFlow writes to file descriptor 2 while it starts, then passes on
    every line but the known start-up noise (the absl banner, oneDNN and CUDA probe lines,
    `failed call to cuInit`). In a kernel, fd 2 is what the notebook shows in red."""
    global _holding
    if _holding:  # already held by an outer hold
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2 (an embedded interpreter)
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        _holding = True
        try:
            yield
        finally:
            _holding = False
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", "replace")
            kept = [line for line in text.splitlines() if line.strip() and not _NOISE.search(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
    """Holds back TensorFlow's start-up lines when anyone imports it after the workbench.

    The README's quickstart (`import workbench as wb` then `import tensorflow as tf, keras`)
    imports TensorFlow itself, not through `tf()`: this finder sees that first import of
    `tensorflow`, leaves finding it to the other finders, and runs the module's import under
    `_start_up_noise_hidden()` (with TF_CPP_MIN_LOG_LEVEL=2 unless set). It removes itself
    after that one import; it never imports anything on its own.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensorflow":
            return None
        _remove_import_hook()
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and not tf_logs_wanted():
            spec.loader = _HeldLoader(spec.loader)
        return spec


class _HeldLoader(importlib.abc.Loader):
    """TensorFlow's own loader, with the module's execution under the start-up hold."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        hold_back_cpp_logs(os.environ)
        with _start_up_noise_hidden():
            self._loader.exec_module(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: TensorFlow's loader's
        return getattr(self._loader, name)


_import_hook = _QuietTensorFlowImport()


def _remove_import_hook() -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_import_hook)


def _install_import_hook() -> None:
    if "tensorflow" not in sys.modules and not tf_logs_wanted() and _import_hook not in sys.meta_path:
        sys.meta_path.insert(0, _import_hook)


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
      >>> wb.configure_devices(cpus=8)["virtual_cpus"]
      8
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


def physical_gpu_count() -> int:
    """The GPUs TensorFlow sees (or would see) in this process. Without an NVIDIA driver
    (/proc/driver/nvidia) TensorFlow cannot see one, so this answers without importing it: a
    launcher that only needs the count (to give each worker its GPUs) does not wait seconds for
    an import its processes do anyway."""
    if _module is None and not os.path.isdir("/proc/driver/nvidia"):
        return 0
    return len(tf().config.list_physical_devices("GPU"))


def accelerator_devices() -> list[str]:
    """The devices mirrored replicas go on: GPUs when there are any, else the (virtual) CPUs."""
    t = tf()
    gpus = [d.name for d in t.config.list_logical_devices("GPU")]
    return gpus or [d.name for d in t.config.list_logical_devices("CPU")]


# `import workbench` imports this module: from then on TensorFlow starts quietly however it is
# imported (see _QuietTensorFlowImport). WORKBENCH_TF_LOGS=1 leaves every import alone.
_install_import_hook()
