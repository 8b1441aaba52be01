"""The reaper deletes discarded iterators off the main thread during the session, and exit never
waits for a deletion: the iterators still alive are kept alive, and one under way ends the process
at once with the known status."""

import os
import subprocess
import sys
import textwrap
import time

# Stand-ins for TensorFlow iterators: deleting one takes a while (or forever) and is logged.
PRELUDE = textwrap.dedent(
    """
    import sys, threading, time
    from workbench._src.core import reaper

    log = open(sys.argv[1], "a")

    class SlowIterator:
        def __init__(self, name, seconds=1.0):
            self.name, self.seconds = name, seconds
        def __del__(self):
            log.write(f"start {self.name} {threading.current_thread().name}\\n")
            log.flush()
            time.sleep(self.seconds)
            log.write(f"end {self.name}\\n")
            log.flush()

    class Program:  # what reaper.track and discard_programs need: an `iterator` attribute
        def __init__(self, name):
            self.iterator = SlowIterator(name)
    """
)


def run_script(tmp_path, body: str, *argv: str):
    script, log = tmp_path / "script.py", tmp_path / "deleted.log"
    script.write_text(PRELUDE + textwrap.dedent(body))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), str(log), *argv], capture_output=True, text=True, timeout=120
    )
    lines = log.read_text().splitlines() if log.exists() else []
    return done, lines, time.monotonic() - started


def test_discarded_programs_are_deleted_on_the_reaper_thread(tmp_path):
    done, lines, _ = run_script(
        tmp_path,
        """
        program = Program("discarded")
        reaper.track(program)
        reaper.discard_programs([program])
        assert program.iterator is None
        time.sleep(2.0)  # the deletion (1 s) ends during the session
        """,
    )
    assert done.returncode == 0, done.stderr
    assert lines == ["start discarded workbench iterator reaper", "end discarded"]


def test_exit_keeps_live_and_queued_iterators_alive_instead_of_deleting_them(tmp_path):
    done, lines, seconds = run_script(
        tmp_path,
        """
        programs = [Program(f"live{i}") for i in range(3)]  # alive until exit (1 s each to delete)
        for program in programs:
            reaper.track(program)
        # Handed to the reaper but not started yet (its thread busy with an earlier one).
        reaper._queue.put([SlowIterator("queued", 30.0)])
        """,
    )
    assert done.returncode == 0, done.stderr
    assert lines == []  # no deletion was even started
    assert seconds < 15  # none of the 30 s deletions was waited for
    assert "did not finish" not in done.stderr and "FATAL" not in done.stderr


def test_a_deletion_under_way_at_exit_ends_the_process_at_once_with_the_known_status(tmp_path):
    body = """
        reaper.discard_iterators([SlowIterator("never", 3600.0)])
        time.sleep(0.3)
        assert reaper._deleting
        if len(sys.argv) > 2:
            reaper.exit_code_hint = int(sys.argv[2])
        print("printed before exit")
        """
    for argv, status in (((), 0), (("3",), 3)):
        done, lines, seconds = run_script(tmp_path, body, *argv)
        assert done.returncode == status, done.stderr
        assert seconds < 15
        assert "printed before exit" in done.stdout  # flushed before the process ended
        assert "FATAL" not in done.stderr


def test_an_early_exit_still_removes_the_files_tensorflow_wrote_for_autograph(tmp_path):
    """The early exit (os._exit) skips TensorFlow's own exit hooks, among them the removal of the
    `__autograph_generated_file*.py` files AutoGraph writes to the temp folder: the exit removes
    them itself. (A suite run under `-n 3` once left 49 in /tmp, from a test process that ended
    this way.) TensorFlow converts before the reaper is imported, so that its hooks would run
    after the reaper's, as in a kernel where TensorFlow came first."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    convert_first = textwrap.dedent(
        """
        import os
        import tensorflow as tf

        @tf.function
        def absolute(x):
            if x > 0:  # a tensor's condition: AutoGraph converts the function, writing a file
                return x
            return -x

        absolute(tf.constant(-1.0))
        generated = [n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith("__autograph_generated")]
        print("generated", len(generated), flush=True)
        """
    )
    body = """
        reaper.discard_iterators([SlowIterator("never", 3600.0)])
        time.sleep(0.3)
        assert reaper._deleting  # so exit takes the early way out
        """
    script = tmp_path / "script.py"
    script.write_text(convert_first + PRELUDE + textwrap.dedent(body))
    env = {**os.environ, "TMPDIR": str(private_tmp), "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "deleted.log")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split("generated")[1].split()[0]) >= 1, done.stdout
    assert list(private_tmp.iterdir()) == []


def test_the_reaper_drops_an_iterators_last_handle_itself_not_inside_a_collection(tmp_path):
    """The handle of a C++ iterator can also be captured by a reference cycle (a traced graph), so
    a collector may free its last reference, on whatever thread it runs: a notebook's main thread
    froze 4-80 s so, in ~IteratorResource. The reaper holds the handles while it collects and
    drops them itself: the destruction runs on its thread and outside any collection."""
    done, lines, _ = run_script(
        tmp_path,
        """
        import gc, weakref
        import tensorflow as tf
        from workbench._src import compat

        collecting = threading.local()
        gc.callbacks.append(lambda phase, info: setattr(collecting, "on", phase == "start"))
        iterator = iter(tf.data.Dataset.range(10))
        next(iterator)
        (handle,) = compat.iterator_resource_handles([iterator])
        cycle = [handle]
        cycle.append(cycle)  # a cycle that captures the handle, as a traced function's graph does

        def destroyed(_):
            log.write(f"{threading.current_thread().name} collecting={getattr(collecting, 'on', False)}\\n")
            log.flush()

        watch = weakref.ref(handle, destroyed)
        del handle, cycle
        gc.disable()  # no automatic collection: only the reaper's own
        iterators = [iterator]
        del iterator
        reaper.discard_iterators(iterators)
        deadline = time.monotonic() + 60
        while watch() is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert lines == ["workbench iterator reaper collecting=False"]


def test_a_program_the_collector_finds_has_its_iterator_deleted_after_that_collection(tmp_path):
    """The garbage collector calls a Program's finalizer (which hands its iterator to the reaper)
    *before* it clears the Program, whose `iterator` attribute still holds the iterator. Had the
    reaper started then (it can: a finalizer that lets go of the GIL is enough), its reference
    would not be the last one, and the collector's clearing of the Program would destroy the C++
    iterator on the collecting thread, waiting for tf.data there (seen: a test frozen minutes in
    ~IteratorResource under a `_no_cyclic_gc` exit on the main thread). The iterator goes to the
    reaper once that collection is over."""
    done, lines, _ = run_script(
        tmp_path,
        """
        import gc, weakref
        import tensorflow as tf
        from workbench._src import compat

        collecting = threading.local()
        gc.callbacks.append(lambda phase, info: setattr(collecting, "on", phase == "start"))

        class RealProgram:
            def __init__(self):
                self.iterator = iter(tf.data.Dataset.range(10))
                next(self.iterator)
                self.me = self  # in a reference cycle: only the collector frees it
                reaper.adopt(self)

        class LetsGoOfTheGIL:  # garbage found after the program, its finalizer sleeps
            def __init__(self):
                self.me = self
                weakref.finalize(self, time.sleep, 0.2)

        gc.disable()
        program = RealProgram()
        (handle,) = compat.iterator_resource_handles([program.iterator])

        def destroyed(_):
            log.write(f"{threading.current_thread().name} collecting={getattr(collecting, 'on', False)}\\n")
            log.flush()

        watch = weakref.ref(handle, destroyed)
        del handle
        sleepers = [LetsGoOfTheGIL() for _ in range(3)]
        reaper.discard_iterators([])  # (no-op) the reaper thread is not started by this
        del program, sleepers
        gc.collect()  # on this thread: finds the program, then the sleepers
        deadline = time.monotonic() + 60
        while watch() is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert lines == ["workbench iterator reaper collecting=False"]
