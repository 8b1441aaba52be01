"""What the benches share: a private runs folder for the runs they record."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def private_runs_dir(prefix: str) -> None:
    """Records this process's runs in a temporary folder removed at exit (unless the user chose
    one with WORKBENCH_RUNS_DIR): a bench's runs are measurements, not the user's runs."""
    if "WORKBENCH_RUNS_DIR" not in os.environ:
        runs = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, runs, ignore_errors=True)
        os.environ["WORKBENCH_RUNS_DIR"] = runs
