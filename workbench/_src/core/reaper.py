"""Deleting the input iterators of programs nobody will run again, off the main thread; keeping
the rest alive at exit.

Measured here (TensorFlow 2.21, CPU): deleting a distributed iterator that has sat idle waits for
tf.data's autotuning thread to wake (`RootDataset::Iterator::~Iterator` joins it), 10-40 s, while
the GIL is free. When the garbage collector reaches such an iterator on the main thread, the
notebook freezes that long at a random moment. Programs the workbench itself discards (a re-run
cell's, a scaling study's finished configurations) and every Program the garbage collector finds
(a finalizer registered in `Program`) therefore hand their iterators to one daemon thread that
drops them there.

At interpreter exit nothing is deleted: the process is ending and the operating system takes the
memory back, so the iterators of live programs and the queued ones are kept alive for good (an
extra reference no one releases), and neither finalization nor the garbage collector runs their
C++ destructors. A deletion already under way on the reaper thread ends the process at once
(`_finish_at_exit` says why).
"""

from __future__ import annotations

import gc
import queue
import sys
import threading
import weakref

from workbench._src import compat
from workbench._src.core import exit as process_exit

_queue: queue.SimpleQueue = queue.SimpleQueue()
_lock = threading.Lock()
_thread: threading.Thread | None = None
_closed = False
_deleting = False  # the reaper thread is inside a deletion (guarded by _lock)
_live_programs: weakref.WeakSet = weakref.WeakSet()  # Programs whose iterators exit keeps alive
_collecting: set[int] = set()  # threads inside a garbage collection (gc.callbacks, below)
_held_until_collected: dict[int, list] = {}  # thread -> iterators its running collection found


def track(program) -> None:
    """Remembers a live Program: at exit its iterator is kept alive instead of being deleted."""
    _live_programs.add(program)


def adopt(owner) -> None:
    """Takes charge of `owner.iterator` (a Program's, a numerics twin's): when the owner is
    garbage, its iterator is deleted on the reaper thread, not on whichever thread (the
    notebook's, a training run's) the garbage collector runs; at exit it is kept alive."""
    owner._iterator_finalizer = weakref.finalize(owner, discard_iterators, [owner.iterator])
    owner._iterator_finalizer.atexit = False  # at exit `track` keeps it alive: never deleted
    track(owner)


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
    with _lock:
        if not iterators:
            return
        if _closed:  # at exit (a program finalized late): keep them, as exit keeps the others
            _keep_forever(iterators)
            iterators.clear()
            return
        _start_locked()
    me = threading.get_ident()
    if me in _collecting:
        # Called by the collector (a Program's finalizer), which clears the Program, and with it
        # the Program's own reference to the iterator, only after its finalizers have run: handed
        # over now, the reaper's reference might not be the last. It goes when this collection ends.
        _held_until_collected.setdefault(me, []).extend(iterators)
    else:
        _queue.put(list(iterators))  # the last reference: the deletion happens on the reaper thread
    iterators.clear()


def collect_garbage() -> None:
    """A full garbage collection, run on the reaper thread rather than the caller's: what a warm
    pool's member does between two runs (backends/remote.py `release_run_state`). The last run's
    programs are garbage by then, and with them every traced function that captured an iterator's
    resource handle; whichever thread's collection drops the last such handle destroys the C++
    iterator and waits for tf.data's threads (measured on a Ray member after a 3,000-step run:
    3-14 s in `~MultiDeviceIterator` under `EagerTensor_dealloc`, with the next run's work
    waiting behind it). Here the next run starts at once while the GIL-free wait goes on."""
    with _lock:
        if _closed:
            return
        _start_locked()
    _queue.put([])  # (an empty list: no iterators, only the collection)


def _start_locked() -> None:
    """(Under _lock.) The reaper thread, started once."""
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_reap, name="workbench iterator reaper", daemon=True)
        _thread.start()


def _note_collection(phase: str, info: dict) -> None:
    """gc callback: which threads are inside a collection; at its end, the iterators their
    finalizers handed over go to the reaper."""
    me = threading.get_ident()
    if phase == "start":
        _collecting.add(me)
        return
    _collecting.discard(me)
    held = _held_until_collected.pop(me, None)
    if held:
        _queue.put(held)


gc.callbacks.append(_note_collection)


def _keep_forever(objects) -> None:
    """Adds a reference to each object that is never released: its destructor never runs, not
    even during interpreter finalization (the process ends with it still alive)."""
    for obj in objects:
        compat.keep_forever(obj)


def _reap() -> None:
    global _deleting
    while True:
        iterators = _queue.get()
        with _lock:
            if iterators is None or _closed:  # exit keeps the queued iterators alive
                if iterators:
                    _keep_forever(iterators)
                return
            _deleting = True
        try:
            # The C++ iterator lives as long as its resource handle, and the handle can outlive
            # the Python iterator: the multi-device iterator's traced functions capture it, and an
            # iterator or those graphs can sit in young reference cycles. Whichever thread's
            # collector frees the last reference destroys the C++ iterator there, waiting for
            # tf.data's threads (measured: the suite hung for minutes in ~MultiDeviceIterator
            # under an EagerTensor_dealloc; a notebook's main thread froze 4-80 s in
            # ~IteratorResource when its collector ran between this thread's drop and collect).
            # So this thread holds the handles while the iterators and their cycles go, wherever
            # they are collected, and drops the last references itself.
            handles = compat.iterator_resource_handles(iterators)
            iterators.clear()
            del iterators
            gc.collect()
            handles.clear()  # the C++ destructors run here; may wait for tf.data's tuning thread
            del handles
        finally:
            with _lock:
                _deleting = False


exit_code_hint: int | None = None  # the exit status a host (pytest's conftest) knows it will return


def _finish_at_exit() -> None:
    """Keeps every iterator not yet deleted alive for the rest of the process, so that exit never
    waits for tf.data (measured: a script that trained spent 10-30 s after its last line deleting
    them during finalization, or 20 s in a bounded wait here).

    A deletion already under way on the reaper thread cannot be stopped, and a daemon thread that
    returns from TensorFlow's deletion while Python finalizes is torn down mid-C++ call ("FATAL:
    exception not rethrown", the process aborts with status 134; measured). Waiting for it would
    take 10-40 s, so the process ends here instead: pending `weakref.finalize` callbacks and
    logging are flushed first, then os._exit with the exit status when it is known
    (`exit_code_hint`, or 1 after an uncaught exception, else 0; a `sys.exit(n)` status is not
    visible here and becomes 0).
    """
    global _closed
    with _lock:
        _closed = True
        deleting = _deleting
    kept = [getattr(program, "iterator", None) for program in list(_live_programs)]
    kept.extend(_untracked_iterators())
    _keep_forever([iterator for iterator in kept if iterator is not None])
    del kept
    while True:
        try:
            queued = _queue.get_nowait()
        except queue.Empty:
            break
        _keep_forever(queued or ())
        del queued
    if deleting:
        _exit_now()


process_exit.on_exit("tf.data", _finish_at_exit)


def _untracked_iterators() -> list:
    """Every tf.data iterator object still alive, also those no Program holds (a numerics twin's,
    an async-ps coordinator's, the user's own): each holds an iterator resource whose deletion
    at finalization would wait like the others (measured: 28 s after a test file's summary)."""
    owned = compat.owned_iterator_class()
    if owned is None:  # TensorFlow not imported, or its layout changed: the tracked ones only
        return []
    return [obj for obj in gc.get_objects() if issubclass(type(obj), owned)]  # 0.1 s for 400k objects


def _exit_now() -> None:
    """Ends the process before finalization, as cleanly as that allows."""
    import logging
    import os

    code = exit_code_hint if exit_code_hint is not None else (1 if hasattr(sys, "last_value") else 0)
    compat.run_weakref_finalizers()  # e.g. temporary folders; their atexit hook may run after this one
    compat.remove_autograph_files()  # TensorFlow's atexit hooks for them may run after this one too
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by the host
            pass
    os._exit(code)
