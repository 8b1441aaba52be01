"""The live scaling plot: a sink redrawing one notebook output after each configuration."""

from __future__ import annotations

from workbench._src.plots.scaling_plot import png_bytes


def live_sink(live: bool | None):
    """A LiveScalingPlot when asked (live=True) or, by default, when running in a kernel."""
    return LiveScalingPlot() if (live if live is not None else _in_kernel()) else None


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class LiveScalingPlot:
    """A sink: `send(study)` after each configuration redraws one notebook output in place."""

    def __init__(self):
        self._handle = None

    def send(self, study) -> None:
        from IPython.display import Image, display

        image = Image(data=png_bytes(study), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)
