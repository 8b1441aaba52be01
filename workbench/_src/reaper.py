"""Deleting the input iterators of programs nobody will run again, off the main thread.

Measured here (TensorFlow 2.21, CPU): deleting a distributed iterator that has sat idle waits for
tf.data's autotuning thread to wake, 10-40 s, while the GIL is free. When the garbage collector
reaches such an iterator on the main thread, the notebook freezes that long at a random moment.
Programs the workbench itself discards (a re-run cell's, a scaling study's finished
configurations) and every Program the garbage collector finds (a finalizer registered in
`Program`) therefore hand their iterators to one daemon thread that drops them there.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

_queue: queue.SimpleQueue = queue.SimpleQueue()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_closed = False
_live_programs: weakref.WeakSet = weakref.WeakSet()  # Programs whose iterators exit must delete


def track(program) -> None:
    """Remembers a live Program: at exit its iterator is deleted off the main thread, in parallel
    with the others, within the bounded exit wait (instead of one by one during finalization)."""
    _live_programs.add(program)


def discard_programs(programs) -> None:
    """Detaches each Program's iterator and deletes it on the reaper thread.

    Only for programs that will not run again (their runs have ended): the program is left
    without an iterator.
    """
    iterators = []
    for program in programs:
        iterators.extend(_detach(program))
    discard_iterators(iterators)


def _detach(program) -> list:
    """The program's iterator (as a list of 0 or 1), with every reference the program and its
    finalizer held to it dropped, so the caller's is the last one."""
    iterator = getattr(program, "iterator", None)
    program.iterator = None
    finalizer = getattr(program, "_iterator_finalizer", None)
    if finalizer is not None:
        finalizer.detach()
    return [iterator] if iterator is not None else []


def discard_iterators(iterators: list) -> None:
    """Deletes the iterators on the reaper thread (the caller must hold no other reference).

    Also the callback of the finalizer each Program registers, so a program the garbage
    collector finds, on whatever thread, never deletes its iterator there.
    """
    global _thread
    with _lock:
        if not iterators or _closed:  # at exit: deleted where they are, as without the reaper
            return
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_reap, name="workbench iterator reaper", daemon=True)
            _thread.start()
    _queue.put(list(iterators))  # the last reference: the deletion happens on the reaper thread
    iterators.clear()


def _delete_on_a_thread(box: list) -> threading.Thread:
    """Deletes box's iterator on a new daemon thread (the box is its last reference)."""
    deleter = threading.Thread(target=box.clear, name="workbench iterator deletion at exit", daemon=True)
    deleter.start()
    return deleter


def _reap() -> None:
    while True:
        iterators = _queue.get()
        if iterators is None:  # _finish_at_exit
            return
        iterators.clear()  # deletes them here; may wait for tf.data's tuning thread
        del iterators


EXIT_WAIT_S = 20.0
exit_code_hint: int | None = None  # the exit status a host (pytest's conftest) knows it will return


@atexit.register
def _finish_at_exit() -> None:
    """Lets the reaper finish before the interpreter shuts down, for EXIT_WAIT_S at most.

    A daemon thread still inside TensorFlow's deletion when Python finalizes is torn down
    mid-C++ call ("FATAL: exception not rethrown", the process aborts), so exit waits for the
    queued deletions: they would otherwise have run at exit on the main thread anyway.

    Measured: one deletion can also never end (its tf.data thread never finishes), which made
    `python -m pytest` hang after printing its summary. So the wait is bounded; past it the
    process ends at once with os._exit, keeping the exit status when it is known
    (`exit_code_hint`, or 1 after an uncaught exception, else 0).
    """
    global _closed
    with _lock:
        _closed = True
        thread = _thread
    # Every iterator still to delete, each on a thread of its own: a deletion mostly waits for
    # its own tf.data thread to wake, so in parallel they take as long as the slowest one, not
    # the sum (measured: 15-45 s at the end of a test file, one after another at finalization).
    boxes = [_detach(program) for program in list(_live_programs)]
    while True:
        try:
            queued = _queue.get_nowait()
        except queue.Empty:
            break
        boxes.extend([iterator] for iterator in queued or ())
        del queued
    deleters = [_delete_on_a_thread(box) for box in boxes if box]
    del boxes
    if thread is not None and thread.is_alive():
        _queue.put(None)
        deleters.append(thread)
    deadline = time.monotonic() + EXIT_WAIT_S
    for deleter in deleters:
        deleter.join(max(0.0, deadline - time.monotonic()))
    if any(deleter.is_alive() for deleter in deleters):
        import os
        import sys

        code = exit_code_hint if exit_code_hint is not None else (1 if hasattr(sys, "last_value") else 0)
        sys.stderr.write(
            f"workbench: deleting a TensorFlow input iterator did not finish within {EXIT_WAIT_S:.0f} s "
            f"at exit; exiting now (status {code}).\n"
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
