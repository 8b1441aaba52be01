"""The panel's pool lines: one pool.describe() read when a pool changes state, as the sidebar is.

The panel used to read the pools only when it ran a run or was opened, so it said "idle" while
the sidebar (told by the pools' observer) said "busy" (issue 41). Now every open panel is
refreshed by the same observer (launch/pool.py), and says the state in the sidebar's words.
"""

from __future__ import annotations

import time
import weakref


def pool_line(d: dict) -> str:
    """One pool in the panel, in the sidebar's words: 'multi-worker pool: 2 workers, 3 processes,
    busy (run 2)' or '..., idle since 14:02:11 (ends after 10 min idle)'."""
    text = f"{d['backend']} pool: {d['workers']} workers, {d['processes']} processes"
    if d["state"] == "idle" and d.get("idle_since"):
        since = time.strftime("%H:%M:%S", time.localtime(d["idle_since"]))
        ends = (
            f"ends after {d['idle_timeout'] / 60:.0f} min idle"
            if d["idle_timeout"]
            else "kept until shut down"
        )
        return f"{text}, idle since {since} ({ends})"
    if d["state"] == "busy":
        return f"{text}, busy (run {d['runs']})"
    if d["state"] == "retiring":
        return f"{text}, ends after its run (run {d['runs']})"
    return f"{text}, {d['state']}"


# The open panels, refreshed when any pool changes state (from whichever thread changed it).
_panels: weakref.WeakSet = weakref.WeakSet()


def follow_pools(panel) -> None:
    from workbench._src.launch import pool as pools

    _panels.add(panel)
    pools.observe(_refresh_panels)  # (once: observe keeps one of each callback)


def _refresh_panels() -> None:
    for panel in list(_panels):
        try:
            panel.refresh_pool()
        except Exception:  # noqa: BLE001 - a closed panel must not break a pool's change
            _panels.discard(panel)
