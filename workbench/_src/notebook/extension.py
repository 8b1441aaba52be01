"""`%load_ext workbench`, and the notebook-facing names `workbench/__init__.py` re-exports.

Kept free of heavy imports: `import workbench` pulls this in, so IPython, TensorFlow,
matplotlib, ipywidgets and pandas are imported only by the functions that need them.
"""

from __future__ import annotations

from workbench import ui
from workbench._src.notebook.session import current, use
from workbench._src.sinks.runstore import set_runs_dir
from workbench._src.store.runhistory import load_run, runs

__all__ = ["current", "load_ipython_extension", "load_run", "runs", "set_runs_dir", "ui", "use"]


def load_ipython_extension(ipython) -> None:
    """`%load_ext workbench`: registers %replicate / %%replicate and prepares the session.

    Also (1) fixes the device layout now, before the notebook's first TensorFlow op, so that
    mirrored replicas have virtual CPUs to run on where there is no GPU, and (2) turns on the
    run store, so every run is recorded under wb.runs(). Loading it again is harmless.

    Call `wb.configure_devices(cpus=N)` before `%load_ext workbench` for a count other than 8.
    """
    # Here, not at the top: the magics import IPython, which `import workbench` must not pull in.
    from workbench._src.core.tf_setup import DEFAULT_VIRTUAL_CPUS, configure_devices
    from workbench._src.notebook import labcomm
    from workbench._src.notebook.magics import ReplicateMagics
    from workbench._src.sinks import runstore

    ipython.register_magics(ReplicateMagics)
    runstore.install()
    # Configuring the devices imports TensorFlow: 5-15 s without output, so the cell says so at
    # once (issue 41: something on screen within 2 s), and the line goes when the import is done.
    note = _transient_note("workbench: importing TensorFlow to configure its devices...")
    try:
        devices = configure_devices()
    finally:
        if note is not None:
            note.update({"text/plain": ""}, raw=True)
    labcomm.register(ipython)  # the JupyterLab sidebar's kernel side (a comm target; no-op outside a kernel)
    if not devices["gpus"] and not devices["tpus"] and devices["virtual_cpus"] < 2:
        # TensorFlow started before the extension could split the CPU: say so now, not at the
        # first mirrored run.
        print(
            f"workbench: TensorFlow was already initialised with {devices['virtual_cpus']} CPU device, so "
            "mirrored runs get one replica. Fix: restart the kernel and run `%load_ext workbench` "
            f"(it configures {DEFAULT_VIRTUAL_CPUS} virtual CPUs) before any other TensorFlow code."
        )


def _transient_note(text: str):
    """Shows `text` in the running cell under a display id (its handle, to blank it when done);
    None where there is nothing to say it: TensorFlow already imported (nothing slow follows),
    or no kernel (a terminal IPython shows a display only once: it would stay)."""
    import sys

    from workbench._src.sinks.dashboard_view import detect_frontend

    if "tensorflow" in sys.modules or detect_frontend() != "widgets":
        return None
    from IPython.display import display

    return display({"text/plain": text}, raw=True, display_id=True)
