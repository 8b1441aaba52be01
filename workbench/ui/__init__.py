"""Notebook UI: the widget panel and the live training dashboard.

    import workbench as wb
    wb.ui.panel()                                        # pick devices, Run / Stop
    run = repl.train(step_fn, input_fn, steps=300, sinks=[wb.ui.dashboard()])

Importing this module imports neither ipywidgets nor matplotlib; calling these functions does.
"""

from __future__ import annotations

__all__ = ["dashboard", "panel"]


def panel(namespace: dict | None = None):
    """The widget panel: devices found, backend, replicas, sync/async, steps, Run and Stop.

    Choosing in the panel sets the session's replicator exactly as `%replicate --backend ...`
    does (`wb.current()`); Run trains the notebook's `step_fn` and `input_fn` in the background.

    Args:
      namespace: where step_fn/input_fn live (default: the notebook's user namespace).

    Example:
      >>> import workbench as wb
      >>> p = wb.ui.panel()          # doctest: +SKIP
      >>> p.magic_line               # doctest: +SKIP
      '%replicate step_fn input_fn --backend mirrored --replicas 2 --steps 300 --background'
    """
    from workbench._src.notebook.panel import Panel  # here: it imports ipywidgets, not at `import workbench`

    return Panel(namespace=namespace)


def dashboard(**options):
    """A live dashboard sink for `repl.train(..., sinks=[wb.ui.dashboard()])`.

    Loss and other metrics and examples/s against step, a progress bar with ETA; redrawn a few
    times a second at most, off the training thread; a static PNG when the run ends. Options:
    see `workbench._src.sinks.dashboard.Dashboard` (display, frontend, max_rate_hz, render_budget).
    """
    from workbench._src.sinks.dashboard import Dashboard  # here: it imports ipywidgets and IPython

    return Dashboard(**options)
