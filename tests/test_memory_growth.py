"""The rule that renews a warm pool for its memory (launch/memory.py), on a real process whose
memory the test grows and frees: a lasting growth past the limit renews, a swing does not."""

from __future__ import annotations

import subprocess
import sys

import pytest

import workbench as wb
from workbench._src.core.errors import ConfigurationError
from workbench._src.launch.memory import MemoryGrowth

# A process that holds or frees MiB on command, touching every page (so they are resident).
HOLDER = """
import sys
held = []
for line in sys.stdin:
    command, mib = line.split()
    if command == "hold":
        held.append(bytearray(b"x") * (int(mib) << 20))
    else:
        held.clear()
    print("done", flush=True)
"""


@pytest.fixture
def holder():
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    tell(process, "free")  # (up: its size is an interpreter's, not a fork's before exec)
    yield process
    process.kill()
    process.wait()


def tell(process, command: str, mib: int = 0) -> None:
    process.stdin.write(f"{command} {mib}\n")
    process.stdin.flush()
    assert process.stdout.readline() == "done\n"


def test_a_lasting_growth_past_the_limit_renews_and_says_which_process_grew(holder):
    memory, processes = MemoryGrowth(), [{"role": "worker", "index": 1, "pid": holder.pid}]
    assert memory.after_run(processes, 1, 0.2) == ""
    assert memory.after_run(processes, 2, 0.2) == ""
    tell(holder, "hold", 40)  # (a few times the size of a bare interpreter)
    assert memory.after_run(processes, 3, 0.2) == ""  # one reading is not yet a lasting growth
    said = memory.after_run(processes, 4, 0.2)
    assert said.startswith("worker 1 grew from ") and "over 4 runs, past memory_growth_limit=0.2" in said


def test_a_swing_of_one_run_does_not_renew(holder):
    memory, processes = MemoryGrowth(), [{"role": "ps", "index": 0, "pid": holder.pid}]
    for run in (1, 2):
        assert memory.after_run(processes, run, 0.2) == ""
    for run in range(3, 9):  # freed again after every other run, as caches are
        tell(holder, "hold" if run % 2 else "free", 40)
        assert memory.after_run(processes, run, 0.2) == "", run


def test_no_limit_never_renews(holder):
    memory, processes = MemoryGrowth(), [{"role": "ps", "index": 0, "pid": holder.pid}]
    assert memory.after_run(processes, 1, None) == ""
    tell(holder, "hold", 40)
    assert memory.after_run(processes, 2, None) == memory.after_run(processes, 3, None) == ""


@pytest.mark.parametrize("limit", [0, -0.1, "5%", True])
def test_a_limit_that_is_no_fraction_above_0_is_refused_saying_what_to_give(limit):
    for backend in (wb.MultiWorkerReplicator, wb.MultiWorkerAsyncReplicator):
        with pytest.raises(ConfigurationError) as raised:
            backend(num_workers=2, memory_growth_limit=limit)
        text = str(raised.value)
        assert f"received memory_growth_limit={limit!r}" in text
        assert "Fix: memory_growth_limit=0.05" in text and "None to never renew" in text
