"""What every warm pool shares, wherever its processes run (launch/pool.py: local processes;
launch/ray_pool.py: Ray actors): the bookkeeping pool.py's rules read (shape, state, runs, idle
time), handing the next run's work to the members, and reading what they said while idle.

A pool subclass provides `tasks` (launcher.Task, the members that run work), `group` (its
members, with `children`), `channel` (`messages`, `send`, `broadcast`), `dead_member()`,
`processes`, `start()`, `stop()` and `describe()`.
"""

from __future__ import annotations

import queue
import threading
import time


class PoolCommon:
    def __init__(self, backend: str, plan, keep: bool = True):
        self.backend = backend
        self.shape = plan.shape()
        self.keep = keep  # False: the old path, one pool per run (pool=False)
        self.idle_timeout = plan.idle_timeout
        self.extra: list[dict] = []  # processes a member started itself (async-ps servers)
        self.runs = 0  # runs started on this pool
        self.state = "busy"  # busy | idle | retired
        self.idle_since: float | None = None
        self.started_at = time.time()
        self.started_in_background = False  # prestart(): before any run asked for it
        self._timer: threading.Timer | None = None

    @property
    def fresh(self) -> bool:
        return self.runs == 0

    def send_work(self, payload: bytes, number: int) -> None:
        """Hands the next run's work to every (already connected) member of a warm pool."""
        for member in self.group.children:
            member.expected_exit = False  # it was set by the last run's results
        for task in self.tasks:
            self.channel.send(task.name, {"type": "work", "payload": payload, "run": number})

    def dead_member(self) -> str:
        raise NotImplementedError

    def drain(self) -> str:
        """Reads what the members said while idle (heartbeats); returns a problem, if any."""
        problem = ""
        while True:
            try:
                task, message = self.channel.messages.get_nowait()
            except queue.Empty:
                return self.dead_member() or problem  # (how it ended says more than a closed socket)
            if message.get("type") in ("disconnected", "error"):
                problem = problem or f"{task.replace(':', ' ')} disconnected"
