"""pytest wiring for the tutorial notebooks, which nbval collects (see pyproject.toml).

- The sanitizers in nbval_sanitize.cfg apply by default, found next to this file, so
  `python -m pytest notebooks/01_quickstart.ipynb` works from any directory.
- While a notebook runs, its kernel records runs in a temporary folder (WORKBENCH_RUNS_DIR), not
  in notebooks/runs/, so testing leaves nothing behind in the repository.
- Its kernel also gets a temporary TMPDIR, removed at the end: nbval ends kernels without a
  normal interpreter exit, which skips TensorFlow's clean-up of its AutoGraph files (30-odd
  `__autograph_generated_file*.py` per notebook were left in the temp folder), and of notebook 9's
  private Ray root.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_runs_dir: str | None = None
_tmp_dir: str | None = None
_saved_env: dict[str, str | None] = {}


def pytest_configure(config):
    if getattr(config.option, "nbval_sanitize_with", "") is None:
        config.option.nbval_sanitize_with = str(HERE / "nbval_sanitize.cfg")


def _is_notebook_cell(item) -> bool:
    return Path(str(item.fspath)).suffix == ".ipynb"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # The kernel starts while the first cell is set up and inherits this environment.
    global _runs_dir, _tmp_dir
    if not _is_notebook_cell(item) or "WORKBENCH_RUNS_DIR" in _saved_env:
        return
    if _runs_dir is None:
        _runs_dir = tempfile.mkdtemp(prefix="workbench-notebook-runs-")
        # Short: a Ray instance started by a notebook puts its root here only when the path leaves
        # room for Ray's socket paths (placements/ray/cluster.py), else in /tmp, where it stayed.
        _tmp_dir = tempfile.mkdtemp(prefix="wb")
    for name, value in (("WORKBENCH_RUNS_DIR", _runs_dir), ("TMPDIR", _tmp_dir)):
        _saved_env[name] = os.environ.get(name)
        os.environ[name] = value


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if "WORKBENCH_RUNS_DIR" not in _saved_env:
        return
    if nextitem is not None and _is_notebook_cell(nextitem):
        return
    for name in ("WORKBENCH_RUNS_DIR", "TMPDIR"):
        previous = _saved_env.pop(name)
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def pytest_sessionfinish(session, exitstatus):
    for folder in (_runs_dir, _tmp_dir):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    # Every tutorial starts a kernel and trains for real (tens of seconds each): the fast lane
    # leaves the notebooks to the full suite.
    for item in items:
        if _is_notebook_cell(item):
            item.add_marker(pytest.mark.slow)
