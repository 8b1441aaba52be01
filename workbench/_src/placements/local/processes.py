"""Local processes for the process backends: started, watched, and always stopped.

ProcessGroup starts `python -m <module>` children in their own sessions (a Jupyter interrupt
goes to the kernel, not to them): the workbench's worker and server modules as forks of a
fork server that has imported TensorFlow already (fork_server.py), anything else as a fresh
interpreter. It keeps their logs, notices deaths, and stops them all with SIGTERM then SIGKILL
(MultiWorkerMirroredStrategy ignores SIGTERM). Every live group is stopped at interpreter exit
and when its owner is garbage collected. A child also exits by itself when its parent dies: it
watches its stdin pipe, which the parent holds open, and EOF means the parent is gone
(PR_SET_PDEATHSIG would be simpler but fires when the *thread* that started the child ends, and
background runs start children from threads).

With `private_network=True` (the default) all children share one network namespace holding only
a loopback device (netns.py): TensorFlow's gRPC servers, which bind every interface, are then
reachable from nowhere but inside it. The launcher reaches them over the channel's Unix socket;
it cannot connect to their ports itself (`group.port_open(port)` looks inside instead).

Every child gets a temp folder of its own (its TMPDIR, inside the group's log folder): TensorFlow's
AutoGraph writes one `__autograph_generated_file*.py` per converted function into the temp folder
and deletes them only at a normal interpreter exit, which a launched process never has (it ends
with os._exit, a signal, or SIGKILL). The child removes the folder itself as it exits
(`remove_own_tmp_dir`); whatever way it ended, `stop()` removes it too, even with
WORKBENCH_KEEP_LOGS=1 (it holds no logs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from workbench._src.core import exit as process_exit
from workbench._src.core import tf_setup
from workbench._src.core.owned_folders import owned_folder
from workbench._src.launch.runtime import TASK_ENV
from workbench._src.placements.local import fork_client, netns
from workbench._src.placements.ports import LOOPBACK
from workbench._src.placements.proc import (
    STACKS_SIGNAL,
    CpuSecondsCounter,
    CpuWaitCounter,
    dumped_stacks,
    process_cpu_seconds,
    process_stopped,
)

KEEP_LOGS_ENV = "WORKBENCH_KEEP_LOGS"  # "1": stop() leaves the children's log folder behind
LOG_DIR_ENV = "WORKBENCH_LOG_DIR"  # a child's group's log folder: groups it makes nest inside
TMP_DIR_ENV = "WORKBENCH_PROCESS_TMPDIR"  # a child's own temp folder (also its TMPDIR)
LAUNCHER_PID_ENV = "WORKBENCH_LAUNCHER_PID"  # the group's process: a child exits when it is gone
TMP_PREFIX = "workbench-tmp-"  # only folders named so are ever removed as a child's temp folder

_live_groups: weakref.WeakSet = weakref.WeakSet()


def port_open(port: int, host: str = LOOPBACK) -> bool:
    """Whether something accepts TCP connections at host:port in *this* process's network."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass
class Child:
    role: str  # "worker" | "ps"
    index: int
    popen: subprocess.Popen | fork_client.ForkedProcess
    log_path: Path
    tmp_dir: Path  # its own TMPDIR, removed when it ends (see the module's docstring)
    started_at: float = field(default_factory=time.time)
    expected_exit: bool = False  # set when the child reported it is done
    keepalive_fd: int | None = None  # see ProcessGroup(stop_at_exit=False)
    # A handle on this very process (pidfd_open), taken at its start: a signal sent through it
    # cannot reach another process that got the pid later. Pids wrap at 32,768 here and every
    # thread takes one, so a pid remembered for seconds may be another process's thread by then
    # (a SIGKILL by pid once took down a pytest worker that way). None: no pidfd here.
    pidfd: int | None = None
    own_pids: list = field(default_factory=list)  # what it started itself (launch/placement.Member)
    # Its wait for a CPU, with and without its own processes (one counter per set of pids read:
    # each remembers the threads it has seen).
    cpu_waits: dict = field(default_factory=lambda: {False: CpuWaitCounter(), True: CpuWaitCounter()})
    own_cpu: CpuSecondsCounter = field(default_factory=CpuSecondsCounter)  # (with_own: ended ones kept)

    def __post_init__(self):
        with contextlib.suppress(OSError, AttributeError):  # (AttributeError: Python < 3.9)
            self.pidfd = os.pidfd_open(self.popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def send_signal(self, sig: int) -> None:
        """`sig` to the process and to its session (its helpers), only while the process
        exists (a zombie still holds its pid); nothing once it has ended."""
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, 0)
            except (ProcessLookupError, OSError):
                return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)  # the child's own session: its helpers go too
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def close_handle(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None

    @property
    def label(self) -> str:
        return f"{self.role} {self.index} (pid {self.pid})"

    @property
    def where(self) -> str:
        return f"pid {self.pid}"

    @property
    def killed(self) -> bool:
        """It ended by a signal (the likely culprit when several members ended)."""
        return self.popen.returncode is not None and self.popen.returncode < 0

    def cpu_seconds(self, with_own: bool = False) -> float | None:
        """The CPU time the process has used (all its threads; with_own: and its own processes'),
        or None when it is gone."""
        if not with_own:
            return process_cpu_seconds(self.pid)
        return self.own_cpu.read([self.pid, *self.own_pids])

    def cpu_wait(self, with_own: bool = False) -> tuple[float, bool] | None:
        """How its threads (with_own: and its own processes') wait for a CPU
        (proc.CpuWaitCounter: ended threads' waits kept), or None when it is gone."""
        return self.cpu_waits[with_own].read([self.pid, *(self.own_pids if with_own else ())])

    def stopped(self) -> bool:
        """Whether it is stopped now (SIGSTOP, a debugger's stop)."""
        return process_stopped(self.pid)

    def exit_description(self) -> str:
        code = self.popen.returncode
        if code is None:
            return "still running"
        if getattr(self.popen, "status_lost", False):
            return "ended (how is not known: the fork server that started it had died)"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def stacks(self) -> str:
        """Its Python threads' stacks now, as its faulthandler dumps them into its log on
        STACKS_SIGNAL (worker_main registers it); "" when it wrote none within STACKS_WAIT."""

        def signal_it() -> bool:
            if self.pidfd is None:  # (the signal could reach another process that took the pid)
                return False
            try:
                signal.pidfd_send_signal(self.pidfd, STACKS_SIGNAL)
                return True
            except OSError:
                return False

        return dumped_stacks(self.pid, signal_it, self.log_path)

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
    """The processes one replicator started; `stop()` ends them all (also at exit / on GC).

    Args:
      label: names the group in messages ("multi-worker", "async-ps").
      stop_at_exit: see below.
      private_network: run every child in one loopback-only network namespace (see netns.py).
        Where the system refuses namespaces, a warning says so once and the children use the host
        network; `network_isolated` tells which. Inside a private network already (a child of
        another group), the children inherit it and no new one is made.
    """

    def __init__(self, label: str, stop_at_exit: bool = True, private_network: bool = True):
        self.label = label
        # stop_at_exit=False: at interpreter exit leave the children to the stdin-EOF rule, so
        # they exit the moment this process is gone, not before. async-ps servers use it:
        # TensorFlow's own clean-up at exit still talks to them (killing them first floods the
        # log with connection errors). Their pipe's write end is duplicated into a bare fd that
        # nothing closes before the process ends.
        self.stop_at_exit = stop_at_exit
        self.children: list[Child] = []
        self.network = (
            netns.open_network(f"{label} cluster") if private_network else netns.PrivateNetwork(False)
        )
        # A group made by a child (the async-ps coordinator's servers) keeps its logs inside its
        # parent group's folder: that child is usually ended by a signal, with no chance to clean
        # up, and the parent's stop() removes the whole tree.
        parent_logs = os.environ.get(LOG_DIR_ENV)
        parent_logs = parent_logs if parent_logs and os.path.isdir(parent_logs) else None
        self.log_dir = Path(
            tempfile.mkdtemp(prefix="workbench-cluster-", dir=parent_logs)
            if parent_logs
            else owned_folder("workbench-cluster-")  # (a killed launcher's go at the next start)
        )
        self._stopped = False
        _live_groups.add(self)
        # Stops the processes even if the owner is garbage collected without stop().
        self._finalizer = weakref.finalize(self, _stop_group, self.children, self.network, self.log_dir)
        self._finalizer.atexit = stop_at_exit

    @property
    def network_isolated(self) -> bool:
        """True when the children run in a private, loopback-only network."""
        return self.network.isolated

    def start(self, role: str, index: int, module: str, env: dict[str, str], args=()) -> Child:
        if self._stopped:
            raise RuntimeError(
                f"The {self.label} process group was stopped; {role} {index} cannot be started in it. "
                "Fix: make a new ProcessGroup for a new cluster."
            )
        log_path = self.log_dir / f"{role}-{index}.log"
        tmp_dir = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{role}-{index}-", dir=self.log_dir))
        child_env = {
            **os.environ,
            **env,
            **self.network.env(),
            TASK_ENV: f"{role}:{index}",
            LOG_DIR_ENV: str(self.log_dir),
            "TMPDIR": str(tmp_dir),  # Python's tempfile (so AutoGraph) and TensorFlow's C++ use it
            TMP_DIR_ENV: str(tmp_dir),
            "PYTHONUNBUFFERED": "1",
        }
        tf_setup.hold_back_cpp_logs(child_env)
        child_env[LAUNCHER_PID_ENV] = str(os.getpid())
        with open(log_path, "wb") as log:
            # The workbench's own modules are forked from a process that has imported TensorFlow
            # already (fork_server.py): milliseconds instead of seconds; None: not here.
            popen = fork_client.start_process(
                module, args, child_env, log.fileno(), self.network.namespace_fds()
            )
            if popen is None:
                argv, pass_fds = self.network.wrap([sys.executable, "-m", module, *args])
                popen = subprocess.Popen(
                    argv,
                    env=child_env,
                    stdin=subprocess.PIPE,  # held open: EOF tells the child its parent is gone
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # interrupts aimed at the kernel do not reach it
                    close_fds=True,
                    pass_fds=pass_fds,  # the namespace descriptors, for the netns.py join wrapper
                )
        child = Child(role, index, popen, log_path, tmp_dir)
        if not self.stop_at_exit:
            child.keepalive_fd = os.dup(popen.stdin.fileno())
        self.children.append(child)
        return child

    def port_open(self, port: int) -> bool:
        """Whether a child listens on `port` in the children's network (the launcher's own
        connect cannot tell when they run in a private one; this reads /proc instead)."""
        if not self.network.isolated or self.network.inherited:
            return port_open(port)
        for child in self.alive():
            with contextlib.suppress(OSError):
                # Not a child that has yet to enter the namespace: its /proc shows the host's.
                if os.readlink(f"/proc/{child.pid}/ns/net") == self.network.ns_id:
                    return any(p == port for _, p in netns.listening_sockets(child.pid))
        return False

    def unexpected_exits(self) -> list[Child]:
        return [c for c in self.children if c.popen.poll() is not None and not c.expected_exit]

    def alive(self) -> list[Child]:
        return [c for c in self.children if c.popen.poll() is None]

    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL whatever is still there after `grace` seconds; reaps them all,
        then removes the log folder (unless WORKBENCH_KEEP_LOGS=1): read `log_tail()` before."""
        self._stopped = True
        _stop_group(self.children, self.network, self.log_dir, grace)


def _stop_group(children: list[Child], network, log_dir: Path, grace: float = 2.0) -> None:
    _stop_children(children, grace)
    network.close()
    for c in children:  # a child killed by SIGKILL could not remove its own
        shutil.rmtree(c.tmp_dir, ignore_errors=True)
    if os.environ.get(KEEP_LOGS_ENV) != "1":
        shutil.rmtree(log_dir, ignore_errors=True)


def remove_own_tmp_dir() -> None:
    """Child side, as it exits hard (os._exit skips TensorFlow's clean-up of its AutoGraph files):
    removes the temp folder its group made for it. Nothing outside a launched process."""
    folder = os.environ.get(TMP_DIR_ENV)
    if folder and os.path.basename(folder).startswith(TMP_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def _stop_children(children: list[Child], grace: float = 2.0) -> None:
    alive = [c for c in children if c.popen.poll() is None]
    for c in alive:
        c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    for c in alive:
        if c.popen.poll() is None:
            c.send_signal(signal.SIGKILL)
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
        c.close_handle()


def _stop_all_groups() -> None:
    """Interpreter exit (core/exit.py, after the pools): the groups that are not a pool's."""
    for group in list(_live_groups):
        with contextlib.suppress(Exception):
            if group.stop_at_exit:
                group.stop(grace=1.0)
            elif os.environ.get(KEEP_LOGS_ENV) != "1":
                # Its children outlive us by design and write on into their open (now unlinked)
                # log files; the folder itself must not outlive us.
                shutil.rmtree(group.log_dir, ignore_errors=True)


process_exit.on_exit("process groups", _stop_all_groups)
