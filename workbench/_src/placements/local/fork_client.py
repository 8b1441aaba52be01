"""The launcher's side of the fork server (fork_server.py): start it, ask it for a child, know
that child as subprocess.Popen is known, and end it at exit.

Who reaps: the children are the fork server's, so it reports each one's exit status over a pipe
the launcher passed with the request (`ForkedProcess` reads it: `poll`, `wait` and `returncode` as
subprocess.Popen has them). The launcher signals them by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref

from workbench._src.core import exit as process_exit
from workbench._src.core import tf_setup
from workbench._src.core.owned_folders import pid_alive
from workbench._src.launch.start_progress import StartDeadline
from workbench._src.placements.local.fork_server import (
    _MAX_MESSAGE,
    FORK_SERVER_ENV,
    FORKED_MODULES,
    import_time_environment,
)
from workbench._src.placements.proc import CpuWaitCounter, process_cpu_seconds, socket_folder

# How long this process waits for its fork server's own import (TensorFlow's) before it starts
# its processes without one, once the import stops making progress (launch/start_progress.py:
# while the fork server uses or waits for a CPU it is importing, up to 4x this; at load 30-70 an
# import took longer than 120 s). Raise it only if the fork server's log shows a slower import
# that did finish.
START_TIMEOUT = 120.0
STATUS_LOST = 255  # returncode when the fork server died before it could report a child's status


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
    # (Asked before its stdin closes: on that EOF a serving server removes its socket itself, and
    # stays to report its children's exits.)
    never_served = not os.path.exists(os.path.join(folder, "fork.sock"))
    with contextlib.suppress(OSError, ValueError):
        popen.stdin.close()
    if never_served:
        # Still importing (a script that failed at once): it would read its stdin's EOF only
        # once it serves, seconds of CPU from now, for nothing. It has no children yet, and its
        # temp files are in its folder (fork_server._serve): ended now, it leaves nothing.
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            popen.kill()
            popen.wait(5)  # (not left a zombie when this runs before our exit)
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


class _ForkServers:
    """This process's fork servers, in one place."""

    def __init__(self):
        self.lock = threading.Lock()
        self.server: _Server | None = None  # the one to ask (ours, or inherited)
        self.unusable = ""  # why this process has no fork server ("" until one failed to start)
        self.failures = 0  # fork servers that died or stopped answering
        self.started: list[_Server] = []  # every fork server this process started (each ends at exit)


STATE = _ForkServers()


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
    STATE.unusable = why
    STATE.server = None


# Fork servers that may die or stop answering before this process stops asking for one (and
# starts fresh interpreters): a fork server killed by accident is replaced, one that keeps dying
# is not worth the wait of another TensorFlow import each time.
MAX_FAILURES = 3


def _failed(server: _Server, why: str) -> None:
    """A fork server that stopped answering (killed, say): the next start makes a new one, up to
    MAX_FAILURES times; this start goes the usual way."""
    with STATE.lock:
        STATE.failures += 1
        if STATE.server is server:
            STATE.server = None
        if server.popen is not None:
            server.end()
        if STATE.failures >= MAX_FAILURES:
            _give_up(why)


def _server_for(env: dict, wait: bool = True) -> _Server | None:
    environment = import_time_environment(env)
    with STATE.lock:
        if STATE.unusable:
            return None
        if (
            STATE.server is not None
            and STATE.server.popen is not None
            and STATE.server.popen.poll() is not None
        ):
            STATE.failures += 1
            STATE.server = None  # it died: a new one (up to MAX_FAILURES)
            if STATE.failures >= MAX_FAILURES:
                _give_up("it died again")
                return None
        if STATE.server is None:
            inherited = os.environ.get(FORK_SERVER_ENV, "")
            if inherited.startswith("/") and os.path.exists(inherited):
                STATE.server = _Server(inherited)  # ours: the one that forked us (it checks the environment)
            else:
                STATE.server = _start_server(environment)
        elif STATE.server.popen is not None and STATE.server.environment != environment:
            # TensorFlow's import-time settings changed (a user set TF_CPP_MIN_LOG_LEVEL, say):
            # a new fork server imports with them; the old one ends with its last child.
            STATE.server.end()
            STATE.server = _start_server(environment)
        if wait and not STATE.server.serving and not _wait_until_serving(STATE.server):
            STATE.server = None
        return STATE.server


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
    STATE.started.append(server)
    return server


def _wait_until_serving(server: _Server) -> bool:
    """Waits for our fork server's socket (its import done); False, and no fork server for this
    process from now on, if it exited or took longer than START_TIMEOUT."""
    popen = server.popen
    deadline = StartDeadline(START_TIMEOUT, started=server.started)
    importing = _Process(popen.pid)
    while not os.path.exists(server.path):
        if popen.poll() is not None or deadline.passed(time.monotonic(), [importing]):
            why = _tail(os.path.join(server.folder, "fork-server.log")) or f"exit code {popen.poll()}"
            server.end()
            with contextlib.suppress(ProcessLookupError):
                popen.kill()  # (past the timeout it may still be importing)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
            STATE.started.remove(server)
            _warn_once(f"the fork server did not start ({why})")
            _give_up(why)
            return False
        time.sleep(0.02)
    server.serving = True
    return True


class _Process:
    """A process as StartDeadline reads a starting member: its CPU time and its wait for a CPU."""

    def __init__(self, pid: int):
        self.pid = pid
        self.cpu_waits = CpuWaitCounter()

    def cpu_seconds(self, with_own: bool = False) -> float | None:
        return process_cpu_seconds(self.pid)

    def cpu_wait(self, with_own: bool = False) -> tuple[float, bool] | None:
        return self.cpu_waits.read([self.pid])


def _end_all_at_exit() -> None:
    """Reaps our fork servers at exit (core/exit.py, after the pools and process groups: their
    children are gone), and a fork server whose stdin is closed (here, or earlier by its
    finalizer) exits at once. Reaped, it is not left to Popen's "still running" warning."""
    for server in list(STATE.started):
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
