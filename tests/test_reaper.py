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
