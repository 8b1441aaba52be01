"""How a run is named and how titles name its backend (wb.Run's default name; run.py re-exports)."""

from __future__ import annotations

import os
import time


def short_source(source: str | None) -> str:
    """'work/nb01.ipynb' -> 'nb01'; None -> ''."""
    if not source:
        return ""
    base = os.path.basename(str(source).rstrip("/"))
    return base.rsplit(".", 1)[0] if "." in base else base


def default_name(config: dict, source: str | None, started: float | None = None) -> str:
    """What ran, where and when: 'mirrored x4 · nb01 · 14:02' ('async-ps 2w 1ps · train · 09:15')."""
    parts = [backend_label(config), short_source(source), time.strftime("%H:%M", time.localtime(started))]
    return " \u00b7 ".join(p for p in parts if p)


def backend_label(config: dict) -> str:
    """'mirrored x4', 'async-ps 2w 1ps', 'single': how every title names the backend, once (a
    title whose run name already holds it, as a default name does, leaves it out)."""
    backend = config.get("backend") or "run"
    workers, ps = config.get("num_workers"), config.get("num_ps")
    if ps:
        return f"{backend} {workers or '?'}w {ps}ps"
    if (config.get("num_replicas") or 1) > 1:
        return f"{backend} x{config['num_replicas']}"
    return backend
