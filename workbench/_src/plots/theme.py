"""The figures' colours follow the JupyterLab theme: dark figures on a dark theme.

The kernel cannot see the page, so the sidebar tells it: a "theme" message over the lab comm
(workbench/_src/notebook/labcomm.py) on connecting and whenever the user switches themes.
WORKBENCH_THEME=dark|light overrides it (a script, nbconvert, a test). Every figure (the run
dashboard, the run store's PNG, compare_runs, the scaling plot) is drawn inside `context()`.
"""

from __future__ import annotations

import contextlib
import os

ENV_VAR = "WORKBENCH_THEME"
_dark_from_frontend: bool | None = None

# JupyterLab Dark's layout colour 1 and font colours (the cell output background it sits on).
DARK = {
    "figure.facecolor": "#111111",
    "axes.facecolor": "#111111",
    "savefig.facecolor": "#111111",
    "axes.edgecolor": "#9e9e9e",
    "axes.labelcolor": "#e0e0e0",
    "text.color": "#e0e0e0",
    "xtick.color": "#bdbdbd",
    "ytick.color": "#bdbdbd",
    "grid.color": "#616161",
    "legend.facecolor": "#1e1e1e",
    "legend.edgecolor": "#616161",
}


def set_dark(dark: bool | None) -> None:
    """What the frontend reports (None: unknown, light)."""
    global _dark_from_frontend
    _dark_from_frontend = None if dark is None else bool(dark)


def is_dark() -> bool:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced in ("dark", "light"):
        return forced == "dark"
    return bool(_dark_from_frontend)


def key() -> str:
    """Part of a cached figure's key: a figure drawn for one theme is not reused for the other."""
    return "dark" if is_dark() else "light"


@contextlib.contextmanager
def context():
    """matplotlib rc settings for the current theme (figures created and saved inside)."""
    import matplotlib

    with matplotlib.rc_context(DARK if is_dark() else {}):
        yield
