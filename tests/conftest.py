"""Test setup: 8 virtual CPU devices, fixed before TensorFlow initialises (as TF's own
distribute tests do with set_logical_devices_to_at_least), so multi-replica tests run anywhere."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("WORKBENCH_RUNS_DIR", os.path.join(os.path.dirname(__file__), "..", "runs", "tests"))

import pytest  # noqa: E402
from toy_models import toy_data  # noqa: E402

import workbench as wb  # noqa: E402

wb.configure_devices(cpus=8)


@pytest.fixture
def data():
    return toy_data()


def pytest_sessionfinish(session, exitstatus):
    # If an input iterator's deletion is under way at exit, the reaper ends the process at once
    # rather than wait 10-40 s for it (workbench/_src/core/reaper.py); tell it the status to end with.
    from workbench._src.core import reaper

    reaper.exit_code_hint = int(exitstatus)
