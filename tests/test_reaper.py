"""The reaper's exit wait is bounded: a deletion that never ends must not hang the process."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from workbench._src import reaper
    reaper.EXIT_WAIT_S = 1.0

    class NeverDeleted:  # stands in for a TensorFlow iterator whose deletion never returns
        def __del__(self):
            time.sleep(3600)

    reaper.discard_iterators([NeverDeleted()])
    time.sleep(0.3)
    if len(sys.argv) > 1:
        reaper.exit_code_hint = int(sys.argv[1])
    """
)


def test_a_stuck_deletion_ends_the_process_with_the_known_status(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    for argv, status in (([], 0), (["3"], 3)):
        done = subprocess.run(
            [sys.executable, str(script), *argv], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == status
        assert "did not finish within 1 s at exit" in done.stderr


LIVE_PROGRAMS_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from workbench._src import reaper

    log = open(sys.argv[1], "a")

    class SlowIterator:  # stands in for a TensorFlow iterator whose deletion waits a while
        def __init__(self, name):
            self.name = name
        def __del__(self):
            start = time.monotonic()
            time.sleep(1.0)
            log.write(f"{self.name} {threading.current_thread().name} {start} {time.monotonic()}\\n")
            log.flush()

    class Program:  # what reaper.track needs: an `iterator` attribute
        def __init__(self, name):
            self.iterator = SlowIterator(name)

    programs = [Program(f"it{i}") for i in range(3)]  # alive until exit
    for program in programs:
        reaper.track(program)
    reaper.discard_iterators([SlowIterator("queued")])  # one handed to the reaper earlier
    """
)


def test_exit_deletes_the_iterators_of_live_programs_in_parallel_off_the_main_thread(tmp_path):
    script, log = tmp_path / "live.py", tmp_path / "deleted.log"
    script.write_text(LIVE_PROGRAMS_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in log.read_text().splitlines()]
    assert sorted(r[0] for r in rows) == ["it0", "it1", "it2", "queued"]
    live = [r for r in rows if r[0].startswith("it")]
    assert all(r[1:-2] == ["workbench", "iterator", "deletion", "at", "exit"] for r in live), rows
    starts, ends = [float(r[-2]) for r in live], [float(r[-1]) for r in live]
    assert max(starts) < min(ends)  # the three deletions overlapped: in parallel, not in turn
