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

Who reaps: the children are the fork server's, so it reports each one's exit status over a pipe
the launcher passed with the request (`ForkedProcess` reads it: `poll`, `wait` and `returncode` as
subprocess.Popen has them). The launcher signals them by pid, as before.

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
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from workbench._src.core import exit as process_exit
from workbench._src.core import tf_setup
from workbench._src.placements.proc import pid_alive, socket_folder

FORK_SERVER_ENV = "WORKBENCH_FORK_SERVER"  # the socket's path; "off": no fork server
FORKED_MODULES = ("workbench._src.placements.local.worker_main", "workbench._src.placements.local.server_main")
START_TIMEOUT = 120.0  # s for the fork server's own import on a busy machine; past it, no fork server
STATUS_LOST = 255  # returncode when the fork server died before it could report a child's status
_MAX_MESSAGE = 1 << 20
# What a process may read from its environment as it imports TensorFlow: a child of a fork server
# imported with other values would not be the process a fresh interpreter gives. The rest is read
# after the fork, so it may differ per child: the task, the channel, TMPDIR, TF_CONFIG (read when
# the strategy is made) and CUDA_VISIBLE_DEVICES (read when CUDA starts, at the first device
# listing, which the fork server never makes).
_IMPORT_TIME_PREFIXES = ("TF_", "XLA_", "CUDA", "LD_", "PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS", "KERAS")
# TensorFlow's own import sets the two KMP_ variables (for Intel's OpenMP): a launcher that has
# imported it has them, a fork server started before that has them too once it has imported.
_IMPORT_TIME_EXEMPT = (
    "TF_CONFIG",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
)


def import_time_environment(env) -> str:
    """The part of `env` a process reads as it imports: the fork server's children must share it."""
    kept = {
        k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES) and k not in _IMPORT_TIME_EXEMPT
    }
    return json.dumps([sys.executable, sorted(kept.items())])


# ----- the launcher's side -------------------------------------------------------------------


class ForkedProcess:
    """A fork server's child, as the launcher sees it: the parts of subprocess.Popen that
    processes.py uses (pid, stdin, poll, wait, returncode, args)."""

    def __init__(self, pid: int, args: list[str], stdin, status_fd: int):
        self.pid = pid
        self.args = args
        self.stdin = stdin  # our end of its stdin pipe; closing it tells the child we are gone
        self.returncode: int | None = None
        self.status_lost = False  # the fork server died before it could say how the child ended
        self._status_fd = status_fd  # the fork server writes the exit status here, then closes it
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None and self._status_fd >= 0:
                if select.select([self._status_fd], [], [], 0)[0]:
                    self._read_status()
            if self.returncode is None and self._status_fd < 0 and not pid_alive(self.pid):
                # The fork server died first (its children went to init, which reaped this one).
                self.returncode, self.status_lost = STATUS_LOST, True
            return self.returncode

    def _read_status(self) -> None:
        data = b""
        with contextlib.suppress(OSError):
            data = os.read(self._status_fd, 4)
        os.close(self._status_fd)
        self._status_fd = -1
        if len(data) == 4:
            self.returncode = struct.unpack("i", data)[0]

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            fd = self._status_fd
            if fd >= 0:
                with contextlib.suppress(OSError, ValueError):
                    select.select([fd], [], [], 0.5 if left is None else min(left, 0.5))
            else:
                time.sleep(0.05)
        return self.returncode

    def __del__(self):
        if self._status_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._status_fd)


class _Server:
    """This process's own fork server (or the one it inherited): where to ask, and its process."""

    def __init__(self, path: str, popen=None, folder: str | None = None, environment: str = ""):
        self.path = path
        self.popen = popen  # None when inherited from the process that forked us
        self.serving = popen is None  # (ours: once its socket is there)
        self.started = time.monotonic()
        self.folder = folder
        self.environment = environment
        if popen is not None:
            # At exit, also an early one (the reaper's os._exit runs pending finalizers): the
            # server stops listening, and its folder goes now, not when its last child has ended.
            self.end = weakref.finalize(self, _end_server, popen, folder)


def _end_server(popen, folder: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        popen.stdin.close()
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


_lock = threading.Lock()
_server: _Server | None = None
_unusable = ""  # why this process has no fork server ("" until one failed to start)


def enabled() -> bool:
    """Off by WORKBENCH_FORK_SERVER=off, and when TensorFlow's start-up logs are wanted
    (WORKBENCH_TF_LOGS=1): each process then imports TensorFlow itself and logs it in its own log."""
    off = os.environ.get(FORK_SERVER_ENV, "").strip().lower() in ("off", "0", "false", "no")
    return not off and not tf_setup.tf_logs_wanted()


def prestart() -> None:
    """Starts this process's fork server now, without waiting for it, so that its TensorFlow
    import runs while this process goes on (`workbench run` calls it first); the first
    start_process then waits for it only as long as it is not ready. Its process and folder are
    known before this returns: a script that fails at once leaves nothing (a start on a thread
    of its own could still be making the folder when the script exited, and left it)."""
    if not enabled():
        return
    env = {**os.environ}
    tf_setup.hold_back_cpp_logs(env)  # as ProcessGroup.start gives its children
    _server_for(env, wait=False)


def start_process(
    module: str, args, env: dict, log_fd: int, namespace_fds: dict[str, int]
) -> ForkedProcess | None:
    """Starts `python -m module args` as a fork of this process's fork server (started now if
    need be) with `env`, stdout and stderr into `log_fd`, in the namespaces of `namespace_fds`
    ("user"/"net" -> descriptor; those of this process when empty). None: start it the usual way
    (no fork server here, or the child's import-time environment differs from the server's)."""
    if module not in FORKED_MODULES or not enabled():
        return None
    server = _server_for(env)
    if server is None:
        return None
    env = {**env, FORK_SERVER_ENV: server.path}  # the processes it starts are forked by it too
    stdin_r, stdin_w = os.pipe()
    status_r, status_w = os.pipe()
    own_namespaces: list[int] = []
    try:
        if not namespace_fds:
            # Where this process is: a coordinator inside its cluster's private network, whose
            # servers must be there too (the fork server runs where the launcher is).
            for kind in ("user", "net"):
                with contextlib.suppress(OSError):
                    own_namespaces.append(os.open(f"/proc/self/ns/{kind}", os.O_RDONLY))
                    namespace_fds = {**namespace_fds, kind: own_namespaces[-1]}
        kinds = list(namespace_fds)
        request = {
            "module": module,
            "args": [str(a) for a in args],
            "env": env,
            "cwd": os.getcwd(),
            "environment": import_time_environment(env),
            "namespaces": kinds,
        }
        fds = [stdin_r, log_fd, status_w, *(namespace_fds[k] for k in kinds)]
        reply = _ask(server.path, request, fds)
    except OSError as error:
        for fd in (stdin_r, stdin_w, status_r, status_w):
            os.close(fd)
        _failed(server, f"its socket could not be reached ({error})")
        return None
    finally:
        for fd in own_namespaces:
            os.close(fd)
    os.close(stdin_r)
    os.close(status_w)
    if "pid" not in reply:
        os.close(stdin_w)
        os.close(status_r)
        return None  # (refused: another import-time environment) the usual start does it
    return ForkedProcess(
        reply["pid"], [sys.executable, "-m", module, *args], os.fdopen(stdin_w, "wb"), status_r
    )


def _ask(path: str, request: dict, fds: list[int]) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(30)
        s.connect(path)
        socket.send_fds(s, [json.dumps(request).encode()], fds)
        return json.loads(s.recv(_MAX_MESSAGE) or b"{}")


def _give_up(why: str) -> None:
    global _server, _unusable
    _unusable = why
    _server = None


_failures = 0
MAX_FAILURES = 3  # fork servers that died or stopped answering before this process stops asking


def _failed(server: _Server, why: str) -> None:
    """A fork server that stopped answering (killed, say): the next start makes a new one, up to
    MAX_FAILURES times; this start goes the usual way."""
    global _server, _failures
    with _lock:
        _failures += 1
        if _server is server:
            _server = None
        if server.popen is not None:
            server.end()
        if _failures >= MAX_FAILURES:
            _give_up(why)


def _server_for(env: dict, wait: bool = True) -> _Server | None:
    global _server, _failures
    environment = import_time_environment(env)
    with _lock:
        if _unusable:
            return None
        if _server is not None and _server.popen is not None and _server.popen.poll() is not None:
            _failures += 1
            _server = None  # it died: a new one (up to MAX_FAILURES)
            if _failures >= MAX_FAILURES:
                _give_up("it died again")
                return None
        if _server is None:
            inherited = os.environ.get(FORK_SERVER_ENV, "")
            if inherited.startswith("/") and os.path.exists(inherited):
                _server = _Server(inherited)  # ours: the one that forked us (it checks the environment)
            else:
                _server = _start_server(environment)
        elif _server.popen is not None and _server.environment != environment:
            # TensorFlow's import-time settings changed (a user set TF_CPP_MIN_LOG_LEVEL, say):
            # a new fork server imports with them; the old one ends with its last child.
            _server.end()
            _server = _start_server(environment)
        if wait and not _server.serving and not _wait_until_serving(_server):
            _server = None
        return _server


def _start_server(environment: str) -> _Server:
    folder = socket_folder("workbench-fork-server-")
    path = os.path.join(folder, "fork.sock")
    log_path = os.path.join(folder, "fork-server.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tf_setup.hold_back_cpp_logs(env)
    env.pop(FORK_SERVER_ENV, None)
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "workbench._src.placements.local.fork_server", path],
            env=env,
            stdin=subprocess.PIPE,  # held open; EOF: this process is gone
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # an interrupt aimed at the kernel does not reach it
            close_fds=True,
        )
    # Known (and ended at our exit, its folder removed) from now on, not only once it answers:
    # a script that fails while the fork server still imports leaves nothing behind either.
    server = _Server(path, popen, folder, environment)
    _servers.append(server)
    return server


def _wait_until_serving(server: _Server) -> bool:
    """Waits for our fork server's socket (its import done); False, and no fork server for this
    process from now on, if it exited or took longer than START_TIMEOUT."""
    popen, deadline = server.popen, server.started + START_TIMEOUT
    while not os.path.exists(server.path):
        if popen.poll() is not None or time.monotonic() > deadline:
            why = _tail(os.path.join(server.folder, "fork-server.log")) or f"exit code {popen.poll()}"
            server.end()
            with contextlib.suppress(ProcessLookupError):
                popen.kill()  # (past the timeout it may still be importing)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
            _servers.remove(server)
            _warn_once(f"the fork server did not start ({why})")
            _give_up(why)
            return False
        time.sleep(0.02)
    server.serving = True
    return True


_servers: list[_Server] = []  # every fork server this process started (each ends at our exit)


def _end_all_at_exit() -> None:
    """Reaps our fork servers at exit (core/exit.py, after the pools and process groups: their
    children are gone), and a fork server whose stdin is closed (here, or earlier by its
    finalizer) exits at once. Reaped, it is not left to Popen's "still running" warning."""
    for server in list(_servers):
        server.end()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.popen.wait(timeout=0.5)


process_exit.on_exit("fork servers", _end_all_at_exit)


def _tail(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return " | ".join(line.strip() for line in f.read().splitlines()[-5:] if line.strip())
    return ""


def _warn_once(text: str) -> None:
    import warnings

    warnings.warn(
        f"workbench: {text}; launched processes start a fresh Python each (a few seconds more "
        f"per process). Set {FORK_SERVER_ENV}=off to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )


# ----- the fork server's side ----------------------------------------------------------------


def _serve(path: str) -> None:
    os.environ.pop(FORK_SERVER_ENV, None)
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

    import workbench  # noqa: F401

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
