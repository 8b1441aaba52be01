"""One process of a pool placed on a Ray cluster: a Ray actor (placements/ray/placement.py makes them).

The actor is to a Ray pool what `python -m workbench._src.placements.local.worker_main` is to a local one:
it runs the same `launch/member.py` `serve` loop (build this process's replicator, run work items until
"shutdown"), or, for an async-ps parameter server or worker, a TensorFlow server. The link to the
launcher is Ray's own primitives (placements/ray/link.py is the other end):
  - `messages(env)` is a streaming generator (an ObjectRefGenerator for the caller): it starts the
    serve loop and yields what the member says (hello, heartbeats, events, results, errors) in
    order, and ends when the member leaves. Its next item failing with Ray's actor error is how the
    launcher learns of the actor's death (its process killed, its node gone).
  - `deliver(message)` is an actor call (work, stop, shutdown; and "placement_news" for the run
    going on, handed to it through launch/runtime.py: an async-ps worker server lost or replaced).
  - `serve_tf(...)` (TF server members) never returns while the server serves: its object ref
    failing is that member's death. `start_tf(..., port)` starts a replacement's server at the
    lost one's port, or says why it cannot (placements/ray/replace.py).
A heartbeat thread stays for what Ray cannot see: a frozen process (SIGSTOP, a hung call) is alive
to Ray, and only its silence tells; and a cut-off watch for what Ray does not end: a node cut off
from the head keeps running its actors (`_leave_when_cut_off`). A temp-folder cleaner (a tiny process of its own) removes the
member's temp folder however the actor ends, killed by a signal or its raylet included.

Nothing here imports Ray, TensorFlow or the backends at import time: the launcher imports this
module by name (as a local launcher names worker_main) and wraps the class with ray.remote.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from workbench._src.placements.local.channel import LinkInbox
from workbench._src.placements.local.processes import TASK_ENV, TMP_DIR_ENV, TMP_PREFIX
from workbench._src.placements.ports import free_ports
from workbench._src.placements.proc import STACKS_FILE, STACKS_SIGNAL, boot_id, process_start_ticks

# A member's heartbeat period: well under the launcher's heartbeat_timeout (10 s by default), so
# a few late beats are not silence; as a local member's.
HEARTBEAT_SECONDS = 0.5
# How long a "result" or "error" waits to be taken by the stream before the member goes on (to
# release_run_state, which can hold the GIL for long in TensorFlow's clear_session when a peer is
# unreachable): once taken, Ray's own threads deliver it without the GIL. It bounds only how long
# a member whose launcher stopped reading waits; a reading launcher takes it within milliseconds.
FLUSH_SECONDS = 5.0
# How long the stream gathers messages into one item after the first: a chief's per-step events
# (hundreds a second) then cost Ray a few dozen objects a second, not one each. It adds this much
# to how late the launcher hears anything; keep it well under a heartbeat period.
BATCH_SECONDS = 0.02
# A node cut off from the cluster's head is declared dead by the GCS, which cannot tell it; its
# raylet (Ray 2.60) then keeps it and its actors running for good: the one fault of this kind Ray
# does not end by itself. A member whose node has been unable to reach the GCS this long (or is
# declared dead) leaves. Only time this process could run counts (a stall starts the count
# again). It bounds how long a cut-off member lingers; keep it well above a loaded GCS's answer.
CUT_OFF_SECONDS = 30.0
CUT_OFF_CHECK_SECONDS = 5.0  # how often the member asks the GCS about its node
# A one-second sleep of the cut-off watch that ends this much late: the process could not run.
STALL_SECONDS = 1.0
# The cleaner: forked off twice so it is no child of the actor (Ray ends a dead worker's children),
# it waits for EOF on its stdin, which comes when the actor's process ends, however it ends.
CLEANER = """
import os, shutil, sys
if os.fork():
    os._exit(0)
sys.stdin.buffer.read()
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


class ActorLink(LinkInbox):
    """The member's side of the launcher's messages, carried by Ray (see the module's doc)."""

    def __init__(self, task: str):
        self.task = task
        self.open_inbox()
        self.outbox: queue.Queue = queue.Queue()  # (message or None: left, event set once yielded)

    def send(self, message: dict | None) -> None:
        """Queues `message` for the stream (None: the member has left). A result or an error
        waits until Ray has taken it from the stream (FLUSH_SECONDS at most)."""
        yielded = threading.Event()
        self.outbox.put((message, yielded))
        if message is not None and message.get("type") in ("result", "error"):
            yielded.wait(FLUSH_SECONDS)

    def stream(self):
        """What the member said, in batches of what came within BATCH_SECONDS, until it has left."""
        while True:
            batch = [self.outbox.get()]
            until = time.monotonic() + BATCH_SECONDS
            while batch[-1][0] is not None and time.monotonic() < until:
                try:
                    batch.append(self.outbox.get(timeout=max(0.0, until - time.monotonic())))
                except queue.Empty:
                    break
            said = [message for message, _ in batch if message is not None]
            if said:
                yield said  # (returns once Ray has serialized the batch and sent it on its way)
            for _, yielded in batch:
                yielded.set()
            if any(message is None for message, _ in batch):
                return

    def start_heartbeat(self) -> None:
        def beat():
            while True:
                time.sleep(HEARTBEAT_SECONDS)
                self.send({"type": "heartbeat"})

        threading.Thread(target=beat, name="workbench heartbeat", daemon=True).start()


class Member:
    """A Ray actor: one process of a Ray-placed pool (a worker, a coordinator or a TF server)."""

    def __init__(self, role: str, index: int):
        self.role, self.index = role, index
        self.link: ActorLink | None = None
        self.server = None  # a TensorFlow server (async-ps parameter servers and workers)
        self.leaving = threading.Event()
        # Its own temp folder, as a local member has (AutoGraph writes files there).
        self.tmp_dir = tempfile.mkdtemp(prefix=TMP_PREFIX)
        os.environ["TMPDIR"] = os.environ[TMP_DIR_ENV] = self.tmp_dir
        tempfile.tempdir = self.tmp_dir
        self.cleaner = _start_cleaner(self.tmp_dir)
        self.watching = False
        # Where it dumps its threads' stacks when the launcher finds it silent (a file in its
        # temp folder: the launcher reads it there when it runs on the launcher's machine).
        self.stacks_file = open(os.path.join(self.tmp_dir, STACKS_FILE), "a")  # noqa: SIM115 - kept open
        faulthandler.register(STACKS_SIGNAL, file=self.stacks_file, all_threads=True)

    def where(self) -> dict:
        """This process's node address, pid, and a port free on its node for its TF server."""
        import ray

        if not self.watching:  # (here, inside Ray: the constructor may run without it)
            self.watching = True
            threading.Thread(
                target=self._leave_when_cut_off, name="workbench cut-off watch", daemon=True
            ).start()
        return {
            "address": ray.util.get_node_ip_address(),
            "port": free_ports(1, host="")[0],  # (TensorFlow binds every interface)
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "tmp_dir": self.tmp_dir,
            "started": process_start_ticks(os.getpid()),  # (with the pid: this very process)
            "boot_id": boot_id(),  # (the same as the launcher's: on its machine, another node or not)
        }

    def messages(self, env: dict):
        """Runs launch/member.py `serve` on a thread with `env` (TF_CONFIG, the backend's
        options) and yields what it says, in order, until it has left (a streaming generator)."""
        os.environ.update(env)
        os.environ[TASK_ENV] = f"{self.role}:{self.index}"
        self.link = link = ActorLink(f"{self.role}:{self.index}")
        entered = time.time()

        def serve():
            code = 1
            try:
                # TensorFlow first, then the hello: loading its libraries can hold the interpreter
                # for seconds at a time, and a member's heartbeats count from its hello (the start
                # as a whole is bounded by startup_timeout).
                from workbench._src.core.tf_setup import keras_extras_skipped

                with keras_extras_skipped():  # a third of the import, features a worker never uses
                    import tensorflow  # noqa: F401

                from workbench._src.launch.member import serve

                link.send({"type": "hello", "task": link.task, "pid": os.getpid()})
                link.start_heartbeat()
                code = serve(link, entered)
            finally:
                self.clean_up()
                link.send({"type": "exited", "code": code})
                link.send(None)

        threading.Thread(target=serve, name="workbench member", daemon=True).start()
        yield from link.stream()

    def serve_tf(self, cluster: dict, threads: int | None) -> None:
        """Starts this member's TensorFlow server (an async-ps parameter server or worker) and
        returns only when the member is told to leave: until then the caller's object ref stays
        pending, and fails with Ray's actor error if the actor dies."""
        self.start_tf(cluster, threads)
        self.leaving.wait()

    def start_tf(self, cluster: dict, threads: int | None, port: int | None = None) -> None:
        """Starts this member's TensorFlow server at its address in `cluster` (once). `port`: the
        port it must take again (a replacement of a lost worker server, whose address the
        coordinator's cluster spec holds); raises, saying so, when something else holds it."""
        if self.server is not None:
            return
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        from workbench._src.placements.local.server_main import start_server

        if port is not None:
            _check_port_free(port)
        try:
            self.server = start_server(cluster, self.role, self.index, threads)
        except Exception as error:  # TensorFlow's "Could not start gRPC server" says no more
            if port is None:
                raise
            raise RuntimeError(
                f"the TensorFlow server of {self.role} {self.index} could not listen on port {port} "
                f"({type(error).__name__}: {str(error).strip()[:200]})"
            ) from None

    def deliver(self, message: dict) -> None:
        if message.get("type") == "shutdown":
            self.leaving.set()
        if message.get("type") == "placement_news":  # for the run going on (not the serve loop's)
            from workbench._src.launch.runtime import tell_placement_news

            if self.link is not None and message["news"].get("run") == self.link.current_run:
                tell_placement_news(message["news"])  # (a late one, of a run that has ended: dropped)
            return
        if self.link is not None:
            self.link.receive(message)

    def _leave_when_cut_off(self) -> None:
        """Leaves (removing its temp folder) once its node has not reached the GCS for
        CUT_OFF_SECONDS, or the GCS declared its node dead (see CUT_OFF_SECONDS)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        answered, declared_dead = [time.monotonic()], threading.Event()

        def ask():
            while True:
                try:
                    nodes = ray.nodes()
                    if any(n.get("NodeID") == node and not n.get("Alive") for n in nodes):
                        declared_dead.set()
                        return
                    answered[0] = time.monotonic()
                except Exception:  # noqa: BLE001 - unreachable: the answer stays old
                    pass
                time.sleep(CUT_OFF_CHECK_SECONDS)

        threading.Thread(target=ask, name="workbench gcs check", daemon=True).start()
        ticked = time.monotonic()
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            if now - ticked > 1.0 + STALL_SECONDS:
                answered[0] = max(answered[0], now)  # (the check was held up the same way)
            ticked = now
            if declared_dead.is_set() or now - answered[0] > CUT_OFF_SECONDS:
                self.clean_up()
                os._exit(5)

    def clean_up(self) -> None:
        """Removes this process's temp folder (its cleaner does it too when the process ends)."""
        self.leaving.set()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def _check_port_free(port: int) -> None:
    """Raises, naming the port, when this node cannot bind it (another process listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (TIME_WAIT of the old one: free)
        try:
            s.bind(("", port))
        except OSError as error:
            raise RuntimeError(
                f"port {port} on this node is taken ({error.strerror}): a new server cannot listen at "
                "the lost one's address, where the coordinator looks for it"
            ) from None


def _start_cleaner(folder: str) -> subprocess.Popen:
    """A process that removes `folder` once this one has ended, however it ended (SIGKILL, its
    node's raylet gone): it reads its stdin, whose only writer is this process, to EOF. Only a
    member's own folder (named with TMP_PREFIX) is ever given."""
    assert os.path.basename(folder).startswith(TMP_PREFIX), folder
    starter = subprocess.Popen(
        [sys.executable, "-S", "-c", CLEANER, folder],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # (not in the actor's process group: a group kill spares it)
    )
    starter.wait()  # the first fork returns at once; the cleaner holds the pipe's read end
    return starter  # (its stdin, the write end, stays open for this process's life)
