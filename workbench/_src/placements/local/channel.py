"""The authenticated channel between a launcher and the processes it started.

Channel (parent side) listens on a Unix socket in a private folder (mode 0700) with a random key
(multiprocessing.connection); the children connect back: they send hello, heartbeats, events and
results; the parent sends the work and stop requests. A Unix socket because the children may run
in a private network namespace (netns.py) where the launcher's 127.0.0.1 is not theirs, while a
path in the file system is reachable from every network namespace. A connection must know the key
and come from a process the group started (the kernel's SO_PEERCRED pid, which the hello must
repeat), or it is dropped. ParentLink is the child side.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import shutil
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

from workbench._src.core.owned_folders import pid_alive
from workbench._src.placements.local.processes import (
    KEEP_LOGS_ENV,
    LAUNCHER_PID_ENV,
    LOG_DIR_ENV,
    TASK_ENV,
    ProcessGroup,
    remove_own_tmp_dir,
)
from workbench._src.placements.proc import socket_folder

CHANNEL_ENV = "WORKBENCH_CHANNEL"  # path of the parent's Unix socket
CHANNEL_KEY_ENV = "WORKBENCH_CHANNEL_KEY"  # hex key; in the environment, never on the command line
# How long a hello from a pid the group has not recorded yet waits for the record before it is
# refused: a child can say hello before its launcher's thread, held up on a busy machine, records
# the pid Popen returned. It bounds how long an impostor's connection is held open.
PID_RECORD_WAIT = 5.0
# How long a new connection may take to say hello: past it, it is dropped.
HELLO_WAIT = 10.0
# A member's heartbeat period (see launch/watch.py): well under the heartbeat_timeout.
HEARTBEAT_SECONDS = 0.5
# A member that lost its launcher's channel waits this long for the launcher to be gone before it
# removes the launcher's folders (a live launcher may still read the logs for its error message).
# It bounds only the unexpected case of a broken channel with a living launcher.
ORPHAN_CLEANUP_WAIT = 10.0


class Channel:
    """Parent side: accepts the group's children, queues their messages, sends them work."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.key = secrets.token_bytes(32)
        self.folder = socket_folder("workbench-channel-")  # only this user may reach the socket
        self.address = os.path.join(self.folder, "channel.sock")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.key)
        self.messages: queue.Queue = queue.Queue()  # (task, message dict)
        self._connections: dict[str, Connection] = {}
        self._send_lock = threading.Lock()
        self._closed = False
        self.rejected = 0  # connections dropped: wrong key or not one of our pids
        threading.Thread(target=self._accept_loop, name="workbench channel", daemon=True).start()

    def env(self) -> dict[str, str]:
        return {CHANNEL_ENV: self.address, CHANNEL_KEY_ENV: self.key.hex()}

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
            hello = conn.recv() if conn.poll(HELLO_WAIT) else None
        except (EOFError, OSError):
            hello = None
        task = hello.get("task") if isinstance(hello, dict) else None
        peer = _peer_pid(conn)
        pid = hello.get("pid") if task else None
        deadline = time.monotonic() + PID_RECORD_WAIT
        while task and pid not in self.group.pids() and time.monotonic() < deadline:
            # A child can say hello before the group has recorded its pid: on a busy machine the
            # launcher's thread may be held between Popen's return and the record. Refused, the
            # child read EOF, exited 0, and its run failed naming it.
            time.sleep(0.02)
        if not task or pid not in self.group.pids() or (peer is not None and peer != pid):
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

    def unread(self, task: str) -> bool:
        """Whether `task`'s socket holds bytes its reader thread has not taken yet (the thread,
        not the member, held up: a busy launcher). Asked before a member is called silent."""
        conn = self._connections.get(task)
        if conn is None:
            return False
        try:
            return conn.poll(0)  # (select on the socket: reads nothing)
        except (OSError, ValueError, EOFError):
            return False

    def close(self) -> None:
        """Stops listening, drops every connection, removes the socket's folder."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):  # wake the accept() blocked in the accept thread
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1)
                s.connect(self.address)
        with contextlib.suppress(Exception):
            self._listener.close()
        for conn in list(self._connections.values()):
            with contextlib.suppress(Exception):
                conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _peer_pid(conn: Connection) -> int | None:
    """The pid of the process at the other end of a Unix socket, as the kernel knows it."""
    peercred = getattr(socket, "SO_PEERCRED", None)  # Linux; elsewhere the hello's pid must do
    if peercred is None:
        return None
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            if s.family != socket.AF_UNIX:
                return None
            creds = s.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
    except (OSError, ValueError):
        return None
    return struct.unpack("3i", creds)[0]


# ----- child side ------------------------------------------------------------------------------
class LinkInbox:
    """A member's side of the launcher's messages, whatever carries them (a ParentLink's socket,
    a Ray actor's method calls): a "stop" goes to `on_stop` at once (the run that is going; none
    between runs), anything else waits for `next_message()`. One reader, so a stop listener of
    one run can never swallow the next run's work."""

    def open_inbox(self) -> None:
        self.on_stop = None
        self.current_run = None  # the run number of the work being done (stops name theirs)
        self.stop_pending = False  # this run's stop came before its run loop started (a preempt: its cause)
        self._inbox: queue.Queue = queue.Queue()

    def receive(self, message: dict | None) -> None:
        """One message from the launcher; None: the launcher is gone. A stop's "preempt" names
        the cause when the launcher itself was preempted (every member then saves and stops)."""
        if message is not None and message.get("type") == "stop":
            if message.get("run") != self.current_run:
                return  # a late stop of a run that has ended: not for this one
            callback = self.on_stop
            if callback is not None:
                callback(message.get("preempt"))
            else:
                self.stop_pending = message.get("preempt") or True
        else:
            self._inbox.put(message)

    def next_message(self) -> dict | None:
        """The launcher's next work or shutdown message; None when it has gone."""
        message = self._inbox.get()
        if message is not None and message.get("type") == "work":
            self.stop_pending, self.current_run = False, message.get("run")
        return message


class ParentLink(LinkInbox):
    """Child side: connects to the parent's channel; exits when the parent goes away."""

    def __init__(self):
        self.task = os.environ.get(TASK_ENV, "worker:0")
        address = os.environ[CHANNEL_ENV]
        key = bytes.fromhex(os.environ.pop(CHANNEL_KEY_ENV))  # not inherited by anything we start
        self.conn = Client(address, family="AF_UNIX", authkey=key)
        _left_behind_by_parent.append(os.path.dirname(address))  # ours to remove if it dies
        self._lock = threading.Lock()
        self.send({"type": "hello", "task": self.task, "pid": os.getpid()})

    def send(self, message: dict) -> None:
        try:
            with self._lock:
                self.conn.send(message)
        except OSError:
            _clean_up_if_orphaned()  # this may be the last thing the process does
            raise

    def recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            _clean_up_if_orphaned()  # this may be the last thing the process does
            raise

    def start_reader(self) -> None:
        """Reads the parent's messages on a thread (see LinkInbox.receive)."""
        self.open_inbox()

        def read():
            while True:
                try:
                    message = self.recv()
                except (EOFError, OSError):
                    self.receive(None)  # the parent is gone
                    return
                self.receive(message)

        threading.Thread(target=read, name="workbench parent reader", daemon=True).start()

    def start_heartbeat(self, every: float = HEARTBEAT_SECONDS) -> None:
        def beat():
            while True:
                time.sleep(every)
                try:
                    self.send({"type": "heartbeat"})
                except (OSError, ValueError):
                    _clean_up_if_orphaned()
                    remove_own_tmp_dir()
                    os._exit(3)  # the parent is gone

        threading.Thread(target=beat, name="workbench heartbeat", daemon=True).start()


_left_behind_by_parent: list[str] = []  # the parent's folders, removed here if it dies first
_parent_pid = 0  # the launcher, whose death we outlive by no more than a moment (set below)


def exit_when_parent_dies() -> None:
    """Child side: a thread that ends this process when stdin (the parent's pipe) reaches EOF.

    A parent that dies (a killed kernel, a launcher ended by a signal) runs no clean-up: its
    children remove what it left, the group's log folder and the channel's socket folder, and
    their own temp folders.
    """

    global _parent_pid
    # Our parent, unless a fork server forked us for it (fork_server.py): then the launcher that
    # asked, whose pid the group put in our environment.
    _parent_pid = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())

    def watch():
        # EOF is the usual sign. The launcher's pid is looked at too, every second: EOF needs
        # every copy of the pipe's write end closed, and a process forked from the launcher without
        # exec (after the pipe was made) holds one for as long as it lives. One -n 3 suite run
        # left a child waiting for ever that way, its launcher long dead.
        import select

        with contextlib.suppress(Exception):
            stdin = sys.stdin.buffer.raw
            while pid_alive(_parent_pid):
                if select.select([stdin], [], [], 1.0)[0] and not stdin.read(1):
                    break  # EOF
        _clean_up_if_orphaned()
        remove_own_tmp_dir()
        os._exit(4)

    threading.Thread(target=watch, name="workbench parent watch", daemon=True).start()


def _clean_up_if_orphaned() -> None:
    """Removes the dead parent's folders; only once it is really gone (a live launcher may still
    read the logs for its error message). A dying parent closes its pipes and sockets a moment
    before its children are handed to a new parent; a big process on a busy machine takes a while
    to get there. A live parent closes neither while we run, so the wait is only paid in the
    unexpected case of a broken channel."""
    deadline = time.monotonic() + ORPHAN_CLEANUP_WAIT
    while pid_alive(_parent_pid):  # (a dead parent not yet reaped is a zombie: not alive)
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    folders = list(_left_behind_by_parent)
    if os.environ.get(KEEP_LOGS_ENV) != "1" and os.environ.get(LOG_DIR_ENV):
        folders.append(os.environ[LOG_DIR_ENV])
    for folder in folders:
        # Only folders the workbench made: the variables could be stale or set by hand.
        if os.path.basename(folder).startswith(("workbench-cluster-", "workbench-channel-")):
            shutil.rmtree(folder, ignore_errors=True)
