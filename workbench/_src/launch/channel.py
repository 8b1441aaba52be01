"""The authenticated channel between a launcher and the processes it started.

Channel (parent side) listens on 127.0.0.1 with a random key (multiprocessing.connection); the
children connect back: they send hello, heartbeats, events and results; the parent sends the
work and stop requests. A connection must know the key and introduce itself with the pid of a
process the group started, or it is dropped. ParentLink is the child side.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import socket
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

from workbench._src.launch.processes import LOOPBACK, TASK_ENV, ProcessGroup

CHANNEL_ENV = "WORKBENCH_CHANNEL"  # host:port of the parent's channel
CHANNEL_KEY_ENV = "WORKBENCH_CHANNEL_KEY"  # hex key; in the environment, never on the command line


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
