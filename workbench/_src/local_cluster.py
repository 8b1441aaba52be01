"""Local processes for the process backends: started on 127.0.0.1, watched, and always stopped.

Two pieces:
  ProcessGroup   starts `python -m <module>` children in their own sessions (a Jupyter interrupt
                 goes to the kernel, not to them), keeps their logs, notices deaths, and stops
                 them all with SIGTERM then SIGKILL (MultiWorkerMirroredStrategy ignores
                 SIGTERM). Every live group is stopped at interpreter exit and when its owner is
                 garbage collected. A child also exits by itself when its parent dies: it watches
                 its stdin pipe, which the kernel holds open, and EOF means the parent is gone
                 (PR_SET_PDEATHSIG would be simpler but fires when the *thread* that started the
                 child ends, and background runs start children from threads).
  Channel        an authenticated local channel (multiprocessing.connection on 127.0.0.1 with a
                 random key) that the children connect back to: they send hello, heartbeats,
                 events and results; the parent sends the work and stop requests. A connection
                 must know the key and introduce itself with the pid of a process this group
                 started, or it is dropped.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

LOOPBACK = "127.0.0.1"
CHANNEL_ENV = "WORKBENCH_CHANNEL"  # host:port of the parent's channel
CHANNEL_KEY_ENV = "WORKBENCH_CHANNEL_KEY"  # hex key; in the environment, never on the command line
TASK_ENV = "WORKBENCH_TASK"  # "worker:1" / "ps:0": which task this child is

_live_groups: weakref.WeakSet = weakref.WeakSet()


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so none repeats)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def port_open(port: int, host: str = LOOPBACK) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass
class Child:
    role: str  # "worker" | "ps"
    index: int
    popen: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.time)
    expected_exit: bool = False  # set when the child reported it is done
    keepalive_fd: int | None = None  # see ProcessGroup(stop_at_exit=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def label(self) -> str:
        return f"{self.role} {self.index} (pid {self.pid})"

    def exit_description(self) -> str:
        code = self.popen.returncode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        kept = [line for line in text.splitlines() if line.strip() and not _is_noise(line)]
        return "\n".join(kept[-lines:])


def _is_noise(line: str) -> bool:
    # TensorFlow's start-up chatter on machines without CUDA; it hides the real error.
    return any(
        s in line for s in ("cuda", "CUDA", "cuInit", "oneDNN", "TF_ENABLE_ONEDNN", "cpu_feature_guard")
    )


class ProcessGroup:
    """The processes one replicator started; `stop()` ends them all (also at exit / on GC)."""

    def __init__(self, label: str, stop_at_exit: bool = True):
        self.label = label
        # stop_at_exit=False: at interpreter exit leave the children to the stdin-EOF rule, so
        # they exit the moment this process is gone, not before. async-ps servers use it:
        # TensorFlow's own clean-up at exit still talks to them (killing them first floods the
        # log with connection errors). Their pipe's write end is duplicated into a bare fd that
        # nothing closes before the process ends.
        self.stop_at_exit = stop_at_exit
        self.children: list[Child] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="workbench-cluster-"))
        self._stopped = False
        _live_groups.add(self)
        # Stops the processes even if the owner is garbage collected without stop().
        self._finalizer = weakref.finalize(self, _stop_children, self.children)
        self._finalizer.atexit = stop_at_exit

    def start(self, role: str, index: int, module: str, env: dict[str, str], args=()) -> Child:
        log_path = self.log_dir / f"{role}-{index}.log"
        child_env = {**os.environ, **env, TASK_ENV: f"{role}:{index}", "PYTHONUNBUFFERED": "1"}
        child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=child_env,
                stdin=subprocess.PIPE,  # held open: EOF tells the child its parent is gone
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # interrupts aimed at the kernel do not reach it
                close_fds=True,
            )
        child = Child(role, index, popen, log_path)
        if not self.stop_at_exit:
            child.keepalive_fd = os.dup(popen.stdin.fileno())
        self.children.append(child)
        return child

    def unexpected_exits(self) -> list[Child]:
        return [c for c in self.children if c.popen.poll() is not None and not c.expected_exit]

    def alive(self) -> list[Child]:
        return [c for c in self.children if c.popen.poll() is None]

    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL whatever is still there after `grace` seconds; reaps them all."""
        self._stopped = True
        _stop_children(self.children, grace)


def _stop_children(children: list[Child], grace: float = 2.0) -> None:
    alive = [c for c in children if c.popen.poll() is None]
    for c in alive:
        _signal(c, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    for c in alive:
        if c.popen.poll() is None:
            _signal(c, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.popen.wait(timeout=5)
    for c in children:
        with contextlib.suppress(OSError, ValueError):
            if c.popen.stdin:
                c.popen.stdin.close()
        if c.keepalive_fd is not None:
            with contextlib.suppress(OSError):
                os.close(c.keepalive_fd)
            c.keepalive_fd = None


def _signal(child: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)  # the child's own session: its helpers go too
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(child.pid, sig)


@atexit.register
def _stop_all_groups() -> None:
    for group in list(_live_groups):
        if group.stop_at_exit:
            with contextlib.suppress(Exception):
                group.stop(grace=1.0)


# ----- the channel ---------------------------------------------------------------------------
class Channel:
    """Parent side: accepts the group's children, queues their messages, sends them work."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.key = secrets.token_bytes(32)
        self._listener = Listener((LOOPBACK, 0), authkey=self.key)
        self.address = self._listener.address
        self.messages: queue.Queue = queue.Queue()  # (task, message dict)
        self._connections: dict[str, Connection] = {}
        self._send_lock = threading.Lock()
        self._closed = False
        self.rejected = 0  # connections dropped: wrong key or not one of our pids
        threading.Thread(target=self._accept_loop, name="workbench channel", daemon=True).start()

    def env(self) -> dict[str, str]:
        host, port = self.address
        return {CHANNEL_ENV: f"{host}:{port}", CHANNEL_KEY_ENV: self.key.hex()}

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()  # checks the key (HMAC challenge) first
            except (OSError, EOFError):
                if self._closed:
                    return
                self.rejected += 1
                continue
            except Exception:  # noqa: BLE001 - multiprocessing.AuthenticationError and kin
                if self._closed:
                    return
                self.rejected += 1
                continue
            if self._closed:
                conn.close()
                return
            threading.Thread(target=self._read_loop, args=(conn,), daemon=True).start()

    def _read_loop(self, conn: Connection) -> None:
        try:
            hello = conn.recv() if conn.poll(10) else None
        except (EOFError, OSError):
            hello = None
        task = hello.get("task") if isinstance(hello, dict) else None
        if not task or hello.get("pid") not in self.group.pids():
            self.rejected += 1  # not one of the processes this group started
            conn.close()
            return
        self._connections[task] = conn
        self.messages.put((task, hello))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self.messages.put((task, {"type": "disconnected"}))
                return
            self.messages.put((task, message))

    def send(self, task: str, message: dict) -> bool:
        conn = self._connections.get(task)
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.send(message)
            return True
        except (OSError, ValueError):
            return False

    def broadcast(self, message: dict) -> None:
        for task in list(self._connections):
            self.send(task, message)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wake the accept() blocked in the accept thread
            socket.create_connection(self.address, timeout=1).close()
        with contextlib.suppress(Exception):
            self._listener.close()
        for conn in self._connections.values():
            with contextlib.suppress(Exception):
                conn.close()


# ----- child side ------------------------------------------------------------------------------
class ParentLink:
    """Child side: connects to the parent's channel; exits when the parent goes away."""

    def __init__(self):
        self.task = os.environ.get(TASK_ENV, "worker:0")
        host, port = os.environ[CHANNEL_ENV].rsplit(":", 1)
        key = bytes.fromhex(os.environ.pop(CHANNEL_KEY_ENV))  # not inherited by anything we start
        self.conn = Client((host, int(port)), authkey=key)
        self._lock = threading.Lock()
        self.send({"type": "hello", "task": self.task, "pid": os.getpid()})

    def send(self, message: dict) -> None:
        with self._lock:
            self.conn.send(message)

    def recv(self):
        return self.conn.recv()

    def start_heartbeat(self, every: float = 0.5) -> None:
        def beat():
            while True:
                time.sleep(every)
                try:
                    self.send({"type": "heartbeat"})
                except (OSError, ValueError):
                    os._exit(3)  # the parent is gone

        threading.Thread(target=beat, name="workbench heartbeat", daemon=True).start()


def exit_when_parent_dies() -> None:
    """Child side: a thread that ends this process when stdin (the parent's pipe) reaches EOF."""

    def watch():
        with contextlib.suppress(Exception):
            while sys.stdin.buffer.read(1):
                pass
        os._exit(4)

    threading.Thread(target=watch, name="workbench parent watch", daemon=True).start()
