"""What a pool's start is doing, said while it does it (issue 39: a Ray start showed ~80 s of
"waiting for the run to start" and nothing else).

A placement's start (a local Ray instance's head and node, its actors k/N) calls `say(text)`.
The launcher listens while it checks out and starts a pool (`listening(callback)`: it publishes
each line as the run's "message" event, which the cell, the sidebar and the CLI's "[workbench]"
lines show). A line said while nobody listens (a pool started in the background by the magic or
the panel, before its run exists) is kept, and the next listener hears it first.
"""

from __future__ import annotations

import contextlib
import threading
import time

# How many lines said with nobody listening are kept for the next listener: a start says a
# handful; older ones are of a start long over.
KEPT_LINES = 20

_lock = threading.Lock()
_listeners: list = []
_unheard: list[str] = []


def say(text: str) -> None:
    """Tells every listener what the start is doing now (or keeps it for the next one)."""
    with _lock:
        listeners = list(_listeners)
        if not listeners:
            _unheard.append(text)
            del _unheard[:-KEPT_LINES]
    for listener in listeners:
        with contextlib.suppress(Exception):  # a view's failure must not fail the start
            listener(text)


@contextlib.contextmanager
def listening(callback):
    """Calls `callback(text)` for each line a start says while the block runs (from any thread:
    a background start's actors count here too); lines kept from before come first."""
    with _lock:
        kept, _unheard[:] = list(_unheard), []
        _listeners.append(callback)
    for text in kept:
        with contextlib.suppress(Exception):
            callback(text)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(callback)


class Ticker:
    """Says `text` with the seconds waited so far, at most every `every` seconds (a wait of
    unknown length shows it is still going)."""

    def __init__(self, text: str, every: float = 5.0):
        self.text, self.every = text, every
        self.started = time.monotonic()
        self.last = self.started

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            say(f"{self.text} ({now - self.started:.0f} s)")
