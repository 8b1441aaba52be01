"""A fork server for launched processes: TensorFlow imported once, every worker a fork of it.

Importing TensorFlow costs a launched process 4-5 CPU-seconds (bench/bench_import.py): most of a
cold worker's start, paid again by every worker, parameter server and coordinator, on a machine
whose few cores the others are importing on too. The fork server is started once per launcher
process (`python -m workbench._src.placements.local.fork_server`), imports the workbench and TensorFlow
(without Keras's extras, as a launched process does; nothing of TensorFlow's runtime is started:
no context, no device, no thread) and then waits. Each start of a worker or server module asks
it over a Unix socket; it forks, and the child becomes that process: its own session, stdin
pipe, log file, environment, working folder, network namespace and process title, then runs the
module as `python -m` would. The fork takes milliseconds where an interpreter took seconds.

Why a separate process, not a fork of the launcher: the launcher (a notebook kernel) has
TensorFlow's runtime and threads running, and a fork of a threaded process is unsafe. The fork
server never starts a thread of its own, so each child starts with one thread, as `exec` would
give it (numpy's OpenBLAS pool is rebuilt after fork by OpenBLAS itself).

The launcher's side (starting it, asking it, the children as Popen-like objects) is
fork_client.py; this module is the server's side, and what both sides share.

Where it is used: ProcessGroup.start for the workbench's own worker and server modules. It is
shared with the processes it forks (WORKBENCH_FORK_SERVER): an async-ps coordinator's servers
are forked too, joining the coordinator's network namespace. It ends with its launcher: EOF on
its stdin stops it taking requests; it exits once its last child has (they have their own
parent-death rule). WORKBENCH_FORK_SERVER=off starts every process with a fresh interpreter, as
before; a fork server that cannot start (or a process whose import-time environment differs from
it) falls back to that too.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import tempfile

from workbench._src.core import tf_setup

FORK_SERVER_ENV = "WORKBENCH_FORK_SERVER"  # the socket's path; "off": no fork server
FORKED_MODULES = (
    "workbench._src.placements.local.worker_main",
    "workbench._src.placements.local.server_main",
)
_MAX_MESSAGE = 1 << 20
# What a process may read from its environment as it imports TensorFlow: a child of a fork server
# imported with other values would not be the process a fresh interpreter gives. The rest is read
# after the fork, so it may differ per child: the task, the channel, TMPDIR, TF_CONFIG (read when
# the strategy is made) and CUDA_VISIBLE_DEVICES (read when CUDA starts, at the first device
# listing, which the fork server never makes).
_IMPORT_TIME_PREFIXES = ("TF_", "XLA_", "CUDA", "LD_", "PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS", "KERAS")
# TensorFlow's own import sets the two KMP_ variables (for Intel's OpenMP): a launcher that has
# imported it has them, a fork server started before that has them too once it has imported.
# ParameterServerStrategy sets the last two in the coordinator as it connects (client settings,
# read when it runs functions): the coordinator's replacement of a lost worker server inherits them.
_IMPORT_TIME_EXEMPT = (
    "TF_CONFIG",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
    "TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE",
    "TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY",
)


def import_time_environment(env) -> str:
    """The part of `env` a process reads as it imports: the fork server's children must share it."""
    kept = {
        k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES) and k not in _IMPORT_TIME_EXEMPT
    }
    return json.dumps([sys.executable, sorted(kept.items())])


# ----- the fork server's side ----------------------------------------------------------------


def _serve(path: str) -> None:
    os.environ.pop(FORK_SERVER_ENV, None)
    # Our own temp files (stderr held while TensorFlow imports) go in our folder, which goes with
    # us. Left to find the temp folder itself, Python's first gettempdir() probes TMPDIR by making
    # and removing a file there, and a launcher that exits while we still import (a script that
    # fails at once) may find that file in its TMPDIR as it checks, or keep it if we are killed.
    tempfile.tempdir = os.path.dirname(path)
    environment = import_time_environment(os.environ)
    _preload()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wake-up fd does the work)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".new")
    listener.listen(16)
    os.rename(path + ".new", path)  # the path appears only when the server answers
    status_fds: dict[int, int] = {}  # child pid -> where its exit status goes
    state = {"listener": listener, "status_fds": status_fds}
    listening = True
    while listening or status_fds:
        watched = [wake_r] + ([listener, sys.stdin.fileno()] if listening else [])
        readable = select.select(watched, [], [])[0]  # (a signal's EINTR is retried by Python)
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(wake_r, 4096)
        _reap(status_fds)
        if listening and sys.stdin.fileno() in readable and not os.read(sys.stdin.fileno(), 4096):
            listening = False  # the launcher is gone (or let us go): no more children
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
        elif listening and listener in readable:
            # A request that cannot be read or answered (its client gone, a malformed message)
            # is dropped: the client falls back to a fresh interpreter; the server serves on.
            with contextlib.suppress(Exception):
                conn, _ = listener.accept()
                with conn:
                    _answer(conn, environment, state)
    # Our folder (the socket's, our log's): a launcher killed by a signal could not remove it.
    folder = os.path.dirname(path)
    if os.path.basename(folder).startswith("workbench-fork-server-"):
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)


def _preload() -> None:
    """What every launched process imports before its work: the workbench and TensorFlow (its
    start-up lines held back, Keras's optional extras left out, as worker_main imports it)."""
    import cloudpickle  # noqa: F401

    import workbench

    for name in workbench.__all__:  # (`import workbench` alone loads its names lazily)
        getattr(workbench, name)
    import workbench._src.launch.member  # noqa: F401 - the member's loop, in every child

    with tf_setup.keras_extras_skipped(), tf_setup._start_up_noise_hidden():
        import tensorflow  # noqa: F401
    with contextlib.suppress(ImportError):
        import setproctitle

        # Its first call finds the memory of our command line (past the environment, which it
        # moves): made here, where the environment is still the one the process started with.
        setproctitle.getproctitle()


def _reap(status_fds: dict[int, int]) -> None:
    while status_fds:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, struct.pack("i", os.waitstatus_to_exitcode(status)))
            os.close(fd)


def _answer(conn, environment: str, state: dict) -> None:
    message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 8)
    try:
        request = json.loads(message)
        if request.get("module") not in FORKED_MODULES:
            conn.send(json.dumps({"refused": f"not a forked module: {request.get('module')!r}"}).encode())
            return
        if request.get("environment") != environment:
            conn.send(json.dumps({"refused": "another import-time environment"}).encode())
            return
        stdin_r, log_fd, status_w, *namespaces = fds
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            state["ready"] = ready_w
            _become(request, stdin_r, log_fd, dict(zip(request["namespaces"], namespaces)), state)
        # The reply waits until the child is in its session and network, under its title: the
        # launcher then sees it as a started Popen's child would be (a fork takes milliseconds).
        os.close(ready_w)
        with contextlib.suppress(OSError):
            if select.select([ready_r], [], [], 10)[0]:
                os.read(ready_r, 1)
        os.close(ready_r)
        state["status_fds"][pid] = status_w
        fds.remove(status_w)  # kept until the child's status is written
        conn.send(json.dumps({"pid": pid}).encode())
    finally:
        for fd in fds:
            os.close(fd)


def _become(request: dict, stdin_r: int, log_fd: int, namespaces: dict[str, int], state: dict) -> None:
    """In the forked child: turn into `python -m module args` as the launcher asked; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()  # as start_new_session=True: the launcher's killpg reaches its helpers only
        from workbench._src.placements.local import netns

        netns.enter(namespaces.get("user", -1), namespaces.get("net", -1))
        _set_title(request["module"], request["args"])  # (before the environment changes: see there)
        os.write(state["ready"], b"1")  # (EOF instead if any of the above failed: it exits 1)
        os.dup2(stdin_r, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as close_fds=True: only what it was given
        state["listener"].detach()  # (its descriptor is closed: nothing may close it again)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        tempfile.tempdir = None  # TMPDIR is this child's own
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = ["-m", *request["args"]]
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a fresh interpreter would print it and exit 1
        import traceback

        traceback.print_exc()
    finally:
        # No interpreter exit (atexit, finalizers): the worker and server modules end with
        # os._exit themselves, and a fork of the server must not run the server's exit hooks.
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _set_title(module: str, args) -> None:
    """`ps` shows the child as the command it stands for (and the tests find it by that). Called
    before the child's environment replaces ours (setproctitle may keep pointers into it)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))


if __name__ == "__main__":
    _serve(sys.argv[1])
