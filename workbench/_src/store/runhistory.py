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
from workbench._src.core.run import live_run
from workbench._src.sinks.runstore import (
    CONFIG,
    EVENTS,
    FIGURE,
    HISTORY,
    _recorded,
    runs_dir,
    store_lock,
    store_names,
)


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
    links = [f for f in folders if f.is_symlink()]
    if links:
        raise ConfigurationError(
            f"delete_runs: {', '.join(f'{f.name} (a link to {os.readlink(f)})' for f in links)} is a "
            f"symbolic link, not a folder the run store made; received {list(run_ids)!r}. Nothing was "
            "deleted. Fix: remove the link yourself (`rm` on its path) if that is what you meant; "
            "delete_runs never follows a link into another folder."
        )
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


# wb.runs()'s columns, in order (metrics, hyperparameters, stop_reason and path follow).
COLUMNS = [
    "id", "name", "status", "source", "started", "tags",
    "backend", "replicas", "workers", "ps", "global_batch", "steps", "steps_asked", "steps_per_execution",
    "duration_s", "steps_per_sec", "examples_per_sec",
]  # fmt: skip


def runs(directory: str | os.PathLike | None = None):
    """All recorded runs as a DataFrame, oldest first.

    Columns: id, name (unique in the store), status, source (notebook or script), started, tags
    (comma-separated), the configuration (backend, replicas, workers, ps, global_batch,
    steps = steps done, steps_asked, steps_per_execution), duration_s, steps_per_sec,
    examples_per_sec, each metric's last value, each of the run's `hparams`, stop_reason, path.

    Example:
      >>> import workbench as wb
      >>> df = wb.runs()   # doctest: +SKIP
      >>> df[df.tags.str.contains("baseline")][["name", "backend", "replicas", "loss"]]   # doctest: +SKIP
    """
    import pandas as pd

    base = Path(directory) if directory is not None else runs_dir()
    rows = []
    for folder in sorted(base.iterdir()) if base.is_dir() else []:
        record = _read_record(folder)
        if record is None:
            continue
        rows.append(_row(folder, record, pd))
    frame = pd.DataFrame(rows, columns=None if rows else COLUMNS)
    return frame.sort_values("started", kind="stable").reset_index(drop=True) if rows else frame


def _row(folder: Path, record: dict, pd) -> dict:
    config, summary = record.get("config") or {}, record.get("summary") or {}
    started, ended = record.get("started"), record.get("ended")
    steps = summary.get("steps", summary.get("steps_recorded"))
    row = {
        "id": folder.name,
        "name": record.get("name"),
        "status": record.get("status"),
        "source": config.get("source"),
        "started": pd.Timestamp(started, unit="s") if started else pd.NaT,
        "tags": ", ".join(record.get("tags") or []),
        "backend": config.get("backend"),
        "replicas": config.get("num_replicas"),
        "workers": config.get("num_workers", 1 if config.get("backend") else None),
        "ps": config.get("num_ps", 0 if config.get("backend") else None),
        "global_batch": config.get("global_batch"),
        "steps": int(steps) if steps is not None else None,
        "steps_asked": config.get("steps"),
        "steps_per_execution": config.get("steps_per_execution"),
        "duration_s": round(ended - started, 3) if started and ended else None,
        "steps_per_sec": summary.get("steps_per_sec"),
        "examples_per_sec": summary.get("examples_per_sec"),
    }
    row.update({k: v for k, v in summary.items() if k not in _NOT_METRICS})
    for key, value in (config.get("hparams") or {}).items():
        row[key if key not in row else f"hparam_{key}"] = value
    row.update(stop_reason=record.get("stop_reason"), path=str(folder))
    return row


def rename_run(run, name: str, directory: str | os.PathLike | None = None) -> str:
    """Renames a recorded run (a wb.Run, a RunRecord or an id); returns the new name.

    Names are unique in the store: a name another run has is refused (the error names that run).
    A run of this kernel that is still going shows the new name at once (sidebar, dashboard).

    Example:
      >>> import workbench as wb
      >>> wb.rename_run(run, "baseline lr=1e-3")   # doctest: +SKIP
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(f"rename_run: a name is a non-empty string; received {name!r}.")
    name = name.strip()
    folder = _folder_of(run, directory)
    with store_lock(folder.parent):
        taken = store_names(folder.parent, exclude=folder.name)
        if name in taken:
            raise ConfigurationError(
                f"rename_run: run {taken[name]} is already named {name!r} in {folder.parent}; "
                f"received {name!r} for run {folder.name}. Fix: pick another name (names are "
                "unique in a run store, so legends and the sidebar can tell runs apart)."
            )
        record = _update_record(folder, name=name)
    _tell_live_run(folder.name, record)
    return name


def tag_run(run, *tags: str, replace: bool = False, directory: str | os.PathLike | None = None) -> list[str]:
    """Adds tags to a recorded run (replace=True: sets exactly these); returns its tags.

    Example:
      >>> import workbench as wb
      >>> wb.tag_run(run, "baseline", "lr-sweep")   # doctest: +SKIP
      >>> wb.runs().query("tags.str.contains('baseline')")   # doctest: +SKIP
    """
    cleaned = []
    for tag in tags:
        if not isinstance(tag, str) or not tag.strip() or "," in tag:
            raise ConfigurationError(
                f"tag_run: a tag is a non-empty string without commas; received {tag!r}. "
                "Fix: pass each tag separately, e.g. wb.tag_run(run, 'baseline', 'lr-sweep')."
            )
        cleaned.append(tag.strip())
    folder = _folder_of(run, directory)
    with store_lock(folder.parent):
        old = [] if replace else list((_read_record(folder) or {}).get("tags") or [])
        record = _update_record(folder, tags=list(dict.fromkeys(old + cleaned)))
    _tell_live_run(folder.name, record)
    return record["tags"]


def _folder_of(run, directory) -> Path:
    base = Path(directory) if directory is not None else runs_dir()
    return _find(base, run, any_base=directory is None)


def _update_record(folder: Path, **changes) -> dict:
    """Rewrites config.json with `changes` (atomically; call with store_lock held)."""
    path = folder / CONFIG
    record = json.loads(path.read_text())
    record.update(changes)
    tmp = folder / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=repr))
    os.replace(tmp, path)
    return record


def _tell_live_run(run_id: str, record: dict) -> None:
    """A run of this process still in memory takes the new name and tags (its sinks hear it)."""

    run = live_run(run_id)
    if run is not None:
        run.tags = list(record.get("tags") or [])
        run.rename(record.get("name") or run.name)


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
