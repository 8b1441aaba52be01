"""Reading the run store back: `wb.runs()` lists recorded runs, `wb.load_run()` reloads one.

The folders are written by `workbench._src.sinks.runstore` (see its docstring for the layout).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

from workbench._src.core.errors import ConfigurationError
from workbench._src.sinks.runstore import CONFIG, EVENTS, FIGURE, HISTORY, _recorded, runs_dir


@dataclasses.dataclass
class RunRecord:
    """A recorded run, reloaded from disk by `wb.load_run`."""

    id: str
    name: str
    status: str
    path: Path
    config: dict
    summary: dict
    history: object  # pandas.DataFrame
    events: list

    @property
    def figure_path(self) -> Path | None:
        p = self.path / FIGURE
        return p if p.exists() else None

    def _repr_html_(self) -> str:
        import base64
        import html

        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
            for k, v in self.summary.items()
        )
        img = ""
        if self.figure_path:
            data = base64.b64encode(self.figure_path.read_bytes()).decode("ascii")
            img = f"<br><img src='data:image/png;base64,{data}'/>"
        return f"<b>{html.escape(self.name)}</b> ({html.escape(self.id)}, {html.escape(self.status)})<table>{rows}</table>{img}"


_NOT_METRICS = ("steps", "steps_recorded", "last_step", "wall_time_s", "steps_per_sec", "examples_per_sec")


def delete_runs(run_ids, directory: str | os.PathLike | None = None) -> list[str]:
    """Deletes recorded runs (their folders) from the runs directory; returns the ids deleted.

    A run still training is refused (stop it first). Example:
      >>> import workbench as wb
      >>> wb.delete_runs(wb.runs().query("status == 'failed'")["id"])   # doctest: +SKIP
    """
    import shutil

    if isinstance(run_ids, str):
        run_ids = [run_ids]
    base = Path(directory) if directory is not None else runs_dir()
    folders = [_find(base, getattr(r, "id", r), any_base=directory is None) for r in run_ids]
    running = [f.name for f in folders if (_read_record(f) or {}).get("status") in ("running", "created")]
    if running:
        raise ConfigurationError(
            f"delete_runs: {', '.join(running)} still running; received {list(run_ids)!r}. "
            "Fix: stop it first (run.stop() or the sidebar's Stop), then delete."
        )
    for folder in folders:
        shutil.rmtree(folder)
        _recorded.pop(folder.name, None)
    return [f.name for f in folders]


def _read_record(folder: Path) -> dict | None:
    try:
        record = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if record.get("status") in ("running", "created") and not _alive(record):
        record["status"] = "lost"  # its process ended without an 'ended' event (a dead kernel)
    return record


def _alive(record: dict) -> bool:
    if record.get("host") != socket.gethostname():
        return True  # cannot tell from here: trust the record
    try:
        os.kill(int(record.get("pid", -1)), 0)
    except (OSError, ValueError):
        return False
    return True


def runs(directory: str | os.PathLike | None = None):
    """All recorded runs as a DataFrame, oldest first: id, status, backend, replicas, metrics, path.

    Example:
      >>> import workbench as wb
      >>> df = wb.runs()   # doctest: +SKIP
      >>> df[["id", "status", "backend", "num_replicas", "steps", "loss"]]   # doctest: +SKIP
    """
    import pandas as pd

    base = Path(directory) if directory is not None else runs_dir()
    rows = []
    for folder in sorted(base.iterdir()) if base.is_dir() else []:
        record = _read_record(folder)
        if record is None:
            continue
        config, summary = record.get("config", {}), record.get("summary", {})
        started, ended = record.get("started"), record.get("ended")
        row = {
            "id": folder.name,
            "name": record.get("name"),
            "status": record.get("status"),
            "backend": config.get("backend"),
            "num_replicas": config.get("num_replicas"),
            "steps": summary.get("steps", summary.get("steps_recorded")),
            "steps_asked": config.get("steps"),
            "started": pd.Timestamp(started, unit="s") if started else pd.NaT,
            "duration_s": round(ended - started, 3) if started and ended else None,
            "steps_per_sec": summary.get("steps_per_sec"),
            "examples_per_sec": summary.get("examples_per_sec"),
        }
        row.update({k: v for k, v in summary.items() if k not in _NOT_METRICS})
        row.update(stop_reason=record.get("stop_reason"), path=str(folder))
        rows.append(row)
    columns = [
        "id",
        "name",
        "status",
        "backend",
        "num_replicas",
        "steps",
        "steps_asked",
        "started",
        "duration_s",
        "steps_per_sec",
        "examples_per_sec",
    ]
    frame = pd.DataFrame(rows, columns=None if rows else columns)
    return frame.sort_values("started", kind="stable").reset_index(drop=True) if rows else frame


def load_run(run_id: str | int = -1, directory: str | os.PathLike | None = None) -> RunRecord:
    """Reloads a recorded run: its history DataFrame, config, summary and events.

    Args:
      run_id: a run's id (as in wb.runs() or run.id), or a position in wb.runs() (-1: latest).
      directory: the runs directory (default: runs_dir()).

    Example:
      >>> import workbench as wb
      >>> rec = wb.load_run(-1)   # doctest: +SKIP
      >>> rec.history.tail(), rec.config["backend"]   # doctest: +SKIP
    """
    import pandas as pd

    base = Path(directory) if directory is not None else runs_dir()
    folder = _find(base, run_id, any_base=directory is None)
    record = _read_record(folder) or {}
    history = (
        pd.read_csv(folder / HISTORY)
        if (folder / HISTORY).exists()
        else pd.DataFrame(columns=["step", "wall_time", "examples_per_sec"])
    )
    events = []
    if (folder / EVENTS).exists():
        events = [json.loads(line) for line in (folder / EVENTS).read_text().splitlines() if line.strip()]
    return RunRecord(
        id=folder.name,
        name=record.get("name", folder.name),
        status=record.get("status", "unknown"),
        path=folder,
        config={**record.get("config", {})},
        summary=record.get("summary", {}),
        history=history,
        events=events,
    )


def _find(base: Path, run_id, any_base: bool = False) -> Path:
    if isinstance(run_id, int) and not isinstance(run_id, bool):
        listing = runs(base)
        if not -len(listing) <= run_id < len(listing):
            raise ConfigurationError(
                f"load_run({run_id}) asked for position {run_id}, but {base} holds {len(listing)} "
                "recorded run(s). Fix: use wb.runs() to see them, then load_run(<id>) or load_run(-1)."
            )
        return Path(listing["path"].iloc[run_id])
    run_id = getattr(run_id, "id", run_id)  # a wb.Run works too
    if not isinstance(run_id, str) or not run_id or Path(run_id).name != run_id or run_id in (".", ".."):
        # A run id is one folder name inside the runs folder: never a path that leaves it.
        raise ConfigurationError(
            f"A run id is the name of one folder in the runs folder {base}; received {run_id!r}, "
            "which is a path (or not a name). Fix: pick an id from wb.runs() (the 'run' column), or "
            "pass directory= the folder that holds the run."
        )
    if run_id in _recorded and (any_base or _recorded[run_id].parent.resolve() == base.resolve()):
        return _recorded[run_id]
    if (base / str(run_id) / CONFIG).exists():
        return base / str(run_id)
    known = sorted(p.name for p in base.iterdir() if (p / CONFIG).exists()) if base.is_dir() else []
    raise ConfigurationError(
        f"No recorded run {run_id!r} under {base}; it holds {len(known)} run(s)"
        + (f", the latest: {', '.join(known[-3:])}" if known else "")
        + ". Fix: pick an id from wb.runs(), or pass directory=... if it was recorded elsewhere."
    )
