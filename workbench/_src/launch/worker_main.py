"""A process of a local multi-process run: `python -m workbench._src.launch.worker_main`.

Started by a Launcher with the backend's name and options, its task, and the channel's address
and key in its environment (TF_CONFIG too for a multi-worker worker). It connects back, receives
the work (cloudpickled), builds this process's replicator (a multi-worker worker joins its peers;
the async-ps coordinator starts its parameter servers and workers), runs the work, sends the
result, and exits hard (os._exit): TensorFlow's collective runtime can hang a normal interpreter
shutdown, and the launcher already has all it needs. os._exit skips TensorFlow's clean-up of its
AutoGraph files, so the process removes its own temp folder (its TMPDIR, processes.py) first.
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
    repl = None
    try:
        message = link.recv()
        _configure_tensorflow()
        from workbench._src.launch import runtime

        runtime.mark_launched()
        repl = runtime.process_replicator()
        repl.strategy  # noqa: B018 - joins the peers (multi-worker) or starts the servers (async-ps)
        children = repl.started_processes()
        if children:
            link.send({"type": "processes", "children": children})
        link.send({"type": "ready"})
        import cloudpickle

        work = cloudpickle.loads(message["payload"])
        result = work(repl, link)
        link.send({"type": "result", "value": result})  # (the launcher expects the exit after it)
        code = 0
    except BaseException as error:  # noqa: BLE001 - reported to the launcher, which raises it
        from workbench._src.launch.shipping import format_exception

        try:
            link.send(format_exception(error))
        except Exception:  # noqa: BLE001 - the launcher is gone; nothing left to tell
            pass
    finally:
        if repl is not None:
            try:  # the coordinator's servers, scratch folders: os._exit skips every finalizer
                repl.close_launched_process()
            except Exception:  # noqa: BLE001 - exiting anyway; servers also exit on stdin EOF
                pass
        from workbench._src.launch.processes import remove_own_tmp_dir

        remove_own_tmp_dir()  # AutoGraph's files; the group's stop() removes it if we never get here
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _configure_tensorflow() -> None:
    from workbench._src.core import tf_setup

    tf_setup._requested_cpus = int(os.environ.get("WORKBENCH_WORKER_DEVICES", "1"))
    t = tf_setup.tf()
    threads = os.environ.get("WORKBENCH_WORKER_THREADS")
    if threads:
        t.config.threading.set_intra_op_parallelism_threads(int(threads))
        t.config.threading.set_inter_op_parallelism_threads(int(threads))


if __name__ == "__main__":
    main()
