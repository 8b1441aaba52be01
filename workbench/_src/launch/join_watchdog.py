"""Deadline for joining a real multi-worker cluster: `python -m workbench._src.launch.join_watchdog`.

TensorFlow's MultiWorkerMirroredStrategy waits forever for a peer that never starts and holds
the interpreter while it waits, so the process cannot time itself out. This watchdog, started
just before the join, waits for its stdin to close (the join finished, or the process exited).
If the deadline passes first it names the peers nobody listens for, writes the error to the
shared stderr, and kills the stuck process (SIGKILL: the strategy ignores SIGTERM).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys


def main() -> None:
    parent, timeout, me, addresses = (
        int(sys.argv[1]),
        float(sys.argv[2]),
        sys.argv[3],
        json.loads(sys.argv[4]),
    )
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if ready:
        return
    from workbench._src.launch.processes import port_open

    missing = []
    for task, address in addresses.items():
        host, port = address.rsplit(":", 1)
        if not port_open(int(port), host):
            missing.append(f"{task} at {address}")
    names = ", ".join(missing) or "a peer"
    sys.stderr.write(
        f"\nworkbench: WorkerError: this process ({me}) waited startup_timeout={timeout:.0f} s for the "
        f"other processes of the cluster, and {names} never connected. Fix: start the same program "
        "on every host of the cluster (each with its own TF_CONFIG task), check the addresses and "
        "firewalls, or raise startup_timeout. TensorFlow cannot abandon the wait, so the process "
        "is stopped now.\n"
    )
    sys.stderr.flush()
    os.kill(parent, signal.SIGKILL)


if __name__ == "__main__":
    main()
