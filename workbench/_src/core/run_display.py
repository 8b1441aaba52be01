"""A wb.Run in a cell's output that follows the run.

A cell's result is drawn once, when the cell ends: a background run's "training in the
background" stayed there after the run finished or failed. Shown with a display id instead, the
output is replaced by the run's summary (status, steps, figures, the cause of a failure) when
the run ends, from whichever thread ends it (a frontend updates every output with that id).
"""

from __future__ import annotations


def display_run(run) -> None:
    """Shows a background `run` in the current cell's output, updated when it ends."""
    from IPython.display import display

    handle = display(_bundle(run), raw=True, display_id=True)

    def on_event(event) -> None:
        if event.kind == "ended":
            handle.update(_bundle(run), raw=True)

    run.subscribe(on_event)  # (an end that came first is replayed at once)


def _bundle(run) -> dict:
    return {"text/plain": repr(run), "text/html": run._repr_html_()}
