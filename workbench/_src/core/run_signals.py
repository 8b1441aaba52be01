"""How a run hears signals: Ctrl-C (a Jupyter interrupt) stops at the next step boundary, a second
aborts; SIGTERM (a scheduler taking the machine) saves at the next boundary and ends "preempted".
Only the main thread may install handlers: elsewhere these do nothing.
"""

from __future__ import annotations

import os
import signal
import threading

from workbench._src.core.run import Run


class _stop_on_sigint:
    """First Ctrl-C (or a Jupyter interrupt): stop at the next step boundary. Second: abort."""

    def __init__(self, run: Run):
        self.run = run
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        self.previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            if self.run.stop_requested:
                signal.signal(signal.SIGINT, self.previous)
                raise KeyboardInterrupt
            self.run.interrupt()

        signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        return False


class PreemptOnSigterm:
    """While a run goes: SIGTERM (a cluster manager or scheduler about to take the machine, a
    `kill`) asks it to save at the next step boundary and end "preempted", as TensorFlow's
    PreemptionCheckpointHandler does; the other processes of a multi-worker run learn it at that
    boundary (the chunk agreement) and save with it. A second SIGTERM ends the process as usual.

    A context manager installing the handler (only in the main thread: Ray runs actor calls in
    others), and a sink: given no run, it takes the first run whose event it receives (a
    script's foreground run, which exists only once train() has started).
    """

    sink_name = "the SIGTERM handler"

    def __init__(self, cause: str = "SIGTERM", run: Run | None = None):
        self.cause, self.run = cause, run
        self.pending = False  # SIGTERM came before the run existed
        self.previous = None

    def send(self, event) -> None:
        if self.run is None:
            from workbench._src.core.run import live_run

            self.run = live_run(event.run_id)
            if self.pending and self.run is not None:
                self.run.preempt(self.cause)

    def _handle(self, signum, frame) -> None:
        if self.pending or (self.run is not None and self.run._preempted):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the second: end as if we were not here
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.pending = True
        if self.run is not None:
            self.run.preempt(self.cause)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        return False
