"""A process of a local multi-process run: `python -m workbench._src.placements.local.worker_main`.

Started by a Launcher (through a pool, launch/pool.py) with the backend's name and options, its
task, and the channel's address and key in its environment (TF_CONFIG too for a multi-worker
worker). It connects back, builds this process's replicator (a multi-worker worker joins its
peers; the async-ps coordinator starts its parameter servers and workers), then serves work
items one after the other: run one (cloudpickled), send the result, free what it left
(`release_run_state`), wait for the next. That loop is the warm pool: TensorFlow stays imported,
the servers up and the cluster formed. A "shutdown" message, the parent's death (EOF) or an
error ends it with os._exit: TensorFlow's collective runtime can hang a normal interpreter
shutdown. os._exit skips TensorFlow's clean-up of its AutoGraph files, so the process removes its
own temp folder (its TMPDIR, processes.py) first.

Its life after the hello is a Ray member's too: launch/member.py.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

from workbench._src.placements.proc import STACKS_SIGNAL


def main() -> None:
    entered = time.time()
    # Before the hello: a launcher that finds this process silent asks it where its threads are
    # (SIGUSR1, whose default action would end it), and names that in its verdict.
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    # Imports inside main(), in start-up order: watch the parent and say hello first (the
    # launcher's heartbeat clock starts), then the backend, then TensorFlow (_configure_tensorflow).
    from workbench._src.placements.local.channel import ParentLink, exit_when_parent_dies

    exit_when_parent_dies()
    link = ParentLink()
    link.start_reader()
    link.start_heartbeat()
    from workbench._src.launch.member import serve
    from workbench._src.launch.placement import offer_own_servers
    from workbench._src.placements.local.servers import LocalServers

    # On one host a member starts the servers of a role `started_by` it (async-ps's coordinator)
    # as its own children, in this private network.
    offer_own_servers(LocalServers)
    code = serve(link, entered)
    from workbench._src.placements.local.processes import remove_own_tmp_dir

    remove_own_tmp_dir()  # AutoGraph's files; the group's stop() removes it if we never get here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
