"""`workbench run FILE --backend async-ps --cluster TF_CONFIG|slurm` in a `ps` or `worker` task.

Under parameter servers only the chief (the coordinator) runs the file; the other tasks serve:
each runs a TensorFlow server for its task and waits. Such a task says what it does, gives up
with a clear error when the chief never comes (startup_timeout), and exits when the chief has
gone (its run ended or failed), instead of serving forever. Ctrl-C and SIGTERM end it at once.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from workbench._src.core.cluster_resolver import checked_tf_config_env, cluster_resolver
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.tf_setup import keras_extras_skipped, tf

# The chief's port closes for a moment between its join's placeholder listener and its own
# TensorFlow server (backends/join_watchdog.py): only a longer refusal means it is gone.
CHIEF_GONE_SECONDS = 5.0
# A chief that does not answer at all (its host cut off or down) may come back: the network
# heals and the run goes on with this task (it rejoins). Only this long a silence ends the task.
CHIEF_SILENT_SECONDS = 300.0


def is_server_task(cluster) -> bool:
    """True when this process's task in `cluster` is a parameter server or an async worker."""
    if isinstance(cluster, str) and cluster.upper() == "TF_CONFIG":
        # Read without TensorFlow, so that a server task imports it in serve(), without Keras's
        # extras (a chief runs the user's file: it imports TensorFlow in full).
        return checked_tf_config_env()["task"]["type"] in ("ps", "worker")
    return cluster_resolver(cluster).task_type in ("ps", "worker")


def serve(cluster, startup_timeout: float) -> int:
    with keras_extras_skipped():  # a server runs no Keras at all
        resolver = cluster_resolver(cluster)
    spec = resolver.cluster_spec().as_dict()
    task = f"{resolver.task_type} {resolver.task_id}"
    chiefs = spec.get("chief") or []
    if not chiefs:
        raise ConfigurationError(
            f"async-ps needs a 'chief' task in its cluster (the coordinator, which runs the file); "
            f'received jobs {sorted(spec)}. Fix: add "chief": ["host:port"] to the cluster in '
            "TF_CONFIG and run `workbench run FILE --backend async-ps --cluster TF_CONFIG` there too."
        )
    chief = chiefs[0]
    server = tf().distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=int(resolver.task_id),
        protocol="grpc",
    )
    del server  # it serves until this process ends (TensorFlow servers cannot be stopped)
    _say(
        f"async-ps {task} serving; waiting for the chief at {chief} (startup_timeout={startup_timeout:.0f} s)"
    )
    signal.signal(signal.SIGTERM, lambda *_: _leave(f"async-ps {task}: SIGTERM; exiting", 143))
    try:
        deadline = time.monotonic() + startup_timeout
        while not _accepts(chief):
            if time.monotonic() > deadline:
                _say(
                    f"async-ps {task}: the chief at {chief} never came within startup_timeout="
                    f"{startup_timeout:.0f} s. Fix: start `workbench run FILE --backend async-ps "
                    "--cluster TF_CONFIG` in the chief task, or give a longer --startup-timeout."
                )
                return _leave(None, 1)
            time.sleep(0.5)
        _say(f"async-ps {task}: the chief at {chief} is up; serving its run")
        refused_since = silent_since = None
        while True:
            state = _chief_state(chief)
            now = time.monotonic()
            refused_since = (refused_since or now) if state == "refused" else None
            silent_since = (silent_since or now) if state == "silent" else None
            if refused_since is not None and now - refused_since > CHIEF_GONE_SECONDS:
                return _leave(f"async-ps {task}: the chief at {chief} has gone (its run ended); exiting", 0)
            if silent_since is not None and now - silent_since > CHIEF_SILENT_SECONDS:
                return _leave(
                    f"async-ps {task}: the chief at {chief} has not answered for {CHIEF_SILENT_SECONDS:.0f} s "
                    "(its host down or cut off from this one); exiting",
                    1,
                )
            time.sleep(1.0)
    except KeyboardInterrupt:
        return _leave(f"async-ps {task}: interrupted; exiting", 130)


def _accepts(address: str) -> bool:
    return _chief_state(address) == "up"


def _chief_state(address: str) -> str:
    """ "up" (accepts), "refused" (its host answers, nothing listens: the run ended) or "silent"
    (no answer, or no route: the network between us is down)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return "up"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def _say(text: str) -> None:
    print(f"workbench run: {text}", file=sys.stderr, flush=True)


def _leave(text: str | None, code: int) -> int:
    # os._exit: TensorFlow's server threads would hold a normal interpreter exit forever.
    if text:
        _say(text)
    sys.stdout.flush()
    os._exit(code)
