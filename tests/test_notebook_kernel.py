"""A real notebook in a real kernel (nbclient, kernel python3): the magic's forms, the live
dashboard from a background thread, the panel, and a Jupyter interrupt during training."""

import base64
import queue
import re
import time

import nbformat
import pytest
from helpers import shell_reply
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient
from notebook_toy import TOY_CELL

pytestmark = pytest.mark.slow  # every test starts a Jupyter kernel and trains in it

PREAMBLE = "%load_ext workbench\nimport workbench as wb"


def code_cells(*sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


class FrontendClient(NotebookClient):
    """nbclient, also counting figure updates (Image widget values) per cell, as a frontend sees them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.figure_updates: dict[int, int] = {}

    def handle_comm_msg(self, outs, msg, cell_index):
        paths = msg["content"]["data"].get("buffer_paths") or []
        if msg["msg_type"] == "comm_msg" and ["value"] in paths:
            self.figure_updates[cell_index] = self.figure_updates.get(cell_index, 0) + 1
        return super().handle_comm_msg(outs, msg, cell_index)


def outputs(cell, output_type):
    return [o for o in cell.outputs if o.output_type == output_type]


def test_cell_form_line_form_background_and_panel_in_a_kernel(tmp_path, monkeypatch, child_tmpdir):
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs"))
    nb = code_cells(
        PREAMBLE,
        "%replicate --backend mirrored --replicas 2",
        "%%replicate --steps 120\n" + TOY_CELL,
        "run = _\nassert run.status == 'finished' and run.steps == 120, run\n"
        "assert isinstance(w, tf.distribute.DistributedValues)  # built in repl.context()",
        "run2 = %replicate step_fn input_fn --steps 30\nassert run2.history['step'].tolist() == list(range(1, 31))\nassert run2.history['global_step'].tolist() == list(range(121, 151))",
        "bg = %replicate step_fn input_fn --steps 10000000 --background",
        "import time\nt0 = time.time()\nwhile bg.steps < 200 and time.time() - t0 < 60: time.sleep(0.1)\n"
        "time.sleep(1.5)  # the dashboard redraws from its own thread meanwhile\nbg.stop().wait(30)\nprint(bg.status)",
        "p = wb.ui.panel()\np.steps = 20\nprun = p.start()\nprun.wait(60)\nprint(prun.status, p.magic_line)",
        "print(wb.runs()[['status', 'steps']].to_dict('list'))",
    )
    client = FrontendClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    cells = nb.cells
    # The cell form: the live dashboard became a static PNG in place, then the Run.
    (figure,) = outputs(cells[2], "display_data")
    assert base64.b64decode(figure.data["image/png"]).startswith(b"\x89PNG")
    # the run's name (its store-unique default: backend, replicas, time), the backend not again
    assert re.match(
        r"mirrored x2 \u00b7 \d\d:\d\d \u00b7 finished \u00b7 step 120/120",
        figure.data["text/plain"],
    )
    (result,) = outputs(cells[2], "execute_result")
    assert "wb.Run" in result.data["text/html"] and "finished" in result.data["text/html"]
    assert outputs(cells[4], "display_data")[0].data["image/png"]
    # The background run's dashboard: a widget whose figure was redrawn from the renderer thread
    # while the kernel ran other cells (comm updates), replaced in place by the final PNG on Stop.
    (live,) = outputs(cells[5], "display_data")
    assert "stopped" in live.data["text/plain"] and live.data["image/png"]
    assert outputs(cells[6], "stream")[0].text.strip() == "stopped"
    assert client.figure_updates.get(6, 0) >= 1, client.figure_updates  # redrawn while cell 6 ran
    assert (
        "finished %replicate step_fn input_fn --backend mirrored --replicas 2 --steps 20 --background"
        in cells[7].outputs[-1].text
    )
    table = outputs(cells[8], "stream")[0].text
    assert (
        "'status': ['finished', 'finished', 'stopped', 'finished']" in table and "'steps': [120, 30" in table
    )
    assert (tmp_path / "runs").is_dir() and len(list((tmp_path / "runs").glob("*/dashboard.png"))) == 4


def _execute(kc, code, timeout=120):
    """Runs code in the kernel; returns (reply status, stdout text)."""
    msg_id = kc.execute(code)
    reply = shell_reply(kc, msg_id, timeout, f"{code[:60]!r}...")
    return reply["content"]["status"], _drain_stdout(kc, msg_id)


def _drain_stdout(kc, msg_id, timeout=30):
    text = ""
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            text += msg["content"]["text"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return text


def test_a_jupyter_interrupt_stops_the_run_at_a_step_boundary(tmp_path, monkeypatch, child_tmpdir):
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs"))
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        setup = (
            PREAMBLE
            + "\n%replicate --backend mirrored --replicas 2\n"
            + "from workbench._src.sinks import _default_factories as SINK_FACTORIES\n"
            + "SINK_FACTORIES.append(lambda run: lambda e: print('TRAINING', flush=True) if e.kind == 'metrics' and e.step >= 20 and not hasattr(run, '_told') and not setattr(run, '_told', 1) else None)\n"
            + "repl = wb.current()\nwith repl.context():\n    exec("
            + repr(TOY_CELL)
            + ")"
        )
        assert _execute(kc, setup)[0] == "ok"
        msg_id = kc.execute("r = %replicate step_fn input_fn --steps 100000000 --no-live")
        deadline = time.time() + 120
        while True:  # wait until training is under way, then interrupt as Jupyter's stop button does
            try:
                msg = kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                msg = None
            assert time.time() < deadline, "training never started"
            if msg and msg["msg_type"] == "stream" and "TRAINING" in msg["content"]["text"]:
                break
        km.interrupt_kernel()
        reply = shell_reply(kc, msg_id, 60, "the interrupted cell")
        assert reply["content"]["status"] == "ok"  # no KeyboardInterrupt traceback: a clean stop
        _drain_stdout(kc, msg_id)
        status, out = _execute(
            kc, "print(r.status, r.steps, wb.load_run(r.id).status, r.stop_reason.split()[0], 6 * 7)"
        )
        run_status, steps, recorded, why, answer = out.split()
        # A Jupyter interrupt ends the run as a Stop does ("stopped"); the reason says which.
        assert (status, run_status, recorded, why, answer) == (
            "ok",
            "stopped",
            "stopped",
            "interrupted",
            "42",
        )
        assert 20 <= int(steps) < 100000000
        # The kernel is usable and trains again.
        status, out = _execute(kc, "r2 = %replicate step_fn input_fn --steps 5 --no-live\nprint(r2)")
        assert status == "ok" and "finished steps=5" in out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_async_ps_leaves_the_kernel_clean(tmp_path, monkeypatch, child_tmpdir):
    """An async-ps run from a notebook, then plain TensorFlow and a mirrored run in the same kernel:
    the kernel never joined the cluster, so none of these cells prints an error-level line."""
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs"))
    nb = code_cells(
        PREAMBLE + "\nimport tensorflow as tf\nbefore = tf.Variable(3.0)  # made before the async-ps run",
        "%%replicate --backend async-ps --workers 2 --ps 1 --steps 60 --no-live\n" + TOY_CELL,
        "run = _\nprint(run.status, run.steps, run.executed_steps >= 60, float(tf.reduce_sum(w)) != 0.0)",
        "x = tf.constant([1.0, 2.0])\nprint(float(tf.reduce_sum(x) + before), x.device)",
        "%%replicate --backend mirrored --replicas 2 --steps 20 --no-live\n" + TOY_CELL,
        "print(_.status, _.steps)",
    )
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    cells = nb.cells
    assert outputs(cells[2], "stream")[0].text.split() == ["finished", "60", "True", "True"]
    text, device = outputs(cells[3], "stream")[0].text.split()
    assert text == "6.0" and "/job:localhost/" in device  # not renamed to 'chief'
    assert outputs(cells[5], "stream")[0].text.split() == ["finished", "20"]
    for index, cell in enumerate(cells[1:], start=1):
        noisy = [o for o in cell.outputs if o.output_type == "error" or getattr(o, "name", "") == "stderr"]
        assert not noisy, f"cell {index} printed: {noisy}"
