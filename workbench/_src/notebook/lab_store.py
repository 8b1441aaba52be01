"""The JupyterLab sidebar's requests to the run store (notebook/labcomm.py passes them on): the
runs table ("runs"), "compare", "export", and "delete" / "rename" / "tag", each answered with one
JSON-able message. The run store answers for every recorded run, of any kernel.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable

from workbench._src.sinks import runstore
from workbench._src.store import compare, runhistory
from workbench._src.studies.scaling import study_group


def answer(kind: str, data: dict, forget: Callable[[list[str]], None]) -> dict:
    """The runs table's requests, answered from the run store (every recorded run, any kernel)."""

    try:
        if kind == "delete":
            forget(runhistory.delete_runs(list(data.get("run_ids") or [])))  # (their sidebar cards)
            kind = "runs"
        elif kind == "rename":
            runhistory.rename_run(str(data.get("run_id")), str(data.get("name") or ""))
            kind = "runs"
        elif kind == "tag":
            tags = [t.strip() for t in data.get("tags") or [] if str(t).strip()]
            runhistory.tag_run(str(data.get("run_id")), *tags, replace=True)
            kind = "runs"
        if kind == "runs":
            return {"type": "runs", "rows": runs_rows()}
        if kind == "compare":
            ids = list(data.get("run_ids") or [])
            loaded = compare.load_runs(ids)  # read once: the figure, the table and the series
            result = compare.compare_runs(loaded)
            png = base64.b64encode(result.png()).decode("ascii")
            return {
                "type": "compare",
                "run_ids": ids,
                "png": png,
                "rows": compare.table_rows(result.table),
                "series": compare.series(loaded),
            }
        return _export(str(data.get("run_id")), str(data.get("what", "csv")))
    except Exception as e:  # noqa: BLE001 - told to the user as a notification, not a traceback
        return {"type": "error", "text": f"workbench: {kind} failed: {e}"}


def runs_rows() -> list[dict]:

    table = runhistory.runs()
    paths = list(table["path"]) if "path" in table.columns else [None] * len(table)
    keep = [
        "id", "name", "status", "source", "started", "tags", "backend", "replicas", "workers", "ps",
        "global_batch", "steps", "steps_asked", "steps_per_execution", "duration_s",
        "steps_per_sec", "examples_per_sec", "loss",
    ]  # fmt: skip
    table = table[[c for c in keep if c in table.columns]].assign(
        started=table["started"].map(lambda t: None if t != t else t.timestamp()) if len(table) else []
    )
    rows = compare.table_rows(table)
    for row, path in zip(rows, paths):
        row["group"] = study_group(row.get("name") or "")[0]
        row["hparams"] = _hparams(path)
    return rows


def _hparams(path) -> dict | None:
    """A recorded run's `hparams=` as a dict (None without): wb.runs() spreads them into columns
    among the metrics, so which columns they are is read back from the run's record."""
    import json
    from pathlib import Path

    if not path:
        return None
    try:
        record = json.loads((Path(path) / runstore.CONFIG).read_text())
    except (OSError, ValueError):
        return None
    hparams = (record.get("config") or {}).get("hparams")
    return jsonable(hparams) if isinstance(hparams, dict) and hparams else None


def _export(run_id: str, what: str) -> dict:

    rec = runhistory.load_run(run_id)
    if what == "figure":
        if rec.figure_path is None:
            raise FileNotFoundError(f"run {run_id} has no figure yet (it is written when the run ends)")
        data, mime, name = rec.figure_path.read_bytes(), "image/png", runstore.FIGURE
    else:
        data, mime, name = rec.history.to_csv(index=False).encode(), "text/csv", runstore.HISTORY
    return {
        "type": "export",
        "run_id": rec.id,
        "filename": f"{rec.id}-{name}",
        "mime": mime,
        "data": base64.b64encode(data).decode("ascii"),
    }


def finite(value) -> float | None:
    """JSON has no NaN/Inf (the browser's JSON.parse rejects them): None instead."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return finite(value)
    return repr(value)
