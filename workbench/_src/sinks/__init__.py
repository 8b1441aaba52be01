"""Sinks: what receives a run's events (live dashboard, run store, lab comm, progress bar).

A sink is any callable taking an `Event`, or an object with `send(event)` (the `Sink` protocol).
Sinks never reach into the run loop; they subscribe to a `wb.Run`. Default sinks, those every
new run gets (the run store, the JupyterLab watcher), are registered here as factories
`factory(run) -> sink` by the integrations that want them, not kept by the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Sink", "attach_default_sinks", "register_default", "unregister_default"]


class Sink(Protocol):
    def send(self, event) -> Any: ...


_default_factories: list[Callable] = []


def register_default(factory: Callable) -> None:
    """Every run created from now on gets `factory(run)` as a sink (idempotent)."""
    if factory not in _default_factories:
        _default_factories.append(factory)


def unregister_default(factory: Callable) -> None:
    while factory in _default_factories:
        _default_factories.remove(factory)


def attach_default_sinks(run) -> None:
    """Subscribes `run` to a new sink from every registered factory."""
    for make_sink in list(_default_factories):
        run.subscribe(make_sink(run))
