"""The thread that owns the local Ray instance this process starts (`RayCluster(address=None)`,
`--cluster ray=local`): it starts the instance inside a private network, and lives as long as it.

A private network. Ray's own servers of a local instance listen on 127.0.0.1 (local_start.py),
but TensorFlow binds its gRPC servers to "0.0.0.0:" + port whatever the cluster spec says (fixed
in its server library), so an actor's TensorFlow server (a multi-worker worker, an async-ps
server) listened on every interface. A local pool avoids that by starting its processes through a
wrapper that joins a loopback-only network namespace (placements/local/netns.py); Ray's processes
cannot be started that way, and this process (Ray's driver) talks TCP with them. But a network
namespace belongs to a thread, not to a process: `setns(fd, CLONE_NEWNET)` is allowed in a
multi-threaded process and moves the calling thread only; threads and processes it creates from
then on inherit its network, and a socket stays in the network it was made in. So one thread of
its own enters a loopback-only namespace and runs ray.init there: every process of the instance
(GCS, raylet, agents, workers, actors and their TensorFlow servers) descends from it and runs
inside, and the driver's Ray threads (its core worker's, gRPC's) start inside too. Ray makes its
later connections (to a new actor, to the GCS) on those threads, so calls from any other thread
work, and no socket of this process is made in the host network for Ray (measured:
tests/test_security_ray.py). The rest of this process (the kernel's own threads, the user's code,
local pools) stays in the host network.

A thread that outlives the instance. Ray ties every process it starts to the *thread* that
started it (PR_SET_PDEATHSIG, whose "parent" is a thread): an instance started on a thread that
then ended (a background run's, a pool's start) was SIGKILLed whole at that moment, and the
driver ended itself a minute later ("Failed to connect to GCS within 60 seconds"). The owner
thread waits until the instance is shut down (`release`), or for the process's end. A process
that ends without shutting it down (SIGKILLed) takes the GCS and the raylet along, but not the
raylet's agents: the sentinel it starts first in the private network ends those
(instance_sentinel.py).

Where refused: joining a namespace needs CAP_SYS_ADMIN over it. Without root a namespace comes
with a user namespace of its own, which only a single-threaded process may join (a kernel has
threads): the owner thread then starts the instance in the host network as before (Ray's servers
on 127.0.0.1, TensorFlow's on every interface), and one warning says so, as for a local pool.
"""

from __future__ import annotations

import os
import threading

from workbench._src.placements.local import netns
from workbench._src.placements.ray import instance_sentinel

LABEL = "local Ray instance"
FIX_WITHOUT_ROOT = (
    "start the kernel as root (a process with threads, as a kernel, may join only a network "
    "namespace it has CAP_SYS_ADMIN over; without root a namespace comes with a user namespace, "
    "which a process with threads cannot join), use local processes (no cluster=), or firewall "
    "incoming TCP on this machine"
)


class InstanceOwner:
    """Runs a local instance's start on a thread of its own, in a private network where allowed,
    and keeps that thread until `release()`.

    Use: `owner = InstanceOwner(start, end, root)`, `owner.wait()` (raises what `start` raised);
    once the instance is shut down, `owner.release()`. Until then a sentinel process
    (instance_sentinel.py) ends the instance in `root` if this process dies without doing so.
    Interrupted while waiting (Ctrl-C), the caller gets the interrupt at once; the start cannot be
    cut short, so `end()` ends it when it completes.
    """

    def __init__(self, start, end, root: str):
        self._start, self._end, self._root = start, end, root
        self._sentinel = None
        self._lock = threading.Lock()
        self._finished = self._abandoned = False
        self._error: BaseException | None = None
        self._done, self._released = threading.Event(), threading.Event()
        self.network = ""  # the namespace the instance runs in ("" until started)
        threading.Thread(target=self._own, name="workbench Ray instance owner", daemon=True).start()

    def wait(self) -> None:
        try:
            self._done.wait()
        except BaseException:  # (KeyboardInterrupt: the user gave up on the start)
            with self._lock:
                self._abandoned, finished = True, self._finished
            if finished and self._error is None:  # (the owner already waits for its release)
                self._end()
                self.release()
            raise
        if self._error is not None:
            raise self._error

    def release(self) -> None:
        """The instance is shut down: its sentinel ends, the thread may end."""
        self._stop_sentinel()
        self._released.set()

    def _stop_sentinel(self) -> None:
        with self._lock:
            sentinel, self._sentinel = self._sentinel, None
        if sentinel is not None:
            instance_sentinel.stop(sentinel)

    def _own(self) -> None:
        try:
            _enter_private_network()
            self.network = os.readlink("/proc/thread-self/ns/net")
            # (started here: in the instance's network, before any process of the instance)
            self._sentinel = instance_sentinel.start(self._root)
            self._start()
        except BaseException as error:  # (handed to the waiting caller)
            self._error = error
        with self._lock:
            self._finished, abandoned = True, self._abandoned
        self._done.set()
        if self._error is None and abandoned:
            self._end()  # (nobody connected to it: nothing of it may stay)
        elif self._error is None:
            self._released.wait()
        self._stop_sentinel()  # (a failed start's processes were ended by the start itself)


def _enter_private_network() -> None:
    """This thread into a new loopback-only network namespace, for good; where refused (warned
    once), it stays where it is. The namespace's descriptor is closed: the namespace lives on
    with the threads and processes inside it."""
    network = netns.open_network(LABEL)  # (warns once where namespaces are refused or opted out)
    try:
        net_fd = network.namespace_fds().get("net")
        if net_fd is None:  # host network (refused, opted out), or already a private one
            return
        try:
            netns.enter_network_of_this_thread(net_fd)
        except OSError as error:
            netns.warn_exposed(LABEL, f"this process cannot join a network namespace: setns() failed: {error.strerror}", FIX_WITHOUT_ROOT)
    finally:
        network.close()
