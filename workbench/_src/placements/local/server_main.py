"""A TensorFlow server of a local async-ps cluster: `python -m workbench._src.placements.local.server_main`.

Started by MultiWorkerAsyncReplicator with the cluster spec (all 127.0.0.1 addresses) and its
task ("worker:1", "ps:0") in the environment. It serves until its parent stops it (SIGTERM) or
dies (EOF on stdin); either way it removes its own temp folder (AutoGraph's files, processes.py)
and exits hard, as TensorFlow's servers cannot be shut down cleanly.
"""

from __future__ import annotations

import json
import os
import signal


def main() -> None:
    # Imports inside main(): a server process must watch its parent (and die with it) before it
    # spends seconds importing; TensorFlow comes after the task is known.
    from workbench._src.placements.local.channel import exit_when_parent_dies
    from workbench._src.placements.local.processes import TASK_ENV

    exit_when_parent_dies()
    # server.join() would block in C++, where no Python signal handler runs: the main thread
    # sleeps in signal.pause() instead (the server serves from its own threads).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    cluster = json.loads(os.environ["WORKBENCH_CLUSTER"])
    job, index = os.environ[TASK_ENV].split(":")
    server = start_server(cluster, job, int(index), os.environ.get("WORKBENCH_WORKER_THREADS"))
    while server is not None:  # the reference keeps it serving (Server.__del__ stops it)
        signal.pause()


def start_server(cluster: dict, job: str, index: int, threads) -> object:
    """This process's TensorFlow server for task `job:index` of `cluster` (also a Ray-placed
    pool's server member, placements/ray/member.py); `threads`: TensorFlow threads, None for its own
    choice."""
    from workbench._src.core import tf_setup

    tf_setup._requested_cpus = 1  # one CPU device per server: the coordinator places the work
    with tf_setup.keras_extras_skipped():  # a server runs no Keras at all
        t = tf_setup.tf()
    if threads:
        t.config.threading.set_intra_op_parallelism_threads(int(threads))
        t.config.threading.set_inter_op_parallelism_threads(int(threads))
    return t.distribute.Server(
        t.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc", start=True
    )


def _exit_on_sigterm(signum, frame) -> None:
    from workbench._src.placements.local.processes import (
        remove_own_tmp_dir,
    )  # (a signal handler: already imported)

    remove_own_tmp_dir()
    # Then die of the signal itself, so the parent still reads "killed by SIGTERM".
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


if __name__ == "__main__":
    main()
