"""Joining a multi-worker cluster without hanging: `wait_for_peers`, and a watchdog backstop.

TensorFlow's MultiWorkerMirroredStrategy waits forever for a peer that never starts, inside its
constructor, in C++: no Python thread, signal handler or timeout runs meanwhile, so the caller
cannot time itself out once it is in there. `wait_for_peers(resolver, timeout)` is therefore
called *before* the constructor: it polls until every other task's address answers as a peer
(backends/peer_probe.py: a TCP accept alone may be a stale process or another program on the
port) and raises WorkerError naming the others when `timeout` passes, saying which accepted
without answering as a peer. The calling
process (a notebook kernel, a script) gets an exception, never a signal.

Each peer runs the same code, and a task's gRPC port only opens inside its own constructor, so
while it waits a task holds its own port with a placeholder listener (greeting probes as a
peer) and releases it just before returning; TensorFlow's server binds the port next.

`python -m workbench._src.backends.join_watchdog PARENT TIMEOUT ME ADDRESSES` is the backstop for
the remaining window (a peer that was reachable and then died before the join completed): it
waits for its stdin to close (the join finished) and otherwise, after the deadline, only writes
to the shared stderr which peers are missing and that the process must be interrupted. It never
kills the process that started it: in a notebook that process is the kernel.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import sys
import threading
import time

from workbench._src.backends.peer_probe import GREETING, NOT_A_PEER, PEER, UNREACHABLE, probe

POLL_SECONDS = 0.25


def peer_addresses(resolver) -> dict[str, str]:
    """{"worker 1": "host:port", ...}: every task of the resolver's cluster but its own (and an
    evaluator's, which never joins the collective group)."""
    me = (resolver.task_type, None if resolver.task_id is None else int(resolver.task_id))
    peers = {}
    for job, tasks in resolver.cluster_spec().as_dict().items():
        if job == "evaluator":
            continue
        for index, address in tasks.items() if isinstance(tasks, dict) else enumerate(tasks):
            if (job, int(index)) != me:
                peers[f"{job} {index}"] = address
    return peers


def wait_for_peers(resolver, timeout: float, poll: float = POLL_SECONDS) -> float:
    """Blocks until every peer of this task answers as a peer; returns the seconds waited.

    Args:
      resolver: the tf.distribute cluster resolver the strategy will be built with (its task is
        this process).
      timeout: seconds to wait (startup_timeout); then WorkerError lists the unreachable peers.
      poll: seconds between rounds of connection attempts.

    Call it right before `tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)`.
    A peer seen once counts as started (it may be inside its own constructor, between releasing
    its placeholder and TensorFlow binding the port).
    """
    start = time.monotonic()
    peers = peer_addresses(resolver)
    waiting = {task: UNREACHABLE for task in peers}  # task -> what its address answered last
    with _placeholder(_own_port(resolver)):
        while waiting:
            for task in list(waiting):
                waiting[task] = probe(peers[task])
                if waiting[task] == PEER:
                    del waiting[task]
            if not waiting:
                break
            if time.monotonic() - start >= timeout:
                raise _peers_missing(resolver, timeout, peers, waiting)
            time.sleep(poll)
    return time.monotonic() - start


def _peers_missing(resolver, timeout: float, peers: dict, waiting: dict):
    from workbench._src.core.errors import WorkerError

    me = f"{resolver.task_type} {resolver.task_id}"
    silent = [f"{task} at {peers[task]}" for task, answer in waiting.items() if answer != NOT_A_PEER]
    impostors = [f"{task} at {peers[task]}" for task, answer in waiting.items() if answer == NOT_A_PEER]
    said = []
    if silent:
        said.append(f"{len(silent)} of {len(peers)} never accepted a connection: {', '.join(silent)}")
    if impostors:
        said.append(
            f"{len(impostors)} of {len(peers)} accepted a connection but did not answer as a TensorFlow "
            f"peer: {', '.join(impostors)} (another program, or a stale or frozen process, holds "
            "that port)"
        )
    fix = "start the same program on every host of the cluster (each with its own TF_CONFIG task)"
    if impostors:
        fix = (
            "end what holds the port (e.g. `ss -ltnp` on that host shows its process) or give the task another port, then "
            + fix
        )
    return WorkerError(
        f"This process ({me}) waited startup_timeout={timeout:g} s for the other processes of the "
        f"cluster, and {'; '.join(said)}. Nothing was started here, so the process is still usable. "
        f"Fix: {fix}, check the addresses and firewalls, or raise startup_timeout.",
        task=next(iter(waiting)),
    )


def _own_port(resolver) -> int | None:
    if resolver.task_type is None or resolver.task_id is None:
        return None
    try:
        address = resolver.cluster_spec().task_address(resolver.task_type, int(resolver.task_id))
        return int(address.rpartition(":")[2])
    except (ValueError, KeyError):
        return None


@contextlib.contextmanager
def _placeholder(port: int | None):
    """Listens on `port` (every interface, as TensorFlow's server will) while the peers are
    awaited, greeting their probes as a peer; nothing if the port is taken already (e.g. this
    process's TensorFlow server is up)."""
    listener = None
    if port:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("", port))
            listener.listen(64)
        except OSError:
            listener.close()
            listener = None
    if listener is None:
        yield
        return
    done = threading.Event()

    def serve():
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn:  # let the prober close first, so the TIME_WAIT is on its side
                conn.settimeout(0.5)
                with contextlib.suppress(OSError):
                    conn.sendall(GREETING)
                    while conn.recv(64):
                        pass

    thread = threading.Thread(target=serve, name="workbench peer placeholder", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        listener.close()


def main() -> None:
    _parent, timeout, me, addresses = (
        int(sys.argv[1]),
        float(sys.argv[2]),
        sys.argv[3],
        json.loads(sys.argv[4]),
    )
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if ready:
        return
    missing = [f"{task} at {address}" for task, address in addresses.items() if probe(address) != PEER]
    names = ", ".join(missing) or "a peer that stopped answering"
    sys.stderr.write(
        f"\nworkbench: this process ({me}) has waited {timeout:.0f} s inside TensorFlow's cluster join "
        f"for {names}. TensorFlow cannot abandon that wait. Fix: start the missing peer, or interrupt "
        "this process (in a notebook: restart the kernel) and start every host again.\n"
    )
    sys.stderr.flush()


if __name__ == "__main__":
    main()
