"""Runs the `>>>` examples of the package's docstrings as doctests in `python -m pytest`.

Only modules whose source holds an example are imported (a text check first), so collecting
`workbench/` imports nothing else; the process-launching helpers (`workbench/_src/launch/`) are
never collected. The examples see what the tests see: 8 virtual CPU devices, fixed before
TensorFlow initialises, and runs recorded under runs/tests.
"""

import os
from pathlib import Path

from _pytest.doctest import DoctestModule  # pytest's own doctest collector (not re-exported)

PACKAGE = Path(__file__).parent / "workbench"
NOT_DOCTESTED = (PACKAGE / "_src" / "launch",)  # private helpers that start processes


def pytest_collect_file(file_path: Path, parent):
    if file_path.suffix != ".py" or PACKAGE not in file_path.parents:
        return None
    if any(folder == file_path.parent or folder in file_path.parents for folder in NOT_DOCTESTED):
        return None
    if ">>>" not in file_path.read_text(encoding="utf-8"):
        return None
    _configure_once()
    return DoctestModule.from_parent(parent, path=file_path)


_configured = False


def _configure_once() -> None:
    # Before the first module with examples is imported: an example may start TensorFlow.
    global _configured
    if _configured:
        return
    _configured = True
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("WORKBENCH_RUNS_DIR", str(PACKAGE.parent / "runs" / "tests"))
    import workbench as wb

    wb.configure_devices(cpus=8)
