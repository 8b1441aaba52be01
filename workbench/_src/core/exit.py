"""One exit path for what the workbench leaves running, in a stated order.

Whatever registers here runs at interpreter exit in the order of STAGES, whatever the order the
modules were imported in:

  1. "pools": every warm pool is asked to leave and then ended (launch/pool.py). First, so the
     members exit on a message, cleanly (each removes its temp folder, a coordinator its
     servers), and so a Ray placement still has its Ray connection.
  2. "process groups": local process groups that are not a pool's (placements/local/processes.py):
     SIGTERM, then SIGKILL after a grace; their log folders.
  3. "fork servers": the fork servers (placements/local/fork_server.py), once their children are
     gone: their stdin closes, they exit and are reaped.
  4. "ray": the local Ray instance this process started, shut down and its temp root removed
     (placements/ray/cluster.py); after the stages above, which may still talk to it.
  5. "tf.data": the iterators not yet deleted are kept for the rest of the process, and the
     process ends at once if a deletion is under way (core/reaper.py); last, since it may end
     the process with os._exit.

Why one hook: `atexit` runs hooks last-registered first, so with a hook per module the order
was the import order, and Ray's own exit hooks (`ray.shutdown`, registered when Ray is imported,
and the local instance's, registered by `ray.init`) could run before the Ray pools were stopped.
`on_exit` registers this module's hook again each time something is added, and Ray's connection
does after `ray.init` (`run_first`), so it runs before every hook registered earlier, Ray's
included.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable

STAGES = ("pools", "process groups", "fork servers", "ray", "tf.data")
_hooks: dict[str, list[Callable[[], None]]] = {stage: [] for stage in STAGES}


def on_exit(stage: str, hook: Callable[[], None]) -> None:
    """Runs `hook()` at interpreter exit, in `stage`'s turn (idempotent)."""
    if hook not in _hooks[stage]:
        _hooks[stage].append(hook)
    run_first()


def run_first() -> None:
    """Makes the stages run before every exit hook registered so far: Ray's connection calls it
    after `ray.init`, which registers Ray's own hooks (one ends the local instance's processes)."""
    atexit.unregister(run_exit_stages)  # (atexit runs the last registered first)
    atexit.register(run_exit_stages)


def run_exit_stages() -> None:
    """Every registered hook, stage by stage; one that fails does not keep the next from running."""
    for stage in STAGES:
        for hook in list(_hooks[stage]):
            with contextlib.suppress(Exception):
                hook()
