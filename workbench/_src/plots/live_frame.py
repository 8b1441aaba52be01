"""Live redraws that cost a fraction of a full drawing: axes kept while the data fit, lines blitted.

A full drawing of the run figure (four panels: ticks, labels, grid, titles) costs ~85 ms of CPU
here, and the dashboard spaces its drawings by their cost over its CPU budget: the figure came out
1.5-3 s behind the header (issue 41). Most of that cost is text (tick labels) and it only changes
when an axis' limits do. So a live figure's limits snap to a coarse grid (they stay put while new
points fall inside), everything else is drawn once into a background, and on each later
frame restores that background and draws only the lines and the one title that moves (the
median examples/s): matplotlib's blitting, as its animations do. The PNG is the same picture a
full drawing of those limits gives.
"""

from __future__ import annotations

import math

X_GRID = 4  # the step axis ends at the first of 10^(k/4) (steps of ~78%) past the last step
Y_CELLS = 2  # a linear axis snaps to a grid of 1/2 of its span's decade; a log axis to 1/4 decade


def fit_limits(ax, x, ys, log: bool) -> None:
    """Sets `ax`'s limits to hold `x` and every array of `ys`, snapped outwards to a coarse grid:
    a function of the data alone (the same data draws the same picture), and one that stays put
    while new points fall inside it (most frames: nothing but the lines changes)."""
    import numpy as np

    if len(x):
        last = max(float(x[-1]), 1.0)
        ax.set_xlim(0.0, 10 ** (math.ceil(math.log10(last) * X_GRID + 1e-9) / X_GRID))
    values = [np.asarray(y, dtype=float) for y in ys]
    kept = [v[np.isfinite(v) & (v > 0)] if log else v[np.isfinite(v)] for v in values]
    finite = np.concatenate(kept) if kept else np.array([])
    if finite.size == 0:
        return
    lo, hi = float(finite.min()), float(finite.max())
    if log:
        a, b = _snapped(math.log10(lo), math.log10(hi), 0.25)
        ax.set_ylim(10**a, 10**b)
    else:
        span = hi - lo or abs(hi) or 1.0
        ax.set_ylim(*_snapped(lo, hi, 10 ** math.floor(math.log10(span)) / Y_CELLS))


def _snapped(lo: float, hi: float, step: float) -> tuple[float, float]:
    """[lo, hi] widened to multiples of `step`, with a tenth of a step at least beyond each end."""
    return math.floor(lo / step - 0.1) * step, math.ceil(hi / step + 0.1) * step


class Blitter:
    """Draws a figure's static part once per layout and, on each frame, its moving artists on it."""

    def __init__(self):
        self.background = None
        self.key = None
        self.full_draws = 0
        self.blits = 0

    def forget(self) -> None:
        self.background, self.key = None, None

    def draw(self, figure, moving: list, key) -> None:
        """Draws `figure` into its canvas: a full drawing when `key` (what the static part shows:
        limits, scales, titles, marks) changed, else the background and `moving` alone."""
        canvas = figure.canvas
        for artist in moving:
            artist.set_animated(True)  # (left out of a full drawing: drawn over the background)
        if self.background is None or key != self.key:
            canvas.draw()
            self.background = canvas.copy_from_bbox(figure.bbox)
            self.key = key
            self.full_draws += 1
        else:
            canvas.restore_region(self.background)
            self.blits += 1
        renderer = canvas.get_renderer()
        for artist in moving:
            artist.draw(renderer)

    @staticmethod
    def release(moving: list) -> None:
        """A drawing that is not live (the final figure): every artist drawn the usual way."""
        for artist in moving:
            artist.set_animated(False)
