"""The "errors-readable" check in a real Jupyter kernel (issue 41): three %%replicate cells
under mirrored x2 and one under multi-worker x2, each failing as a researcher's first try does.
Each error's message names the cause on its first line (and, from a worker process, the
worker), the traceback the kernel sends to the frontend holds no frame of workbench/_src, and
the sidebar's card for the failed run starts with the same cause, without escape codes."""

import re

import pytest
from error_cells import CASES, HEADER, MISSPELT_NAME
from helpers import LabFrontend, shell_reply

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_orphans")]

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _fail(kc, code: str, timeout: float = 240) -> dict:
    """Runs a cell that must fail; returns the error reply's content (ename, evalue, traceback).

    Without stop_on_error (as cells run one by one, not queued): with it, ipykernel aborts the
    requests that reach it while it is still clearing its queue after this error, and the
    next cell, sent as soon as this reply came, was sometimes answered "aborted"."""
    content = shell_reply(kc, kc.execute(code, stop_on_error=False), timeout, f"{code[:60]!r}...")["content"]
    assert content["status"] == "error", content
    return content


def test_errors_readable_in_a_kernel(tmp_path, monkeypatch, child_tmpdir):
    from jupyter_client.manager import start_new_kernel

    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("WORKBENCH_TRACEBACKS", raising=False)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        reply = shell_reply(kc, kc.execute("%load_ext workbench"), 120, "%load_ext")["content"]
        assert reply["status"] == "ok", reply
        sidebar = LabFrontend(kc)  # what the JupyterLab sidebar receives (its comm)
        sidebar.open()
        cards = 0
        cells = {case: (HEADER + body, cause, line) for case, (body, cause, line) in CASES.items()}
        worker_header = HEADER.replace("mirrored --replicas 2", "multi-worker --workers 2")
        cells["in_a_worker"] = (worker_header + MISSPELT_NAME, r"^worker 0: NameError: .*learning_rat", None)
        for case, (source, cause, line) in cells.items():
            error = _fail(kc, source)
            shown = ANSI.sub("", "\n".join(error["traceback"]))
            first = error["evalue"].splitlines()[0]
            assert re.search(cause, first), (case, first)
            assert "workbench/_src" not in shown, (case, shown)
            if line is not None:  # the frame of the cell's step_fn, at the line that failed
                assert re.search(r"Cell In\[\d+\], line \d+, in step_fn", shown), (case, shown)
                assert line in shown, (case, shown)
            if case != "list_input":  # (that mistake is found before a run starts: no card)
                cards += 1
                seen = sidebar.snapshots(
                    lambda s, n=cards: len(s["runs"]) == n and s["runs"][0]["status"] == "failed"
                )
                card = seen[-1]["runs"][0]["reason"]
                assert re.search(cause.lstrip("^"), card.splitlines()[0]), (case, card)
                assert "\x1b" not in card and "in user code" not in card, (case, card)
            if case == "in_a_worker":  # the worker's frame in the cell, with its line
                assert 'File "<%%replicate cell>", line 7, in step_fn' in error["evalue"], error["evalue"]
                assert "learning_rat * loss" in error["evalue"]
        # Functions defined in a cell and handed to repl.train travel by value (cloudpickle): the
        # worker's frame is still named by the cell it came from, with the cell's line.
        defined = (
            "import tensorflow as tf\nimport workbench as wb\n\ndef input_fn(ctx):\n"
            "    return tf.data.Dataset.from_tensor_slices(tf.zeros([64, 3])).repeat().batch(8)\n\n"
            "def step_fn(x):\n    return {'loss': tf.reduce_mean(x * undefined_scale)}\n"
        )
        reply = shell_reply(kc, kc.execute(defined), 120, "the functions' cell")["content"]
        assert reply["status"] == "ok", reply
        error = _fail(
            kc, "wb.MultiWorkerReplicator(num_workers=2).train(step_fn=step_fn, input_fn=input_fn, steps=3)"
        )
        cell = rf"Cell In\[{reply['execution_count']}\], line 8, in step_fn\n +return {{'loss': tf.reduce_mean\(x \* undefined_scale\)}}"
        assert re.search(cell, error["evalue"]), error["evalue"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_workbench_run_says_the_cause_then_the_files_frames(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(MISSPELT_NAME)
    out = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", str(script), "--backend", "mirrored",
         "--replicas", "2", "--steps", "5"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("workbench run:")]
    assert said[0] == (
        "workbench run: the run failed after step 0: NameError: name 'learning_rat' is not defined"
    ), out.stderr[-2000:]
    details = out.stderr.split("--- details ---", 1)[1]
    assert f'File "{script}", line 7, in step_fn' in details and "learning_rat * loss" in details
    assert "workbench/_src" not in details, details
