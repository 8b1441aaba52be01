"""Inside a process the workbench launched: which backend this process is, and its replicator.

The launcher puts the backend's name and options in the child's environment (BACKEND_ENV); the
child builds the in-process face of the same backend class from them, once. A replicator that a
function refers to travels as a reference to that process replicator (`Replicator.__reduce__`).
"""

from __future__ import annotations

import json
import os
import queue

BACKEND_ENV = "WORKBENCH_BACKEND"  # {"backend": "multi-worker", "options": {...}}
TASK_ENV = "WORKBENCH_TASK"  # "worker:1" / "ps:0": which member this process is (every placement)
_launched = False
_replicator = None
# What this process's placement says, by its own link, about members it placed and watches for
# the run going on here (a Ray pool's async-ps worker servers: one lost, replaced or dropped):
# the Ray member's `deliver` puts it here (placements/ray/member.py), the coordinator's run reads
# it (backends/placed_workers.py). Both sit above this layer; neither imports the other.
_placement_news: queue.Queue = queue.Queue()


def mark_launched() -> None:
    """Called first thing by worker_main: this process is a member of a local cluster."""
    global _launched
    _launched = True


def is_launched() -> bool:
    """True in a process the workbench launched (a local worker or coordinator)."""
    return _launched


def backend_env(backend: str, options: dict) -> dict[str, str]:
    return {BACKEND_ENV: json.dumps({"backend": backend, "options": options})}


def process_replicator():
    """This launched process's replicator (the in-process face of the launcher's backend)."""
    global _replicator
    if _replicator is None:
        # here: every backend module imports this one; only a launched process needs the registry
        from workbench._src.core.errors import ConfigurationError
        from workbench._src.core.registry import backend_class

        if not _launched or BACKEND_ENV not in os.environ:
            raise ConfigurationError(
                "A replicator of a local multi-process run was unpickled outside a process the "
                "workbench launched. Fix: send functions to workers through repl.train(setup=...) "
                "or repl.run_on_workers(fn) of that replicator."
            )
        spec = json.loads(os.environ[BACKEND_ENV])
        _replicator = backend_class(spec["backend"])(**spec["options"])
    return _replicator


def tell_placement_news(news: dict) -> None:
    """Called by this process's placement link with one piece of news for the run going on here."""
    _placement_news.put(news)


def placement_news() -> list[dict]:
    """The placement's news since the last call, oldest first (each once)."""
    said = []
    while True:
        try:
            said.append(_placement_news.get_nowait())
        except queue.Empty:
            return said
