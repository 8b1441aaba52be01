"""The launcher's side of a Ray pool: its actors as members (`RayMember`, `RayMembers`) and the
link to them (`RayLink`), on Ray's own primitives (placements/ray/member.py is the other end).

  - What a member says comes on its streaming generator (`Member.messages`, an ObjectRefGenerator
    here); what a TF server member does is one pending call (`Member.serve_tf`). One thread here
    waits on all of them at once with `ray.wait` and queues each message as (task, message),
    as the local placement's channel does.
  - A dead actor is known from Ray's own error on its next item or its pending call
    (ActorDiedError with the node's death, ActorUnavailableError): no missed poll decides it.
  - What the launcher says (work, stop, shutdown) goes by actor calls (`Member.deliver`), each
    waited for: calls to a threaded actor may run out of order, and a member's messages must not.
  - Every Ray call here holds Ray's own connect/shutdown lock (`_ray_shutdown_lock`): a user's
    `ray.shutdown()` then waits for a wait in progress (<= WAIT_SECONDS) instead of tearing the
    connection down under it, which can abort this whole process in Ray's C++ core (a suite's
    test process was lost that way: `ray.shutdown()` right after a run, its pool still warm).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time

from workbench._src.placements.proc import (
    STACKS_FILE,
    STACKS_SIGNAL,
    CpuWaitCounter,
    boot_id,
    dumped_stacks,
    process_cpu_seconds,
    process_start_ticks,
    process_stopped,
    same_process_running,
)
from workbench._src.placements.ray.instance_logs import instance_end

# How long one ray.wait waits for any member to say something: it bounds how late the link sees
# that it was closed, nothing else (a message ends the wait at once).
WAIT_SECONDS = 0.5
# A pause between two waits, out of Ray's lock: a thread waiting for it (ray.shutdown, ray.init)
# gets it here (Python's locks are not fair: released and taken again at once, it can starve them).
LOCK_GAP_SECONDS = 0.001
# How long a message to members is waited for: a dead member answers at once (Ray's error), a
# frozen or cut-off one never, and it must not hold the launcher longer than this.
SEND_TIMEOUT = 5.0


def _ray_shutdown_lock():
    """The lock Ray holds around `ray.init`'s connect and `ray.shutdown()` (re-entrant). A private
    name of Ray's (2.60): without it, no lock, and a shutdown under a wait is left to chance."""
    import ray._private.worker as ray_worker

    return getattr(ray_worker, "_connect_or_shutdown_lock", None) or contextlib.nullcontext()


class RayMember:
    """One actor of the pool, as the launcher sees a local child."""

    def __init__(
        self,
        role: str,
        index: int,
        actor,
        where: dict,
        on_this_node: bool,
        may_die: bool = False,
        bundle: int = 0,
    ):
        self.role, self.index = role, index
        self.node, self.port, self.node_id = where["address"], where["port"], where["node_id"]
        self.on_this_node = on_this_node  # the launcher's own Ray node
        self.bundle = bundle  # its bundle's index in the pool's placement group
        self.may_die = may_die  # an async-ps worker server: the run goes on without it (replace.py)
        self.expected_exit = False
        self.own_pids: list = []  # (none: on Ray every server is a member of its own)
        self._take(actor, where)

    def _take(self, actor, where: dict) -> None:
        """The actor this member is (at its start, or a replacement's on the same node and port)."""
        self.actor, self.pid, self.tmp_dir = actor, where["pid"], where["tmp_dir"]
        # Its CPU time is readable here when it runs on this machine (this process's Ray node, or
        # another node on the same kernel: several nodes of one machine, each in its own network)
        # and this /proc shows it (the same pid started at the same moment: not a reused pid):
        # its start and its silences are then judged by its progress. Elsewhere only its
        # heartbeats tell, and its start is bounded by startup_timeout alone. (Its death is
        # read from /proc on this node only: on another, Ray's report names the node's loss.)
        started = where.get("started")
        same_machine = self.on_this_node or (
            where.get("boot_id") is not None and where.get("boot_id") == boot_id()
        )
        self._started = started
        self._cpu_readable = same_machine and started is not None and started == process_start_ticks(self.pid)
        self._cpu_waits = CpuWaitCounter()
        self.dead = False
        self.death = ""
        self.exited = False  # it left its serve loop (shutdown)

    def replaced_by(self, actor, where: dict) -> None:
        """A new actor serves in this member's place (a lost async-ps worker server): alive again."""
        self._take(actor, where)

    @property
    def task(self) -> str:
        return f"{self.role}:{self.index}"

    @property
    def where(self) -> str:
        return f"pid {self.pid} on node {self.node}"

    @property
    def killed(self) -> bool:
        return self.dead

    def exit_description(self) -> str:
        if not self.dead:
            return "still running"
        return f"died: its Ray actor ended, {self.death}" if self.death else "died: its Ray actor ended"

    def log_tail(self, lines: int = 15) -> str:
        return ""  # its output is in Ray's logs on its node (`ray logs`); errors come as messages

    def stacks(self) -> str:
        """Its threads' stacks, dumped by its faulthandler into its temp folder, where this
        process can signal it and read the file (its machine); "" elsewhere (a frozen actor
        answers no call)."""

        def signal_it() -> bool:
            if not (self._cpu_readable and same_process_running(self.pid, self._started)):
                return False  # (another machine, or its pid is another process's by now)
            try:
                os.kill(self.pid, STACKS_SIGNAL)
                return True
            except OSError:
                return False

        return dumped_stacks(self.pid, signal_it, os.path.join(self.tmp_dir, STACKS_FILE))

    def process_gone(self) -> bool:
        """Its process has ended, as this node's /proc shows (False where it cannot be read)."""
        if not (self._cpu_readable and self.on_this_node):
            return False
        return not same_process_running(self.pid, self._started)

    def cpu_seconds(self, with_own: bool = False) -> float | None:
        """Its CPU time, where it can be read (the launcher tells a busy member from a frozen
        one by it, as for a local child); None on another node: only its heartbeats tell."""
        return process_cpu_seconds(self.pid) if self._cpu_readable else None

    def cpu_wait(self, with_own: bool = False) -> tuple[float, bool] | None:
        """How its threads wait for a CPU, where it can be read (this node)."""
        return self._cpu_waits.read([self.pid]) if self._cpu_readable else None

    def stopped(self) -> bool:
        """Whether it is stopped now, where its state can be read (this node)."""
        return self._cpu_readable and process_stopped(self.pid)


class RayMembers:
    """The pool's actors, with the process group's questions (launch/watch.py asks them)."""

    def __init__(self, members: list[RayMember]):
        self.children = members

    def unexpected_exits(self) -> list[RayMember]:
        return [m for m in self.children if m.dead and not m.expected_exit and not m.may_die]


class RayLink:
    """Messages to and from the members by Ray's calls, object refs and streaming generators,
    queued as the local channel queues them (a `Link`)."""

    def __init__(
        self, ray, members: RayMembers, working: set[str], report_to: str, local_root: str | None = None
    ):
        self.ray = ray
        self.local_root = local_root  # a local instance's folder: its logs say why its node ended
        self.members = {m.task: m for m in members.children}
        self.working = working  # the members that run work (a TF server member takes no messages)
        self.messages: queue.Queue = queue.Queue()  # (task, message dict)
        self.report_to = report_to  # the task whose run hears of a lost async-ps worker
        self.on_server_lost = None  # called with a lost `may_die` member (replace.py ServerReplacer.lost)
        self.current_run: int | None = None  # the run whose work the members have (None between runs)
        self._watched: dict = {}  # ObjectRefGenerator or ObjectRef -> task
        self._lock = threading.Lock()
        self._closed = False
        self._reader: threading.Thread | None = None
        self._ray_calls = _ray_shutdown_lock()  # held by each of this link's Ray calls

    def watch(self, task: str, waitable) -> None:
        """Follows a member's stream (working members) or pending serve call (TF servers)."""
        with self._lock:
            self._watched[waitable] = task
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name="workbench ray link", daemon=True)
            self._reader.start()

    def _read_loop(self) -> None:
        while not self._closed:
            with self._lock:
                watched = list(self._watched)
            if not watched:  # (before start(), and after every member has left)
                time.sleep(WAIT_SECONDS)
                continue
            with self._ray_calls:  # (a ray.shutdown() waits for this wait; none starts in one)
                if not self._wait_once(watched):
                    return
            time.sleep(LOCK_GAP_SECONDS)

    def _wait_once(self, watched: list) -> bool:
        """One ray.wait on the members' streams and calls, and what came; False once Ray is gone."""
        ray = self.ray
        if not ray.is_initialized():
            # ray.shutdown() (the user's, a test's, the exit's) ended the members with the
            # connection. No Ray call may follow: with auto-connect on (Ray imported before
            # the workbench), one would start a new instance.
            for waitable in watched:
                self._lost(waitable, SystemExit("Ray was shut down"))
            return False
        try:
            ready, _ = ray.wait(watched, num_returns=1, timeout=WAIT_SECONDS)
        # SystemExit: Ray raises it in a waiting thread when the connection goes (a Ray without
        # the lock above); the members went with the connection.
        except (Exception, SystemExit) as error:  # noqa: BLE001
            for waitable in watched:
                self._lost(waitable, error)
            return False
        for waitable in ready:
            self._take(waitable)
        return True

    def _take(self, waitable) -> None:
        ray, task = self.ray, self._watched.get(waitable)
        if task is None:
            return
        try:
            if isinstance(waitable, ray.ObjectRefGenerator):
                said = ray.get(next(waitable))
            else:
                said = [ray.get(waitable)]  # a serve call that returned: told to leave
        except StopIteration:  # the member's stream ended: it left
            self._forget(waitable)
            self.members[task].exited = True
            return
        except (Exception, SystemExit) as error:  # noqa: BLE001 - Ray's error: the actor is gone
            self._lost(waitable, error)
            return
        if not isinstance(waitable, ray.ObjectRefGenerator):
            self._forget(waitable)
            self.members[task].exited = True
            return
        for message in said:
            if message.get("type") == "exited":
                self.members[task].exited = True
            else:
                if task == self.report_to and message.get("type") in ("result", "error"):
                    self.current_run = None  # (its run is over: a server lost now is not replaced)
                self.messages.put((task, message))

    def _forget(self, waitable) -> None:
        with self._lock:
            self._watched.pop(waitable, None)

    def _lost(self, waitable, error: BaseException) -> None:
        """Ray said the member's actor is gone (or this process's connection is)."""
        task = self._watched.get(waitable)
        self._forget(waitable)
        member = self.members.get(task)
        if member is None or self._closed or member.exited:
            return
        member.dead, member.death = True, death_reason(error)
        if self.local_root and node_ended(error):  # (this machine's own instance ended)
            ended = instance_end(self.local_root)
            member.death += f"; the local Ray instance ended ({ended})" if ended else ""
        if member.may_die:  # the run goes on; the coordinator hears of it, a new one may come
            if self.on_server_lost is not None:
                self.on_server_lost(member)
        else:
            self.messages.put((task, {"type": "disconnected"}))

    def send(self, task: str, message: dict, timeout: float = SEND_TIMEOUT) -> bool:
        member = self.members.get(task)
        if member is None or member.dead:
            return False
        if message.get("type") == "work":
            self.current_run = message.get("run")
        with self._ray_calls:
            if not self.ray.is_initialized():
                return False
            try:  # waited for: messages to one member arrive in the order sent
                self.ray.get(member.actor.deliver.remote(message), timeout=timeout)
                return True
            except Exception:  # noqa: BLE001 - a dead or frozen member; its stream says so
                return False

    def unread(self, task: str) -> bool:
        return False  # (what a member streams waits in Ray's object store: the reader takes it)

    def broadcast(self, message: dict, timeout: float = SEND_TIMEOUT) -> None:
        """Sends to every working member at once; waits up to `timeout` for all of them."""
        self.tell([t for t in self.working], message, timeout)

    def tell(self, tasks: list[str], message: dict, timeout: float) -> None:
        """Sends `message` to `tasks` at once and waits up to `timeout` for them all."""
        with self._ray_calls:
            if not self.ray.is_initialized():
                return
            calls = []
            for task in tasks:
                member = self.members.get(task)
                if member is not None and not member.dead:
                    with contextlib.suppress(Exception):
                        calls.append(member.actor.deliver.remote(message))
            if calls:
                with contextlib.suppress(Exception):
                    self.ray.wait(calls, num_returns=len(calls), timeout=timeout)

    def close(self) -> None:
        """Stops reading; returns once the reader is out of Ray (a ray.shutdown() may follow)."""
        self._closed = True
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=4 * WAIT_SECONDS)


# Ray's words for an actor whose node ended, its own or its creator's (this process's, at a start),
# not only its process. ("node" and "died" alone are not enough: a killed process's error also
# speaks of "node deaths" in its advice.)
_NODE_ENDED = ("its node has died", "node was terminated", "node was preempted", "Owner's node has crashed")


def node_ended(error: BaseException) -> bool:
    """Ray says the node under the actor ended (on a local instance: the instance itself)."""
    return any(words in str(error) for words in _NODE_ENDED)


def death_reason(error: BaseException) -> str:
    """A short reason from Ray's error: the node's death when Ray names it, else its first line."""
    if isinstance(error, SystemExit):
        return "this process's Ray connection was shut down (ray.shutdown())"
    text = str(error)
    if node_ended(error):
        if "Owner's node has crashed" in text:  # (its creator's node: this process's, at a start)
            return "the Ray node of the process that created it ended"
        return "its node died (Ray's node health check)"
    if "worker process has died" in text:  # a process killed or crashed
        return "its process ended unexpectedly (killed or crashed)"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:200]
