"""The session's replicator (`wb.current()`): which replicator the next `%%replicate` cell, Run
button or script trains on, whoever chose it (the magic, the panel, `wb.use()`, a launched
process for its own cells).

Here, in core/, because a launched process sets it too (launch/shipping.py): choosing by name
and the notebook's conveniences stay in notebook/session.py, above.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from workbench._src.core.errors import ConfigurationError

lock = threading.RLock()  # held by the session while it decides and sets, so both are one step
_current = None  # the session's Replicator
_choice: dict | None = None  # the options it was built from; None when set as an object
_observers: list[Callable[[Any, dict | None], None]] = []


def current():
    """The session's replicator: the last one chosen with %replicate, the panel or wb.use().

    Raises:
      ConfigurationError: when none has been chosen yet (the message says how).

    Example:
      >>> import workbench as wb
      >>> repl = wb.use("single")
      >>> wb.current().backend
      'single'
    """
    with lock:
        if _current is None:
            raise ConfigurationError(
                "No replicator has been chosen in this session yet. Fix: run "
                "`%replicate --backend mirrored --replicas 4`, pick one in wb.ui.panel(), or call "
                "wb.use('mirrored', num_replicas=4)."
            )
        return _current


def current_or_none():
    """The session's replicator, or None (for the panel and the magic, which decide themselves)."""
    return _current


def current_choice() -> dict | None:
    """The options the session's replicator was chosen with (None if set as an object or unset)."""
    with lock:
        return dict(_choice) if _choice else None


def observe(callback: Callable[[Any, dict | None], None]) -> Callable[[], None]:
    """Calls callback(replicator, choice) whenever the session's replicator changes.

    Returns a function that removes the callback (an open panel uses this to follow the magic).
    """
    with lock:
        _observers.append(callback)
    return lambda: _observers.remove(callback) if callback in _observers else None


def set_current(repl, choice: dict | None) -> None:
    """Makes `repl` the session's replicator (`choice`: the options it was chosen with)."""
    global _current, _choice
    with lock:
        old, _current, _choice = _current, repl, choice
    if old is not None and old is not repl and getattr(old, "runs_in_processes", False):
        # The replaced replicator's warm worker pool would hold memory for nothing; one of the
        # same shape is the new replicator's too (launch/pool.py), so that one stays.
        if getattr(repl, "pool_shape", None) != old.pool_shape:
            old.shutdown()
    for callback in list(_observers):
        try:
            callback(repl, choice)
        except Exception:  # noqa: BLE001 - a closed panel must not break %replicate
            pass


def forget() -> None:
    """No session replicator (tests; a fresh start in a long-lived kernel)."""
    global _current, _choice
    with lock:
        _current, _choice = None, None
