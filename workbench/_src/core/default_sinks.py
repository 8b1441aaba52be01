"""The sinks every new run gets: factories `factory(run) -> sink` registered by the integrations
that want them (the run store, the JupyterLab watcher), not kept by the run loop.

Here, in core/, because the run loop attaches them: the sinks themselves (sinks/, notebook/) sit
above the loop and register into this list, so the loop never imports them.
"""

from __future__ import annotations

from collections.abc import Callable

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
