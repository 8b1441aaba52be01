"""Test setup: 8 virtual CPU devices, fixed before TensorFlow initialises (as TF's own
distribute tests do with set_logical_devices_to_at_least), so multi-replica tests run anywhere."""

import contextlib
import gc
import os
import signal
import sys
import threading
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Ray's auto-connect off, before any test module imports Ray (Ray reads it at import). On, a Ray
# call after a module's instance was shut down started a new instance in /tmp/ray, tied by Ray to
# the calling thread: when that thread ended its GCS went, and a minute later Ray ended the whole
# pytest-xdist worker (the next module's tests: "node down"; reproduced with `pytest -n 1
# tests/test_ray.py tests/test_pools.py`). The workbench sets the same when it imports Ray itself
# (placements/ray/cluster.import_ray); a test module imported Ray first.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
os.environ.setdefault("WORKBENCH_RUNS_DIR", os.path.join(os.path.dirname(__file__), "..", "runs", "tests"))

import pytest  # noqa: E402
from helpers import adopt_orphans, cluster_processes  # noqa: E402
from toy_models import toy_data  # noqa: E402

import workbench as wb  # noqa: E402

wb.configure_devices(cpus=8)

# A thread held up in Python's garbage collector is reported as a warning of the test it happened
# in. The suite's rare idle stalls (a test or the dashboard's renderer waiting 10-620 s with no CPU)
# were the collector freeing a TensorFlow input iterator, whose C++ destructor waits for tf.data's
# tuning thread: the reaper (workbench/_src/core/reaper.py) had been handed the iterator by the
# Program's finalizer before the collector cleared the Program, and let go of it first (fixed in
# the nineteenth session; test_reaper.py shows the race). The warning stays, to show any other way.
SLOW_COLLECTION_SECONDS = 3.0
_collection_started: dict[int, float] = {}
_slow_collections: list[str] = []  # said by the running test's teardown (not from inside the collector)


def _time_collections(phase: str, info: dict) -> None:
    thread = threading.current_thread()
    if phase == "start":
        _collection_started[thread.ident] = time.monotonic()
        return
    started = _collection_started.pop(thread.ident, None)
    seconds = time.monotonic() - started if started is not None else 0.0
    if seconds > SLOW_COLLECTION_SECONDS and thread.name != "workbench iterator reaper":
        _slow_collections.append(
            f"Python's garbage collector held thread {thread.name!r} for {seconds:.1f} s "
            f"(generation {info['generation']}, {info['collected']} objects freed)"
        )


gc.callbacks.append(_time_collections)


@pytest.fixture(autouse=True)
def _report_slow_collections():
    yield
    while _slow_collections:
        warnings.warn(_slow_collections.pop(0), RuntimeWarning, stacklevel=1)


@pytest.fixture
def data():
    return toy_data()


# The longest files first, so that under `-n 3` (the README's and CI's command) no worker is left
# running a long file alone at the end: a worker takes the next file when it is free. xdist's own
# order (files with the most tests first, turned off in pyproject.toml) put the one-test files that
# take a minute last. The order is the files' summed test times under `-n 3` on 2 cores, measured
# with `--durations=0`; a file not named keeps its collection order, after these.
LONGEST_FIRST = (
    "test_ray.py",
    "test_readme.py",
    "test_two_hosts.py",
    "test_lab_extension.py",
    "test_process_backends.py",
    "test_pools.py",
    "09_ray_cluster.ipynb",
    "test_ray_two_nodes.py",
    "test_cli.py",
    "test_async_ps.py",
    "test_notebook_kernel.py",
    "test_conformance.py",
    "04_scaling_study.ipynb",
    "test_network_isolation.py",
    "test_exit.py",
)


def pytest_collection_modifyitems(config, items):
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))  # stable: each file's order kept


def pytest_sessionfinish(session, exitstatus):
    # If an input iterator's deletion is under way at exit, the reaper ends the process at once
    # rather than wait 10-40 s for it (workbench/_src/core/reaper.py); tell it the status to end with.
    from workbench._src.core import reaper

    reaper.exit_code_hint = int(exitstatus)
    if "notebook_toy" in sys.modules:  # the in-process IPython shell was used
        sys.modules["notebook_toy"].end_ipython_shell()


def _pool_module():
    return sys.modules.get("workbench._src.launch.pool")


def _cluster_pids() -> set[str]:
    """The pids (as text) of this process's descendants running a worker or server module."""
    return {line.split()[0] for line in cluster_processes()}


def _pool_pids() -> set[str]:
    """The pids (as text) of this process's live warm pools (workers, servers, coordinators)."""
    pool = _pool_module()
    if pool is None:
        return set()
    return {str(p["pid"]) for each in pool.live_pools() for p in each.processes}


# How long processes that were told to end may take to go before they count as left behind: a
# wait, not a timing check (an exit at load 70 takes seconds; one that never comes is the fault).
GONE_WAIT = 60.0


def _end_pools_and_check() -> None:
    """Ends this process's warm pools and checks that their processes go.

    A pool that does not end (its run hung and holds it busy, or a process ignores the stop) is
    then ended the way interpreter exit ends it, its processes killed by pid (ours: this process's
    descendants), and forgotten, before the check fails: the fault is reported once, at the
    teardown of the test that left it, not again at the setup of every later test of this xdist
    worker (a loaded suite once had 40 errors after one test_pools failure)."""
    pool = _pool_module()
    if pool is None:
        return
    pids = _pool_pids()
    pool.shutdown()
    left = _wait_gone(pids)
    # A busy pool is only marked retiring by shutdown(): it goes when its run ends (at once for a
    # run that just ended; never for one the test left going, whatever its placement: a Ray
    # actor is not among _cluster_pids).
    deadline = time.monotonic() + GONE_WAIT
    while pool.live_pools() and time.monotonic() < deadline:
        time.sleep(0.2)
    kept = [f"{each.shape} ({each.state})" for each in pool.live_pools()]
    if left or kept:
        pool.POOLS.stop_all_at_exit()
        with pool.POOLS.lock:
            pool.POOLS.pools.clear()
        for pid in _wait_gone(left, within=5.0):
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
    assert not left, f"warm-pool processes left behind after shutdown: {sorted(left)}"
    assert not kept, f"warm pools left busy after shutdown (their runs never ended): {kept}"


def _wait_gone(pids: set[str], within: float = GONE_WAIT) -> set[str]:
    """Those of `pids` (this process's cluster processes) still running after up to `within` s."""
    left = _cluster_pids() & pids
    deadline = time.monotonic() + within
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left &= _cluster_pids()
    return left


def _shares_pools(request) -> bool:
    return request.node.get_closest_marker("shares_warm_pool") is not None


@pytest.fixture(autouse=True)
def _end_warm_pools(request):
    """A test's warm worker pools end with it (launch/pool.py keeps them between runs), and it
    starts from none: what it says about processes starting is its own.

    Tests marked `shares_warm_pool` (runs on worker processes whose start is not what they test)
    leave their pool to the next such test of the file, as a notebook's next cell would find it:
    the next run of the same shape takes it warm, and must train exactly as on fresh processes
    (that is the pool's promise, checked again by every such test). The pool ends, checked, with
    the first test not marked or with the file."""
    if _shares_pools(request):
        yield
        return
    _end_pools_and_check()
    yield
    _end_pools_and_check()  # (checked here too: a pool that will not end is this test's fault)


@pytest.fixture(autouse=True, scope="module")
def _warm_pools_end_with_their_file():
    yield
    _end_pools_and_check()


@pytest.fixture
def no_orphans(request):
    adopt_orphans(True)
    # (a warm pool a sharing test left is counted as this test's: its run may retire it)
    before = _cluster_pids() - _pool_pids()
    shares = _shares_pools(request)

    def left_behind() -> list[str]:
        # (a sharing test's warm pool is not left behind: the next test or the file's end ends it)
        kept = _pool_pids() if shares else set()
        return [line for line in cluster_processes() if line.split()[0] not in before | kept]

    yield
    pool = _pool_module()
    if pool is not None and not shares:  # warm pools outlive their runs by design; they end with the test
        pool.shutdown()
    deadline = time.monotonic() + GONE_WAIT
    while left_behind() and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert not left_behind(), f"processes left behind: {left_behind()}"
    finally:
        adopt_orphans(False)


@pytest.fixture
def child_tmpdir(tmp_path, monkeypatch):
    """A private TMPDIR for the kernels, servers and scripts a test starts and then kills.

    A process ended by SIGKILL (or by `shutdown_kernel(now=True)`, which kills) cannot run
    TensorFlow's clean-up of its `__autograph_generated_file*.py` files: they were the ~90 files a
    full run left in /tmp. Children inherit this folder, and it goes with the test's tmp_path
    (`tmp_path_retention_policy = "failed"` in pyproject.toml)."""
    folder = tmp_path / "child-tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))  # this process has already read its own TMPDIR
    return folder


@pytest.fixture
def notebook(tmp_path):
    from notebook_toy import ipython_shell, isolated_notebook_state

    shell = ipython_shell()
    with isolated_notebook_state(tmp_path / "runs"):
        for name in ("model", "step_fn", "input_fn", "repl"):
            shell.user_ns.pop(name, None)
        yield shell


# ----- a pytest-xdist worker that dies says how ---------------------------------------------------
# "node down: Not properly terminated" names the test it was running, not why: a signal, a C++
# abort (Ray's checks, TensorFlow's), the interpreter's own fatal error. Each worker keeps the test
# it runs, and on a fatal signal every thread's Python stack (faulthandler), in a file of its own;
# a worker that ends normally removes it, so the files left are those of dead workers, printed at
# the end of the controller's summary. (No file says how for SIGKILL: nothing runs in the process.)
CRASH_DIR_ENV = "WORKBENCH_TEST_CRASH_DIR"
_crash_file = None


@pytest.hookimpl(trylast=True)  # (after pytest's faulthandler plugin, which points it at stderr)
def pytest_configure(config):
    global _crash_file
    import faulthandler
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        os.environ[CRASH_DIR_ENV] = tempfile.mkdtemp(prefix=f"workbench-test-crashes-{os.getpid()}-")
    elif os.environ.get(CRASH_DIR_ENV):
        path = os.path.join(os.environ[CRASH_DIR_ENV], f"{worker}-pid{os.getpid()}.log")
        _crash_file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open as long as the worker
        faulthandler.enable(file=_crash_file, all_threads=True)
        # The worker's temp folder, and that of every process a test starts without one of its
        # own: in the run's folder, which the controller removes at the end. AutoGraph's files of
        # a process that ended by os._exit or a signal (a coordinator a test started, a worker
        # that execnet ended) were left in the machine's /tmp: ~120 a suite run. (tmp_path is
        # not moved: xdist hands each worker its basetemp.)
        private = os.path.join(os.environ[CRASH_DIR_ENV], f"tmp-{worker}")
        os.mkdir(private)
        os.environ["TMPDIR"] = tempfile.tempdir = private


def pytest_runtest_logstart(nodeid, location):
    if _crash_file is not None:
        _crash_file.seek(0)
        _crash_file.truncate()
        _crash_file.write(f"{time.strftime('%H:%M:%S')} running {nodeid}\n")
        _crash_file.flush()


def pytest_unconfigure(config):
    import shutil

    if _crash_file is not None:  # a worker ending normally: nothing to say
        _crash_file.close()
        os.remove(_crash_file.name)
    elif os.environ.get("PYTEST_XDIST_WORKER") is None and os.environ.get(CRASH_DIR_ENV):
        shutil.rmtree(os.environ.pop(CRASH_DIR_ENV), ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    folder = os.environ.get(CRASH_DIR_ENV)
    if os.environ.get("PYTEST_XDIST_WORKER") is not None or not folder or not os.path.isdir(folder):
        return
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".log")):  # (not the tmp-* folders)
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if not line.startswith("Extension modules:")]
        text = "".join(lines)  # the test, the fatal error, then each thread's stack
        terminalreporter.write_sep("=", f"pytest-xdist worker {name.removesuffix('.log')} died")
        terminalreporter.write_line(text[:4000] or "(nothing written)")
