"""One process of a pool placed on a Ray cluster: a Ray actor (placements/ray/pool.py makes them).

The actor is to a Ray pool what `python -m workbench._src.placements.local.worker_main` is to a local one:
it runs the same `launch/member.py` `serve` loop (build this process's replicator, run work items until
"shutdown"), or, for an async-ps parameter server or worker, a TensorFlow server. What differs is
the link to the launcher: no socket of our own, but Ray's actor calls. The launcher calls
`deliver` (work, stop, shutdown) and long-polls `poll` for what the member said (hello,
heartbeats, events, results, errors); a heartbeat thread here goes quiet when the process
freezes, and a member that goes unpolled leaves (`_leave_when_orphaned`).

Nothing here imports Ray, TensorFlow or the backends at import time: the launcher imports this
module by name (as a local launcher names worker_main) and wraps the class with ray.remote.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import tempfile
import threading
import time

from workbench._src.placements.local.channel import LinkInbox
from workbench._src.placements.local.processes import TASK_ENV, TMP_DIR_ENV, TMP_PREFIX
from workbench._src.placements.proc import process_start_ticks

# A member's heartbeat period: well under the launcher's heartbeat_timeout (10 s by default), so
# a few late beats are not silence; as a local member's.
HEARTBEAT_SECONDS = 0.5
# A one-second sleep of the orphan watch that ends this much late means the process could not
# run (a call held the GIL, or the machine starved it): the orphan count starts again, since the
# launcher's polls were held up the same way.
STALL_SECONDS = 1.0


class ActorLink(LinkInbox):
    """The member's side of the launcher's messages, carried by actor calls."""

    def __init__(self, task: str):
        self.task = task
        self.open_inbox()
        self.outbox: queue.Queue = queue.Queue()
        self.send({"type": "hello", "task": task, "pid": os.getpid()})

    def send(self, message: dict) -> None:
        self.outbox.put(message)

    def take(self, timeout: float) -> list[dict]:
        """What the member said since the last call (waits up to `timeout` for something)."""
        try:
            taken = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                taken.append(self.outbox.get_nowait())
            except queue.Empty:
                return taken

    def start_heartbeat(self) -> None:
        def beat():
            while True:
                time.sleep(HEARTBEAT_SECONDS)
                self.send({"type": "heartbeat"})

        threading.Thread(target=beat, name="workbench heartbeat", daemon=True).start()


class Member:
    """A Ray actor: one process of a Ray-placed pool (a worker, a coordinator or a TF server)."""

    def __init__(self, role: str, index: int, orphan_timeout: float = 30.0):
        self.role, self.index = role, index
        self.link: ActorLink | None = None
        self.server = None  # a TensorFlow server (async-ps parameter servers and workers)
        self.last_poll = time.monotonic()
        threading.Thread(target=self._leave_when_orphaned, args=(orphan_timeout,), daemon=True).start()
        # Its own temp folder, as a local member has (AutoGraph writes files there); removed by
        # `clean_up` before the launcher kills the actor.
        self.tmp_dir = tempfile.mkdtemp(prefix=TMP_PREFIX)
        os.environ["TMPDIR"] = os.environ[TMP_DIR_ENV] = self.tmp_dir
        tempfile.tempdir = self.tmp_dir

    def where(self) -> dict:
        """This process's node address, pid, and a port free on its node for its TF server."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {
            "address": ray.util.get_node_ip_address(),
            "port": port,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "tmp_dir": self.tmp_dir,
            "started": process_start_ticks(os.getpid()),  # (with the pid: this very process)
        }

    def start(self, env: dict) -> None:
        """Runs launch/member.py `serve` on a thread with `env` (TF_CONFIG, the backend's options)."""
        os.environ.update(env)
        os.environ[TASK_ENV] = f"{self.role}:{self.index}"
        entered = time.time()

        def serve():
            # TensorFlow first, then the hello: loading its libraries can hold the interpreter
            # for seconds at a time, and a member's heartbeats count from its hello (the start
            # as a whole is bounded by startup_timeout).
            from workbench._src.core.tf_setup import keras_extras_skipped

            with keras_extras_skipped():  # a third of the import, features a worker never uses
                import tensorflow  # noqa: F401

            from workbench._src.launch.member import serve

            self.link = ActorLink(f"{self.role}:{self.index}")
            self.link.start_heartbeat()
            try:
                code = serve(self.link, entered)
            finally:
                self.clean_up()
            self.link.send({"type": "exited", "code": code})

        threading.Thread(target=serve, name="workbench member", daemon=True).start()

    def serve_tf(self, cluster: dict, threads: int | None) -> None:
        """Starts this member's TensorFlow server (an async-ps parameter server or worker)."""
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        from workbench._src.placements.local.server_main import start_server

        self.server = start_server(cluster, self.role, self.index, threads)

    def deliver(self, message: dict) -> None:
        if self.link is not None:
            self.link.receive(message)

    def poll(self, timeout: float) -> list[dict]:
        """What the member said (a server member, which says nothing, beats on its own)."""
        self.last_poll = time.monotonic()
        if self.link is None:
            time.sleep(timeout)
            return [{"type": "heartbeat"}]
        return self.link.take(timeout)

    def _leave_when_orphaned(self, orphan_timeout: float) -> None:
        """The launcher polls every member about once a second for the pool's whole life. A member
        that goes `orphan_timeout` seconds unpolled has lost it (its node cut off, the launcher
        gone without Ray noticing yet) and leaves, as a local member leaves when its parent's
        pipe closes: Ray alone would keep a cut-off node's actor until its raylet gives up.

        Only time this process could run counts: while one call held its GIL (or the machine
        starved it) this thread slept late, and so did the launcher's polls, waiting in Ray's queue
        for the same GIL. After such a stall the count starts again, or a member busy for
        `orphan_timeout` left as orphaned at the stall's end, its polls still waiting (a -n 3
        run's actor, holding the GIL for 8 CPU-s that took over 30 s)."""
        ticked = time.monotonic()
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            if now - ticked > 1.0 + STALL_SECONDS:
                self.last_poll = max(self.last_poll, now)
            ticked = now
            if now - self.last_poll > orphan_timeout:
                self.clean_up()
                os._exit(5)

    def clean_up(self) -> None:
        """Removes this process's temp folder (the launcher then ends the actor)."""
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def remove_left_behind(self, folders: list[str]) -> None:
        """Removes the temp folders of members on this node that died without cleaning up
        (killed by a signal). Only a member's folder: a sibling of this one's, with its prefix."""
        parent = os.path.dirname(self.tmp_dir)
        for folder in folders:
            if os.path.dirname(folder) == parent and os.path.basename(folder).startswith(TMP_PREFIX):
                shutil.rmtree(folder, ignore_errors=True)
