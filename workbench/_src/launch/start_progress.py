"""What a pool's start is doing, said while it does it (issue 39: a Ray start showed ~80 s of
"waiting for the run to start" and nothing else).

A placement's start (a local Ray instance's head and node, its actors k/N) calls `say(text)`.
The launcher listens while it checks out and starts a pool (`listening(callback)`: it publishes
each line as the run's "message" event, which the cell, the sidebar and the CLI's "[workbench]"
lines show). A line said while nobody listens (a pool started in the background by the magic or
the panel, before its run exists) is kept, and the next listener hears it first.

Once the members report ready, `startup_phases` tells how long each phase of the start took.
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


class Phases:
    """Says each phase of a start as it begins (`now(text)`), and while one lasts, says it again
    every `every` seconds with the seconds spent in it: a wait of unknown length shows it goes on.
    Used as a context manager (a daemon thread repeats the phase while the block runs)."""

    def __init__(self, every: float = 5.0):
        self.every = every
        self.text, self.since = "", time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()

    def now(self, text: str) -> None:
        with self._lock:
            if text == self.text:
                return
            self.text, self.since = text, time.monotonic()
        say(text)

    def _repeat(self) -> None:
        while not self._done.wait(self.every):
            with self._lock:
                text, seconds = self.text, time.monotonic() - self.since
            if text and seconds >= self.every:
                say(f"{text} ({seconds:.0f} s)")

    def __enter__(self) -> Phases:
        threading.Thread(target=self._repeat, name="workbench start progress", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()


PHASES = ("spawn", "imports", "servers", "cluster join", "shipping")


def startup_phases(reports, started_wall: float, warm: bool, ahead: float = 0.0) -> dict:
    """run.startup: seconds per phase of the start, each the slowest process's. A process reports
    wall-clock milestones (worker_main): entered (its interpreter runs our code), imported
    (TensorFlow), servers (its own servers listen: async-ps), joined (the strategy is built),
    unpickled (the work is ready to run). Consecutive milestones, so the phases add up to the
    wait. A warm pool's start is one phase, the hand-off. A pool started in the background
    `ahead` seconds before the run: its phases count from its start, and its processes' wait
    for the run's work is not shipping."""
    if warm:
        return {
            "handoff": round(
                max((r.get("unpickled", started_wall) for r in reports), default=started_wall) - started_wall,
                3,
            )
        }
    marks = ("entered", "imported", "servers", "joined", "unpickled")
    out = dict.fromkeys(PHASES, 0.0)
    for report in reports:
        previous = started_wall - ahead
        for phase, mark in zip(PHASES, marks):
            at = report.get(mark, previous)
            if phase == "shipping":
                previous = max(previous, started_wall)  # (the work exists from the run's start)
            out[phase] = max(out[phase], at - previous)
            previous = at
    return {k: round(v, 3) for k, v in out.items()}


def phase_text(startup: dict) -> str:
    """run.startup as one line: "spawn 1.2 s, imports 3.4 s, ..."."""
    return ", ".join(f"{k} {v:.1f} s" for k, v in startup.items())
