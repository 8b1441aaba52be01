"""A pool member's life once its link to the launcher is up, wherever it runs: build this
process's replicator, then run work items until "shutdown" or the launcher is gone.

The entry points call it: a local member (placements/local/worker_main.py, over its Unix-socket
link) and a Ray member (placements/ray/member.py, over actor calls).

It reports wall-clock milestones of its start in the "ready" message (start_progress.startup_phases):
the slow parts (importing TensorFlow, starting servers, joining the cluster) overlap across
processes, and the async-ps coordinator starts its servers *before* importing TensorFlow, so
their imports run while its own does.
"""

from __future__ import annotations

import gc
import os
import time


def serve(link, entered: float) -> int:
    """The member's life once its link to the launcher is up: build this process's replicator,
    then run work items until "shutdown" (or the launcher is gone); returns the exit code.
    `link` is a channel.ParentLink, or a Ray actor's link (placements/ray/pool.py)."""
    code = 1
    repl = None
    try:
        from workbench._src.launch import runtime

        runtime.mark_launched()
        repl = runtime.process_replicator()  # no TensorFlow yet: the face reads its options only
        repl.prepare_launched_process()  # async-ps: its servers start now, importing in parallel
        children = repl.started_processes()
        if children:  # told now: their start counts as this member's (launch/start_progress.py)
            link.send({"type": "processes", "children": children})
        phases = {"entered": entered}
        _configure_tensorflow()
        phases["imported"] = time.time()
        repl.wait_for_own_servers()
        phases["servers"] = time.time()
        repl.strategy  # noqa: B018 - joins the peers (multi-worker) or connects the servers (async-ps)
        phases["joined"] = time.time()
        # What exists now is the pool's for good (TensorFlow's modules, the strategy, the
        # servers): frozen, the collection between two runs (release_run_state) scans only what
        # the runs made, ~0.02 s instead of 0.23 s for a full one over TensorFlow's objects.
        gc.freeze()
        import cloudpickle

        message = link.next_message()
        while message is not None and message.get("type") == "work":
            work = cloudpickle.loads(message["payload"])
            phases["unpickled"] = time.time()
            link.send({"type": "ready", "phases": phases})
            result = work(repl, link)
            link.send({"type": "result", "value": result})
            del work, result
            if message.get("last"):
                break  # (pool=False: one run per process, as before pools)
            repl.release_run_state()  # the run's variables, iterators, programs: memory stays flat
            message = link.next_message()
            phases = {}
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
    return code


def _configure_tensorflow() -> None:
    from workbench._src.core import tf_setup

    tf_setup._requested_cpus = int(os.environ.get("WORKBENCH_WORKER_DEVICES", "1"))
    with tf_setup.keras_extras_skipped():  # a third of the import, features a worker never uses
        t = tf_setup.tf()
    threads = os.environ.get("WORKBENCH_WORKER_THREADS")
    if threads:
        t.config.threading.set_intra_op_parallelism_threads(int(threads))
        t.config.threading.set_inter_op_parallelism_threads(int(threads))
