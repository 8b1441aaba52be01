"""Helpers shared by the test modules (test modules never import each other).

Functions defined here travel to worker processes by value (cloudpickle): the workers cannot
import tests/.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import sys
import time
import uuid

import cloudpickle
import numpy as np
import psutil
import pytest

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CLUSTER_MODULES = (
    "workbench._src.placements.local.worker_main",
    "workbench._src.placements.local.server_main",
)
RNG = np.random.RandomState(0)
X = RNG.randn(64, 8).astype("float32")
Y = RNG.randn(64, 1).astype("float32")
W0 = RNG.randn(8, 1).astype("float32") * 0.1
GLOBAL_BATCH = 16

# TensorFlow's start-up noise, which the workbench holds back (README): an error-level
# TensorFlow/absl line (E1123 12:00:00.0 ... file.cc:52] ...) or the absl banner.
TF_NOISE = re.compile(r"^[EWF]\d{4} [\d:.]+|absl::InitializeLog|cuInit|^WARNING:absl", re.M)


def cluster_processes() -> list[str]:
    """This process's descendants running a workbench worker or server module (zombies excluded),
    as "pid status args" lines. Only what this test process started is looked at: other workbench
    users on the machine (another test run, a training job) must not make these checks fail."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            status, args = process.status(), " ".join(process.cmdline())
        except psutil.Error:  # ended meanwhile
            continue
        if status != psutil.STATUS_ZOMBIE and any(m in args for m in CLUSTER_MODULES):
            found.append(f"{process.pid} {status} {args}")
    return found


def adopt_orphans(on: bool) -> None:
    """Linux PR_SET_CHILD_SUBREAPER: a descendant whose parent died (a `workbench run` child, a
    killed kernel script) is re-parented to this process instead of init, so a worker it left
    behind is still among our descendants for cluster_processes."""
    import ctypes

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)


def make_model():
    import keras

    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(W0))]
    )


def regression_input_fn(ctx):
    import tensorflow as tf  # here: the network probes import this module and must stay quiet

    return tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(GLOBAL_BATCH)


def regression_model_and_step(repl, lr=0.05):
    """The regression model and an SGD step_fn for it (call inside repl.context())."""
    import keras

    model = make_model()
    opt = repl.wrap_optimizer(keras.optimizers.SGD(lr))

    def step_fn(x, y):
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.minimize(loss, model.trainable_variables, tape=tape)
        return {"loss": loss}

    return model, step_fn


def regression_setup(repl):
    _, step_fn = regression_model_and_step(repl)
    return step_fn, regression_input_fn


# How long a test waits for a run it expects to finish (after a fault it survives): only to keep a
# broken test from hanging. A stuck run fails on its own watch's rules; a slow one is a loaded
# machine (a 500-step async-ps run took over 300 s beside two TensorFlow jobs at load 20).
RUN_WAIT = 900.0


def wait_for_steps(run, steps, timeout=RUN_WAIT):
    """Waits while the run is running and short of `steps`. A run that is stuck fails on its own
    watch's rules (its start, its members' heartbeats, both stretched while a busy machine starves
    it); the timeout only keeps a broken test from hanging."""
    deadline = time.monotonic() + timeout
    while run.steps < steps and run.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.steps >= steps, f"run reached only step {run.steps}: {run.status} {run.stop_reason}"


def process_pid(run, role: str, index: int) -> int:
    """The pid of a process the run started (run.processes), never a scan of the machine."""
    return next(p["pid"] for p in run.processes if p["role"] == role and p["index"] == index)


PROCESS_CELL = """
import keras
import numpy as np
import tensorflow as tf

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.05))
features = np.random.RandomState(1).randn(256, 8).astype("float32")
targets = features @ np.linspace(-1, 1, 8, dtype="float32")[:, None]

def input_fn(ctx):
    return tf.data.Dataset.from_tensor_slices((features, targets)).repeat().batch(32)

def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    optimizer.minimize(loss, model.trainable_variables, tape=tape)
    return {"loss": loss}
"""


def host_addresses() -> list[str]:
    """This machine's own non-loopback IPv4 addresses (where an outsider would connect)."""
    found = []
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                found.append(a.address)
    return found


def connect_error(host: str, port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        return s.connect_ex((host, port))


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def shell_reply(kc, msg_id: str, timeout: float, what: str) -> dict:
    """A kernel client's shell reply to request `msg_id`. Replies to other requests are passed
    over: a kernel started under load can leave one (jupyter_client's wait_for_ready sends
    kernel_info again when a reply is late)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            reply = kc.get_shell_msg(timeout=min(1.0, max(0.01, deadline - time.time())))
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply
    raise AssertionError(f"the kernel did not finish {what} within {timeout} s")


def nan_after_fifty_setup(repl):
    import tensorflow as tf

    with repl.context():
        w = tf.Variable(0.0)

    def step_fn(x, y):
        import tensorflow as tf

        w.assign_add(1.0)
        return {"loss": tf.math.log(50.5 - w)}  # NaN once 50 steps have run, on any worker

    return step_fn, regression_input_fn


def hold_the_gil_busy(seconds: float) -> float:
    """One C call that keeps a CPU busy and never lets go of Python's GIL for about `seconds` of
    CPU time (a sum over a range: its time grows linearly with the range, so the aim is close);
    returns how long it held it. No other thread of the process runs meanwhile, heartbeats
    included. On a loaded machine the wall time is longer than the CPU time aimed at."""
    length, took = 1_000_000, 0.0
    while took < 0.2:  # measured on a call long enough to time well
        length *= 2
        started = time.process_time()
        sum(range(length))
        took = time.process_time() - started
    length = int(length * seconds / took)
    started = time.perf_counter()
    sum(range(length))
    return time.perf_counter() - started


def busy_worker_1_setup(seconds: float):
    def setup(repl):
        if repl.worker_id == 1:
            print(f"worker 1 held the GIL for {hold_the_gil_busy(seconds):.1f} s", flush=True)
        return regression_setup(repl)

    return setup


def asleep_worker_1_setup(seconds: int):
    """Worker 1 sleeps `seconds` in one C call that holds Python's GIL (libc's sleep through
    ctypes.PyDLL, which keeps it), as TensorFlow's calls that wait for a remote worker do: no
    other thread of the process runs meanwhile, heartbeats included, and it uses no CPU."""

    def setup(repl):
        if repl.worker_id == 1:
            import ctypes

            ctypes.PyDLL(None).sleep(seconds)
        return regression_setup(repl)

    return setup


# How long a comm message is waited for (LabFrontend.read): what a loaded machine stretches, not
# what the test checks.
MESSAGE_WAIT = 600.0


class LabFrontend:
    """What JupyterLab's side of the workbench comm does, over jupyter_client (`kc`, a kernel
    client): open it, send, read replies. The comm is the only stand-in: the kernel is real."""

    def __init__(self, kc, opened_by_kernel: bool = False):
        # A comm the kernel opens gets its id from the comm_open message read().
        self.kc, self.comm_id = kc, "" if opened_by_kernel else uuid.uuid4().hex

    def open(self) -> None:
        from workbench._src.notebook.labcomm import TARGET

        self._shell("comm_open", {"comm_id": self.comm_id, "target_name": TARGET, "data": {"type": "hello"}})

    def send(self, data: dict) -> None:
        self._shell("comm_msg", {"comm_id": self.comm_id, "data": data})

    def snapshots(self, until, timeout: float = MESSAGE_WAIT) -> list[dict]:
        """This comm's snapshots, in order, up to the first for which `until(snapshot)` holds
        (an "error" message fails the test)."""

        def done(kind, data):
            assert data.get("type") != "error", data
            return data.get("type") == "snapshot" and until(data)

        return [d for _, _, d in self.read(done, timeout) if d.get("type") == "snapshot"]

    def _shell(self, msg_type: str, content: dict) -> None:
        self.kc.shell_channel.send(self.kc.session.msg(msg_type, content))

    def read(self, until, timeout: float = MESSAGE_WAIT) -> list[tuple[float, str, dict]]:
        """This comm's messages (time, type, data) until `until(type, data)` holds (None: all
        that arrive within `timeout`). The default is a wait, not a timing check: at load 25 a
        kernel's `%load_ext workbench` took over 60 s to answer."""
        from workbench._src.notebook.labcomm import TARGET

        got, deadline = [], time.time() + timeout
        while time.time() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=min(1.0, max(0.01, deadline - time.time())))
            except queue.Empty:
                continue
            content = msg["content"]
            if msg["msg_type"] == "comm_open" and content.get("target_name") == TARGET and not self.comm_id:
                self.comm_id = content["comm_id"]  # the comm the kernel opened
            if msg["msg_type"].startswith("comm_") and content.get("comm_id") == self.comm_id:
                got.append((time.time(), msg["msg_type"], content.get("data") or {}))
                if until is not None and until(msg["msg_type"], got[-1][2]):
                    return got
        if until is None:
            return got
        raise AssertionError(f"no such message within {timeout} s; received {[m[1:] for m in got][-3:]}")


def checkpoint_floats(directory) -> dict:
    """Every float tensor of the latest checkpoint in `directory`, by its checkpoint key."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(directory))
    return {k: reader.get_tensor(k) for k, d in reader.get_variable_to_dtype_map().items() if d.is_floating}


def assert_same_checkpoints(a, b, atol=1e-6) -> None:
    """The latest checkpoints in folders a and b hold the same variables, within atol."""
    ta, tb = checkpoint_floats(a), checkpoint_floats(b)
    assert ta.keys() == tb.keys()
    worst = max(float(np.max(np.abs(ta[k] - tb[k]))) for k in ta)
    assert worst <= atol, f"largest difference between the two runs' variables: {worst:.3g}"


# ----- the placements a pool may have (tests/test_pools.py, tests/test_async_ps_heal.py) -----------
class PlacementUnderTest:
    """What a test needs to know of one placement: the replicators' options and how a killed
    member's end is said."""

    def __init__(self, name: str, cluster=None):
        self.name, self.cluster = name, cluster
        # Local: the exit status; Ray: the actor's death (Ray's report, or /proc on this node).
        self.killed = "killed by SIGKILL" if cluster is None else "died:"

    def options(self, **options) -> dict:
        return {**options, "cluster": self.cluster} if self.cluster is not None else options


def ray_instance():
    """A local Ray instance of this process (`wb.RayCluster(address=None)`), its members packed
    on it; ended with `cluster.shutdown()`, which ends what is left of it by pid (never `ray
    stop`, which ends every Ray instance of the machine)."""
    pytest.importorskip("ray", reason='Ray is an optional extra: pip install -e ".[ray,test]"')
    import ray

    import workbench as wb
    from workbench._src.launch import pool as pools
    from workbench._src.placements.proc import pids_naming, process_tree, same_process_running

    assert not ray.is_initialized(), "a Ray connection was left by another test module"
    cluster = wb.RayCluster(address=None, resources_per_worker={"CPU": 0.5}, placement="pack")
    cluster.connect()
    root = cluster.local_root  # every process the instance starts names it in its command line
    try:
        yield cluster
    finally:
        pools.shutdown()
        instance = process_tree(pids_naming(root))  # (agents retitle themselves)
        cluster.shutdown()
        # Nothing of it outlives the shutdown by more than its grace (its agents included). Each
        # process is named by pid and start time: pids here wrap at 32768 and a busy suite starts
        # many processes, so a pid may be another process's within the 15 s (a loaded suite run
        # timed out here, its instance's processes found by pid alone).
        wait_for(
            lambda: not any(same_process_running(*p) for p in instance),
            15,
            "the Ray instance's processes to end",
        )
        assert not os.path.exists(root)


def placement_under_test(name: str):
    """The `placement` fixture's body (each module that tests both defines it, module-scoped, with
    params=["local", "ray"]): local processes, or Ray actors on a local Ray instance."""
    if name == "local":
        yield PlacementUnderTest("local")
    else:
        for cluster in ray_instance():
            yield PlacementUnderTest("ray", cluster)
