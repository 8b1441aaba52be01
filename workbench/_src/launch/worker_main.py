"""A worker process of a local multi-worker run: `python -m workbench._src.launch.worker_main`.

Started by MultiWorkerReplicator's launcher with TF_CONFIG and the channel's address and key in
its environment. It connects back, receives the work (cloudpickled), builds the in-cluster
replicator, runs the work, sends the result, and exits hard (os._exit): TensorFlow's collective
runtime can hang a normal interpreter shutdown, and the parent already has all it needs.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from workbench._src.launch.channel import ParentLink, exit_when_parent_dies

    exit_when_parent_dies()
    link = ParentLink()
    link.start_heartbeat()
    code = 1
    try:
        message = link.recv()
        _configure_tensorflow()
        from workbench._src.backends import multi_worker

        multi_worker.mark_launched_worker()
        repl = multi_worker.worker_replicator()
        repl.strategy  # noqa: B018 - blocks until every peer has connected
        link.send({"type": "ready"})
        import cloudpickle

        work = cloudpickle.loads(message["payload"])
        result = work(repl, link)
        link.send({"type": "result", "value": result})
        link.send({"type": "done"})
        code = 0
    except BaseException as error:  # noqa: BLE001 - reported to the launcher, which raises it
        from workbench._src.backends.multi_worker import format_exception

        try:
            link.send(format_exception(error))
        except Exception:  # noqa: BLE001 - the launcher is gone; nothing left to tell
            pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _configure_tensorflow() -> None:
    from workbench._src import tf_setup

    tf_setup._requested_cpus = int(os.environ.get("WORKBENCH_WORKER_DEVICES", "1"))
    t = tf_setup.tf()
    threads = os.environ.get("WORKBENCH_WORKER_THREADS")
    if threads:
        t.config.threading.set_intra_op_parallelism_threads(int(threads))
        t.config.threading.set_inter_op_parallelism_threads(int(threads))


if __name__ == "__main__":
    main()
