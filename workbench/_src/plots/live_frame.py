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
Y_CELLS = 2  # a linear axis snaps to a grid of 1/2 of its span's decade; a log axis' top to 1/4 decade
LOG_BOTTOM_GRID = 1.0  # decades: a log axis' bottom snaps to whole decades
TOP_LADDER = 10  # a linear axis of values >= 0 ends at the first of 10^(k/10) past 1.05x its top


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
        # The bottom on whole decades: a loss falling by orders of magnitude (what puts a panel on
        # a log scale) moved a quarter-decade grid at almost every frame, each a full drawing.
        bottom, top = _snapped_down(math.log10(lo), LOG_BOTTOM_GRID), _snapped_up(math.log10(hi), 0.25)
        ax.set_ylim(10**bottom, 10**top)
    else:
        span = hi - lo or abs(hi) or 1.0
        bottom, top = _snapped(lo, hi, 10 ** math.floor(math.log10(span)) / Y_CELLS)
        if lo >= 0 and hi > 0:
            # Rates (examples/s) climb for a while and set a new highest value at most frames:
            # the top on a ladder of ~26% steps moves a few times per doubling, not at each.
            top = 10 ** (math.ceil(math.log10(hi * 1.05) * TOP_LADDER) / TOP_LADDER)
        ax.set_ylim(bottom, top)


def _snapped(lo: float, hi: float, step: float) -> tuple[float, float]:
    """[lo, hi] widened to multiples of `step`, with a tenth of a step at least beyond each end."""
    return _snapped_down(lo, step), _snapped_up(hi, step)


def _snapped_down(lo: float, step: float) -> float:
    return math.floor(lo / step - 0.1) * step


def _snapped_up(hi: float, step: float) -> float:
    return math.ceil(hi / step + 0.1) * step


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


class DrawingBudget:
    """When a live figure may be drawn next: its drawings' CPU stays under `share` of one core
    over any WINDOW seconds, and frames come at least `period` apart.

    Spacing each drawing by its own cost over the share (the rule before) held the figure one to
    three snapshots behind the header whenever the axes' limits moved: a full drawing (~0.1 s of
    CPU, 4-5x a blitted frame) then spaced the next frame by a second, and a fast run moves its
    limits often (an async-ps run's step axis crossed a grid line every few snapshots). Over a
    window, the few full drawings are paid by the cheap blitted frames around them: every
    snapshot is drawn while the average stays within the share, and a figure that costs more
    waits until older drawings have left the window.
    """

    WINDOW = 10.0  # seconds: the longest burst is share x WINDOW of CPU (1 s at 10%)

    def __init__(self, share: float, period: float):
        self.share, self.period = share, period
        self._drawn: list[tuple[float, float]] = []  # (monotonic start, CPU seconds) in the window
        self._last = -math.inf

    def spent(self, start: float, cost: float, counted: bool = True) -> None:
        """A drawing started at `start` (monotonic) took `cost` CPU seconds. One that built the
        figure (the first, a new metric's panel, a theme switch: several frames' cost, once) is
        not `counted`: counted, it held the figure back for seconds at the start of every run."""
        self._last = start
        if counted:
            self._drawn.append((start, cost))
        self._drawn = [(t, c) for t, c in self._drawn if t > start - self.WINDOW]

    def next_time(self) -> float:
        """The monotonic time from which the next frame may be drawn."""
        earliest = self._last + self.period
        if not self._drawn:
            return earliest
        recent = sorted(c for _, c in self._drawn[-5:])
        expected = recent[len(recent) // 2]  # what the next frame probably costs
        allowed = self.share * self.WINDOW
        if expected > allowed:  # one frame is more than the window allows: spaced by its cost
            return max(earliest, self._drawn[-1][0] + expected / self.share)
        spent = sum(c for _, c in self._drawn)
        for start, cost in self._drawn:  # oldest first: each leaving the window frees its cost
            if spent + expected <= allowed:
                break
            spent -= cost
            earliest = max(earliest, start + self.WINDOW)
        return earliest
