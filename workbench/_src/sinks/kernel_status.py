"""The kernel's Busy indicator while a cell trains.

JupyterLab shows the kernel's state from the last "status" message on IOPub, whatever request it
answers. When a cell displays a widget (the live dashboard), JupyterLab's widget manager asks
ipykernel 7 for a subshell on the control channel; the kernel answers that request with "busy"
then "idle" on IOPub, and the indicator said Idle for the rest of a training cell (issue 41:
seen in a browser 0.6 s after the cell started). So while the cell that showed the dashboard
still executes, "busy" is said again for that cell every REFRESH_SECONDS, and no more once the
cell ends (IPython's post_run_cell): the kernel's own "idle" is the last word.
"""

from __future__ import annotations

import threading

REFRESH_SECONDS = 0.5


class BusyWhileTheCellRuns:
    """Made in a cell (the live dashboard, when it shows its widget): in a kernel's main thread, it
    says "busy" for that cell until the cell ends or stop() is called; elsewhere nothing."""

    def __init__(self):
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._shell = self._kernel = self._parent = None
        if threading.current_thread() is not threading.main_thread():
            self._stopped.set()
            return
        try:
            from IPython import get_ipython
        except ImportError:
            self._stopped.set()
            return
        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        if kernel is None or not hasattr(kernel, "_publish_status"):  # (ipykernel's own: no public API)
            self._stopped.set()
            return
        self._shell, self._kernel, self._parent = shell, kernel, kernel.get_parent("shell")
        shell.events.register("post_run_cell", self._cell_ended)
        threading.Thread(target=self._tick, name="workbench busy indicator", daemon=True).start()

    def stop(self) -> None:
        with self._lock:  # (a "busy" being sent is sent before this returns)
            self._stopped.set()

    def _cell_ended(self, result=None) -> None:
        self.stop()
        try:
            self._shell.events.unregister("post_run_cell", self._cell_ended)
        except ValueError:
            pass

    def _tick(self) -> None:
        while not self._stopped.wait(REFRESH_SECONDS):
            with self._lock:
                if self._stopped.is_set():
                    return
                try:
                    self._kernel._publish_status("busy", "shell", parent=self._parent)
                except Exception:  # noqa: BLE001 - a closing kernel's sockets must not break a run
                    return
