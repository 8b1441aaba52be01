"""Sinks: what receives a run's events (live dashboard, run store, progress bar; the JupyterLab
watcher is notebook/labcomm.py).

A sink is any callable taking an `Event`, or an object with `send(event)` (the `Sink` protocol).
Sinks never reach into the run loop; they subscribe to a `wb.Run`. Default sinks, those every
new run gets, are registered as factories in core/default_sinks.py (re-exported here).
"""

from __future__ import annotations

from typing import Any, Protocol

from workbench._src.core.default_sinks import (
    _default_factories,
    attach_default_sinks,
    register_default,
    unregister_default,
)

__all__ = ["Sink", "_default_factories", "attach_default_sinks", "register_default", "unregister_default"]


class Sink(Protocol):
    def send(self, event) -> Any: ...
