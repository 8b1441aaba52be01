"""The JupyterLab extension: its TypeScript unit tests, its installation, and a real browser.

The browser test starts JupyterLab on 127.0.0.1 with a token, drives it with headless Chromium
(Debian's `chromium`, through Playwright without a downloaded browser), runs a background
`%%replicate` cell, reads the sidebar and the status bar while it trains, clicks Stop, then stops
a foreground run with the toolbar's Stop (a kernel interrupt) and inserts the template cell; at
the end a run on a worker process leaves its warm pool, listed in the sidebar until its Shut down.
Screenshots go to build/lab-extension/. Every process it starts is ended in `finally`.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from helpers import PROCESS_CELL, LabFrontend, cluster_processes, wait_for
from notebook_toy import TOY_CELL

# (a Jupyter server's port, bound seconds later: outside the kernel's ephemeral range, where no
# other socket's own end lands meanwhile)
from workbench._src.placements.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
EXTENSION = ROOT / "extensions" / "replicator-workbench"
SCREENSHOTS = ROOT / "build" / "lab-extension"
CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 300_000  # what each wait is for happens; this bounds only how long a broken test hangs (at load 40 a kernel took >90 s to import TensorFlow)


@pytest.mark.slow
def test_typescript_unit_tests_pass():
    """`jlpm test`: the extension's pure logic (src/model.ts, src/series.ts, src/templates.ts) under node --test."""
    jlpm = shutil.which("jlpm")
    assert jlpm, "jlpm (JupyterLab's yarn) is missing: pip install jupyterlab"
    if not (EXTENSION / "node_modules").is_dir():  # `pip install` builds the extension and installs them
        subprocess.run([jlpm, "install"], cwd=EXTENSION, check=True, timeout=600)
    done = subprocess.run([jlpm, "test"], cwd=EXTENSION, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"^# fail 0$", done.stdout, re.M) and re.search(r"^# pass [1-9]", done.stdout, re.M)


def test_pip_install_enabled_the_extension():
    done = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True, timeout=120
    )
    listing = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # drop colour codes
    assert re.search(r"replicator-workbench v\S+ enabled OK \(python, replicator-workbench\)", listing), (
        listing
    )


def _run0(data: dict) -> dict:
    runs = data.get("runs") or [{}]
    return runs[0]


@pytest.mark.slow
def test_kernel_helper_pushes_rate_limited_snapshots_and_stops_a_background_run(
    tmp_path, monkeypatch, child_tmpdir
):
    """The comm protocol of workbench/_src/notebook/labcomm.py in a real kernel, as the sidebar uses
    it: snapshots, Stop, the figure, the run store's rows (hparams) and the compare reply's series."""
    from jupyter_client.manager import start_new_kernel

    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs"))
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        # No helper loaded: the kernel closes the comm (the sidebar then says how to load it).
        early = LabFrontend(kc)
        early.open()
        early.read(lambda kind, data: kind == "comm_close")
        # %load_ext opens a comm from the kernel with a snapshot; choosing a replicator pushes one.
        kc.execute("%load_ext workbench\n%replicate --backend mirrored --replicas 2")
        pushed = LabFrontend(kc, opened_by_kernel=True)
        (opened,) = pushed.read(lambda kind, data: kind == "comm_open")
        assert opened[2]["type"] == "snapshot" and opened[2]["devices"]["virtual_cpus"] == 8
        pushed.read(lambda kind, data: (data.get("replicator") or {}).get("num_replicas") == 2)
        # A sidebar connecting later gets the snapshot as the answer to its open.
        sidebar = LabFrontend(kc)
        sidebar.open()
        ((_, _, hello),) = sidebar.read(lambda kind, data: data.get("type") == "snapshot")
        assert (hello["replicator"]["backend"], hello["replicator"]["num_replicas"]) == ("mirrored", 2)
        assert hello["runs"] == []

        # A background run: live snapshots, at most 4 a second however fast it trains.
        kc.execute("%%replicate --steps 100000000 --background --no-live\n" + TOY_CELL)
        sidebar.read(lambda kind, data: _run0(data).get("steps_per_sec"))
        window = sidebar.read(None, timeout=4.0)
        runs = [_run0(data) for _, _, data in window]
        assert all(r["status"] == "running" and r["foreground"] is False for r in runs), runs[-1]
        steps = [r["step"] for r in runs]
        assert 4 <= len(runs) <= 4 * 4 + 1 and steps == sorted(steps) and steps[-1] > steps[0], steps
        assert runs[-1]["steps_per_sec"] > 0 and runs[-1]["loss"] is not None
        assert runs[-1]["target_step"] == 100000000 and runs[-1]["backend"] == "mirrored"
        # The figures of workbench/_src/core/run_stats.py: examples/s = steps/s x 16 (the toy's batch);
        # the ETA from the same steps/s.
        last = runs[-1]
        assert last["examples_per_sec"] == pytest.approx(last["steps_per_sec"] * 16, rel=1e-2), last
        assert last["eta_seconds"] == pytest.approx((1e8 - last["step"]) / last["steps_per_sec"], rel=1e-2)

        # Stop over the comm (the sidebar's Stop for a background run), then the run's figure.
        run_id = runs[-1]["id"]
        sidebar.send({"type": "stop", "run_id": run_id})
        ((_, _, ended),) = sidebar.read(lambda kind, data: _run0(data).get("status") == "stopped")[-1:]
        # "stopped at step N" says nothing the status and the step do not: not repeated.
        assert _run0(ended)["stop_requested"] and _run0(ended)["reason"] is None
        sidebar.send({"type": "figure"})
        ((_, _, figure),) = sidebar.read(lambda kind, data: data.get("type") == "figure")[-1:]
        assert figure["run_id"] == run_id and base64.b64decode(figure["png"]).startswith(b"\x89PNG")
        sidebar.send({"type": "stop"})  # nothing runs now: said so
        sidebar.read(lambda kind, data: data.get("type") == "error" and "nothing to stop" in data["text"])

        # The run store's table and the compare view's data: a run's hparams in its row; the
        # compare reply carries each run's series under its store name, thinned to <= 2,000 points.
        kc.execute(
            "import workbench as wb\n"
            'wb.current().train(step_fn, input_fn, steps=30, name="sweep", hparams={"lr": 0.1, "opt": "sgd"})'
        )
        sidebar.read(
            lambda kind, data: _run0(data).get("name") == "sweep" and _run0(data)["status"] == "finished"
        )
        sidebar.send({"type": "runs"})
        ((_, _, table),) = sidebar.read(lambda kind, data: data.get("type") == "runs")[-1:]
        rows = {r["name"]: r for r in table["rows"]}
        assert rows["sweep"]["hparams"] == {"lr": 0.1, "opt": "sgd"}, rows["sweep"]
        stopped = next(r for r in table["rows"] if r["id"] == run_id)
        assert stopped["hparams"] is None and stopped["steps"] > 30
        sidebar.send({"type": "compare", "run_ids": [run_id, rows["sweep"]["id"]]})
        ((_, _, reply),) = sidebar.read(lambda kind, data: data.get("type") == "compare", timeout=120)[-1:]
        long, short = reply["series"]
        assert (long["id"], long["name"], short["name"]) == (run_id, stopped["name"], "sweep")
        assert (
            short["step"] == list(range(1, 31)) and len(short["loss"]) == len(short["examples_per_sec"]) == 30
        )
        assert all(isinstance(v, float) for v in short["loss"])  # NaN would be null (None here)
        assert len(long["step"]) == min(stopped["steps"], 2000) and long["step"][-1] == stopped["steps"]
        assert len(long["loss"]) == len(long["examples_per_sec"]) == len(long["step"])
        assert [r["name"] for r in reply["rows"]] == [stopped["name"], "sweep"]
        assert base64.b64decode(reply["png"]).startswith(b"\x89PNG")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _require_browser():
    """The browser test needs Chromium and Playwright; missing ones fail it, saying how to install."""
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"The JupyterLab browser test needs Debian's Chromium at {CHROMIUM}; it is not there. "
            "Fix: `apt-get install -y chromium` (as .ci/run does), or set WORKBENCH_CHROMIUM to a "
            "Chromium binary.",
            pytrace=False,
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail(
            "The JupyterLab browser test needs Playwright (driving the system Chromium). Fix: "
            'PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 pip install -e ".[test]"',
            pytrace=False,
        )


def _children(pid: int) -> list[int]:
    """Direct children of pid (Linux /proc): the server's kernels run in sessions of their own."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _write_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext workbench"),
        nbformat.v4.new_code_cell(
            "%%replicate --backend mirrored --replicas 2 --steps 100000000 --background --name bg\n"
            + TOY_CELL.strip()
        ),
        nbformat.v4.new_code_cell("fg = %replicate step_fn input_fn --steps 100000000 --no-live --name fg"),
        # Two finished runs of the same model (the second starts at the program's step 3001),
        # each ending with its summary: compared from the sidebar, figures checked against it.
        nbformat.v4.new_code_cell("first = %replicate step_fn input_fn --steps 3000\nfirst"),
        nbformat.v4.new_code_cell("second = %replicate step_fn input_fn --steps 2000 --no-live\nsecond"),
        nbformat.v4.new_code_cell(SCALING_CELL),
        # A run on one worker process: its warm pool stays up after it (workbench/_src/launch/pool.py).
        nbformat.v4.new_code_cell(
            "%%replicate --backend multi-worker --workers 1 --steps 20 --no-live --name pooled\n"
            + PROCESS_CELL.strip()
        ),
    ]
    nbformat.write(nb, path)


def _start_lab(root: Path, port: int, token: str) -> subprocess.Popen:
    config = root / ".jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    # No news pop-up over the status bar, no update check (there is no network to ask).
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    # The server's kernels write their temp files (AutoGraph's) in the test's folder: the ones that
    # outlive the server are killed below, which skips TensorFlow's clean-up of them. Not the
    # child_tmpdir fixture: Playwright's Chromium would inherit it, and its socket path under the
    # test's folder is too long for it to start.
    kernel_tmp = root / "kernel-tmp"
    kernel_tmp.mkdir()
    env = dict(
        os.environ,
        TMPDIR=str(kernel_tmp),
        JUPYTER_CONFIG_DIR=str(config),
        JUPYTERLAB_SETTINGS_DIR=str(root / ".lab-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(root / ".lab-workspaces"),
        WORKBENCH_RUNS_DIR=str(root / "runs"),
        WORKBENCH_NOTIFY_AFTER="1",  # a run of a second or more that ends unseen is announced
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    log = open(root / "jupyterlab.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}",
            "--allow-root",
            *_own_build(root),
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _own_build(root: Path) -> list[str]:
    """The extension this checkout built (`jlpm build:prod` in extensions/replicator-workbench),
    put first on JupyterLab's extension path: the browser sees this checkout's TypeScript, not
    the copy an earlier `pip install` left in the environment (JupyterLab takes an extension
    from the first folder that has it, and serves its files from <folder>/<its name>/). Without
    a build of its own, the installed one."""
    built = EXTENSION / "labextension"
    if not (built / "package.json").is_file():
        return []
    folder = root / "labextensions"
    folder.mkdir()
    (folder / "replicator-workbench").symlink_to(built, target_is_directory=True)
    return [f"--LabApp.extra_labextensions_path={folder}"]


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"JupyterLab exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"JupyterLab did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


def _step(run_row) -> int:
    """The step a sidebar run row shows ("step 1,588 / 100,000,000" -> 1588)."""
    text = run_row.locator(".wb-run-step").first.inner_text()
    return int(re.search(r"step ([\d,]+)", text).group(1).replace(",", ""))


def _step_after(run_row, step: int) -> int:
    """The step the row shows once it is past `step` (live: it grows while the kernel is idle).
    Polled, up to WAIT_MS: at load 25 a step of the toy cell took 8 s."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while (now := _step(run_row)) <= step and time.monotonic() < deadline:
        run_row.page.wait_for_timeout(250)
    return now


def _run_cell(page, index: int, notebook: str | None = None) -> None:
    """Selects cell `index` (command mode) and runs it with Shift+Enter, as a person does; makes
    sure it started ([*] or its count in the prompt). A page still settling (just opened, a side
    panel just toggled) can swallow the first key press: then it is pressed again, as a person
    would, at most three times. `notebook` (a tab's name): that notebook's cell, its tab clicked
    first; a reloaded page restores its workspace's notebooks and can make another one current
    after the URL's, and the visible cells are then that one's."""
    from playwright.sync_api import expect

    for _ in range(3):
        if notebook is None:
            cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell").nth(index)
        else:
            _make_current(page, notebook)
            cell = _cells(page, notebook).nth(index)
        prompt = cell.locator(".jp-InputPrompt").first
        prompt.click()
        page.keyboard.press("Shift+Enter")
        try:
            expect(prompt).to_have_text(re.compile(r"\[(\*|\d+)\]"), timeout=30_000)
            return
        except AssertionError:
            continue
    raise AssertionError(f"cell {index} did not start after three Shift+Enter presses")


def _notebook_tab(page, notebook: str):
    return page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=notebook)


def _cells(page, notebook: str):
    """The cells of the notebook whose tab is named `notebook` (its panel, by the tab's data-id),
    whether or not it is the one shown."""
    panel_id = _notebook_tab(page, notebook).get_attribute("data-id")
    return page.locator(f"[id='{panel_id}'] .jp-Notebook .jp-Cell")


def _make_current(page, notebook: str) -> None:
    """Clicks the notebook's tab and waits until it is the current one (the sidebar follows it)."""
    from playwright.sync_api import expect

    tab = _notebook_tab(page, notebook)
    tab.click()
    expect(tab).to_have_class(re.compile(r"\blm-mod-current\b"))


def _wait_for_idle_kernel(page) -> None:
    """The opened notebook's kernel has started and is idle (the status bar says so): key presses
    sent before that can be lost."""
    from playwright.sync_api import expect

    expect(page.get_by_text(re.compile(r"\(ipykernel\) \| Idle")).first).to_be_visible()


@contextlib.contextmanager
def _explained(page, root: Path, name: str):
    """On a failed step, says what the page showed: a screenshot (build/lab-extension/NAME-failure.png),
    the visible notebook's prompts and outputs, the sidebar's text, the status bar and the end of
    JupyterLab's log. A CI failure is then read, not guessed."""
    try:
        yield
    except Exception as failure:
        lines = [f"{type(failure).__name__}: {failure}", "", "--- what the page showed ---"]
        try:
            page.screenshot(path=str(SCREENSHOTS / f"{name}-failure.png"))
            cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
            for i in range(cells.count()):
                cell = cells.nth(i)
                prompt = cell.locator(".jp-InputPrompt").first.inner_text(timeout=2000)
                outputs = cell.locator(".jp-OutputArea-output")
                text = " | ".join(
                    outputs.nth(j).inner_text(timeout=2000)[-300:] for j in range(outputs.count())
                )
                lines.append(f"cell {i} {prompt.strip()} outputs: {text!r}")
            lines.append(f"sidebar: {page.locator('.wb-sidebar').inner_text(timeout=2000)[-800:]!r}")
            lines.append(
                f"sidebar state: {page.locator('.wb-sidebar').get_attribute('data-state', timeout=2000)}"
            )
            lines.append(f"status bar: {page.locator('.jp-StatusBar-Widget').inner_text(timeout=2000)!r}")
        except Exception as also:  # noqa: BLE001 - the page itself may be gone
            lines.append(f"(the page could not be read: {also})")
        log = root / "jupyterlab.log"
        if log.is_file():
            lines += ["--- end of jupyterlab.log ---", *log.read_text(errors="replace").splitlines()[-40:]]
        raise AssertionError("\n".join(lines)) from failure


SCALING_CELL = """%%replicate --scaling 1,2 --batch-size 16 --steps 40 --warmup 6 --no-live
import tensorflow as tf, keras
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
opt = repl.wrap_optimizer(keras.optimizers.SGD(0.05))

def input_fn(ctx):
    x = tf.random.stateless_normal([256, 4], seed=[1, 2])
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ctx.global_batch_size)

def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return {"loss": loss}"""


def _summary_figure(cell, key: str) -> str:
    """A figure as wb.Run._repr_html_ shows it in the cell's output (its table row `key`)."""
    return cell.locator(f".jp-OutputArea-output tr:has(th:text-is('{key}')) td").first.inner_text().strip()


def _finished_runs_agree_and_compare(page, sidebar, status, tmp_path: Path) -> None:
    """Two finished runs: the summary, the sidebar and the status bar show the same figures (to
    the digit shown); the sidebar compares them and exports a run's history as CSV."""
    from playwright.sync_api import expect

    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
    summaries = {}
    for index, source in ((3, "first = %replicate"), (4, "second = %replicate")):
        cell = cells.filter(has_text=source)  # the template cell inserted above moved them down
        cell.locator(".jp-InputPrompt").click()
        page.keyboard.press("Shift+Enter")
        if index == 3:
            # Look at another tab while it trains: its end is announced (a JupyterLab notification).
            page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="fg dashboard").click()
            expect(
                page.get_by_text(re.compile(r"Replicator Workbench: mirrored x2 .* finished"))
            ).to_be_visible()
            page.screenshot(path=str(SCREENSHOTS / "notification.png"))
            page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="replicate.ipynb").click()
        expect(cell.locator(".jp-OutputArea-output tr:has(th:text-is('status')) td")).to_have_text("finished")
        summaries[index] = {
            key: _summary_figure(cell, key) for key in ("run", "steps", "steps_per_sec", "examples_per_sec")
        }
        if index == 3:  # the live dashboard's final figure and title, under the summary
            expect(cell.locator(".jp-OutputArea-output img").first).to_be_visible()
            cell.scroll_into_view_if_needed()
            page.screenshot(path=str(SCREENSHOTS / "dashboard-in-notebook.png"))
    first, second = summaries[3], summaries[4]
    assert (first["steps"], second["steps"]) == ("3000", "2000"), (first, second)  # counted per run

    # The sidebar's card of each run shows the summary's figures; the status bar the last run's.
    for figures in (first, second):
        card = sidebar.locator(f".wb-run[data-run-id='{figures['run']}']")
        steps = f"{int(figures['steps']):,}"
        expect(card.locator(".wb-run-step")).to_have_text(f"step {steps} / {steps}")
        expect(card.locator(".wb-run-rate")).to_have_text(f"{figures['steps_per_sec']} steps/s")
        expect(card.locator(".wb-run-throughput")).to_have_text(f"{figures['examples_per_sec']} examples/s")
    expect(status).to_have_text(re.compile(rf": {re.escape(second['steps_per_sec'])} steps/s$"))

    # The run store's table (its tab): pick both, Compare: one figure, one table, same figures.
    sidebar.locator(".wb-tab-store").click()
    table = sidebar.locator(".wb-runs-table")
    for figures in (first, second):
        table.locator(f".wb-stored-run[data-run-id='{figures['run']}'] .wb-pick-run").check()
    compare = sidebar.locator(".wb-compare")
    expect(compare).to_have_text("Compare (2)")
    compare.click()
    view = page.locator(".wb-compare-view")
    expect(view.locator(".wb-chart-loss canvas")).to_be_visible()  # the interactive chart
    expect(view.locator(".wb-compare-png img")).to_be_attached()  # and the PNG, folded under it
    assert view.locator(".wb-compare-png img").evaluate("img => img.naturalWidth") > 400
    for figures in (first, second):
        row = view.locator(f"tr[data-run-id='{figures['run']}']")
        expect(row.locator("td[data-key=steps_per_sec]")).to_have_text(figures["steps_per_sec"])
        expect(row.locator("td[data-key=examples_per_sec]")).to_have_text(figures["examples_per_sec"])
    page.screenshot(path=str(SCREENSHOTS / "compare.png"))
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="replicate.ipynb").click()
    sidebar.locator(".wb-tab-kernel").click()

    # Export the second run's history as CSV from its card: every step, counted from 1.
    card = sidebar.locator(f".wb-run[data-run-id='{second['run']}']")
    with page.expect_download() as download:
        card.locator(".wb-export-csv").click()
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    lines = saved.read_text().splitlines()
    assert lines[0].startswith("step,wall_time,examples_per_sec") and len(lines) == 2001, lines[:2]
    assert saved.name == f"{second['run']}-history.csv"
    sidebar.scroll_into_view_if_needed()
    page.screenshot(path=str(SCREENSHOTS / "sidebar-runs-table.png"))

    # TensorBoard on the run's event files: a `%replicate --tensorboard RUN` cell, run at once
    # (without the tensorboard package it says how to install it and where the files are).
    count, empty = cells.count(), _empty_cells(cells)
    card.locator(".wb-tensorboard").click()
    cell = cells.filter(has_text=f"%replicate --tensorboard {second['run']}")
    expect(cell).to_have_count(1)
    expect(cells).to_have_count(count + 1)  # one cell, not an empty one above it too
    assert _empty_cells(cells) == empty, "the TensorBoard action left an empty cell"
    expected = "pip install tensorboard" if importlib.util.find_spec("tensorboard") is None else "tensorboard"
    expect(cell.locator(".jp-OutputArea-output")).to_contain_text(expected)
    expect(cell.locator(".jp-OutputArea-output")).to_contain_text(f"{second['run']}/tb")


def _empty_cells(cells) -> int:
    return sum(not c.locator(".jp-InputArea-editor").inner_text().strip() for c in cells.all())


@pytest.mark.slow
def test_sidebar_status_bar_and_stop_in_a_browser(tmp_path):
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)

    _write_notebook(tmp_path / "replicate.ipynb")
    port, token = free_ports(1)[0], secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    server = _start_lab(tmp_path, port, token)
    kernels: list[int] = []
    try:
        _wait_for_server(f"{base}/api/status?token={token}", server, tmp_path / "jupyterlab.log")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.set_default_timeout(WAIT_MS)
                with _explained(page, tmp_path, "sidebar"):
                    page.goto(f"{base}/lab/tree/replicate.ipynb?reset&token={token}")
                    expect(page.locator(".jp-NotebookPanel .jp-Cell")).to_have_count(7)
                    # The kernel is up, the workbench not loaded yet: the sidebar says how to load it.
                    page.locator(".wb-toolbar-sidebar").first.click()
                    sidebar = page.locator(".wb-sidebar")
                    expect(sidebar).to_have_attribute("data-state", "absent")
                    expect(sidebar).to_contain_text("%load_ext workbench")
                    kernels = _children(server.pid)

                    # %load_ext, then the background %%replicate cell.
                    _run_cell(page, 0)
                    expect(sidebar).to_have_attribute("data-state", "ready")
                    expect(sidebar.locator(".wb-devices")).to_contain_text("8 CPU devices (virtual)")
                    _run_cell(page, 1)
                    running = sidebar.locator(".wb-run[data-status=running]")
                    expect(running).to_have_count(1)
                    expect(running.locator(".wb-run-config")).to_have_text("mirrored \u00b7 2 replicas")
                    expect(sidebar.locator(".wb-replicator")).to_have_text("mirrored \u00b7 2 replicas")
                    status = page.locator(".wb-status")
                    expect(status).to_have_text(
                        re.compile(r"^Replicator: mirrored \u00b7 2 replicas \u00b7 [\d,.]+ steps/s$")
                    )
                    # Live: the step count grows while the kernel is idle (the run is in a thread).
                    first = _step(running)
                    second = _step_after(running, first)
                    assert second > first > 0, (first, second)
                    expect(running.locator(".wb-run-loss")).to_have_text(re.compile(r"^loss \d"))
                    expect(running.locator(".wb-run-throughput")).to_have_text(
                        re.compile(r"[\d,.]+ examples/s$")
                    )
                    expect(running.locator(".wb-run-eta")).to_have_text(re.compile(r"^ETA \d+ (h|min|s)"))
                    page.screenshot(path=str(SCREENSHOTS / "sidebar-running.png"))
                    # The live dashboard under the background cell: its Stop button is not cut short
                    # ("S..."), its figure draws (no broken-image icon before).
                    dashboard = (
                        page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea-output .widget-vbox").first
                    )
                    stop_button = dashboard.locator(".widget-button", has_text="Stop")
                    expect(stop_button).to_be_visible()
                    assert stop_button.evaluate("b => b.scrollWidth <= b.clientWidth"), (
                        "the Stop label is cut"
                    )
                    expect(dashboard.locator("img")).to_be_visible()
                    dashboard.scroll_into_view_if_needed()
                    page.screenshot(path=str(SCREENSHOTS / "dashboard-running.png"))

                    # Stop (a background run: a comm message to the kernel).
                    running.locator(".wb-stop").click()
                    stopped = sidebar.locator(".wb-run[data-status=stopped]")
                    expect(stopped).to_have_count(1)
                    # No run trains: the session's replicator and the last run's steps/s.
                    expect(status).to_have_text(
                        re.compile(r"^Replicator: mirrored \u00b7 2 replicas \u00b7 bg: [\d,.]+ steps/s$")
                    )
                    assert _step(stopped) >= second
                    (record,) = (tmp_path / "runs").glob("*/config.json")
                    assert json.loads(record.read_text())["status"] == "stopped"  # the kernel's own record

                    # The stopped run's dashboard figure opens in the main area.
                    stopped.locator(".wb-figure").click()
                    image = page.locator(".wb-figure-view img")
                    expect(image).to_be_visible()
                    assert image.evaluate("img => img.naturalWidth") > 100
                    page.screenshot(path=str(SCREENSHOTS / "dashboard-figure.png"))
                    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="replicate.ipynb").click()

                    # A foreground run holds the kernel: the toolbar's Stop interrupts it, cleanly.
                    _run_cell(page, 2)
                    expect(running).to_have_count(1)
                    expect(status).to_have_text(re.compile(r"[\d,.]+ steps/s$"))
                    page.locator(".wb-toolbar-stop").first.click()
                    expect(running).to_have_count(0)
                    expect(sidebar.locator(".wb-run[data-status=stopped]")).to_have_count(
                        2
                    )  # one word for a stop

                    # The template command inserts a %%replicate cell with input_fn and step_fn.
                    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
                    before = cells.count()
                    page.locator(".wb-toolbar-insert").first.click()
                    expect(cells).to_have_count(before + 1)
                    inserted = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell.jp-mod-active")
                    expect(inserted).to_contain_text(
                        "%%replicate --steps 300"
                    )  # the session has a replicator
                    expect(inserted).to_contain_text("def step_fn(x, y):")
                    page.screenshot(path=str(SCREENSHOTS / "sidebar-stopped.png"))

                    # The palette has the commands: open the last run's (run 2's) figure from it.
                    page.keyboard.press("Control+Shift+C")
                    page.locator(".lm-CommandPalette-input").fill("Replicator Workbench")
                    items = page.locator(".lm-CommandPalette-item")
                    expect(items.filter(has_text="Insert input_fn/step_fn Template Cell")).to_have_count(1)
                    expect(items.filter(has_text="Stop the Running Run")).to_have_count(1)
                    expect(items.filter(has_text="Open the Replicator Sidebar")).to_have_count(1)
                    items.filter(has_text="Dashboard Figure").click()
                    expect(page.locator(".lm-TabBar-tab", has_text="fg dashboard")).to_have_count(1)
                    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="replicate.ipynb").click()

                    _finished_runs_agree_and_compare(page, sidebar, status, tmp_path)

                    # A scaling study: one group in the sidebar, one line per configuration (the
                    # warm-up runs hidden), each with its steps/s and examples/s.
                    cell = page.locator(
                        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell", has_text="--scaling 1,2"
                    )
                    cell.locator(".jp-InputPrompt").click()
                    page.keyboard.press("Shift+Enter")
                    study = sidebar.locator(".wb-study")
                    expect(study.locator(".wb-section-title")).to_have_text(
                        re.compile(r"^Scaling study \u00b7 weak \u00b7 mirrored \u00b7 \d\d:\d\d:\d\d$")
                    )
                    expect(study.locator(".wb-study-line")).to_have_count(2)
                    for line in study.locator(".wb-study-line").all():
                        expect(line.locator(".wb-run-rate")).to_have_text(re.compile(r"^[\d,.]+ steps/s$"))
                        expect(line.locator(".wb-run-throughput")).to_have_text(
                            re.compile(r"^[\d,.]+ examples/s$")
                        )
                        expect(line.locator(".wb-run-median")).to_have_text(
                            re.compile(r"^median compiled step [\d,.]+ examples/s$")
                        )
                    warmups = sidebar.locator(".wb-run", has_text="warm-up")
                    assert warmups.count() == 0, warmups.all_inner_texts()
                    study.scroll_into_view_if_needed()
                    page.screenshot(path=str(SCREENSHOTS / "sidebar-study.png"))

                    # The run store table: sort by examples/s (descending first), filter, delete.
                    sidebar.locator(".wb-tab-store").click()
                    rows = sidebar.locator(".wb-stored-run")
                    expect(rows).to_have_count(6)  # 4 runs and 2 study configurations (warm-ups: unrecorded)
                    steps = rows.locator(".wb-col-steps").all_inner_texts()
                    assert all(re.fullmatch(r"[\d,]+", t) for t in steps), steps  # integers: "40", not "40.0"
                    sidebar.locator(".wb-sort-examples_per_sec").click()
                    shown = [
                        float(t.replace(",", ""))
                        for t in rows.locator(".wb-col-examples_per_sec").all_inner_texts()
                        if t != "\u2013"
                    ]
                    assert shown == sorted(shown, reverse=True), shown
                    sidebar.locator(".wb-filter-backend").select_option("mirrored")
                    expect(rows).to_have_count(6)
                    picked = sidebar.locator(".wb-pick-run:checked")  # the two compared above
                    for left in (1, 0):  # a click redraws the table: click, then count again
                        picked.first.click()
                        expect(picked).to_have_count(left)
                    first_id = rows.first.get_attribute("data-run-id")
                    first_name = rows.first.locator(".wb-stored-name").inner_text()
                    rows.first.locator(".wb-pick-run").check()
                    sidebar.locator(".wb-delete").click()
                    expect(page.locator(".jp-Dialog")).to_contain_text("Delete 1 recorded run?")
                    expect(page.locator(".jp-Dialog .wb-delete-list")).to_contain_text(first_name)
                    page.locator(".jp-Dialog button", has_text="Delete").click()
                    expect(rows).to_have_count(5)
                    assert not (tmp_path / "runs" / first_id).exists()

                    # A run on a worker process keeps it up (a warm pool): the sidebar lists the
                    # pool while it is idle, and its Shut down ends the process.
                    sidebar.locator(".wb-tab-kernel").click()
                    _make_current(page, "replicate.ipynb")
                    cell = _cells(page, "replicate.ipynb").filter(has_text="--backend multi-worker")
                    cell.locator(".jp-InputPrompt").click()
                    page.keyboard.press("Shift+Enter")
                    pooled = sidebar.locator(".wb-run[data-status=finished]", has_text="pooled")
                    expect(pooled).to_have_count(1)
                    pool = sidebar.locator(".wb-pools .wb-pool")
                    expect(pool).to_have_count(1)
                    expect(pool).to_have_attribute("data-state", "idle")
                    expect(pool.locator(".wb-pool-text")).to_have_text(
                        re.compile(
                            r"^multi-worker \u00b7 1 worker \u00b7 1 process \u00b7 idle (< 1|\d+) min "
                            r"\(ends after 10 min idle\)$"
                        )
                    )
                    workers = [line for line in cluster_processes() if "worker_main" in line]
                    assert len(workers) == 1, workers  # the pool's process, the kernel's child
                    sidebar.locator(".wb-pools").scroll_into_view_if_needed()
                    page.screenshot(path=str(SCREENSHOTS / "sidebar-pools.png"))
                    sidebar.locator(".wb-shutdown-pools").click()
                    expect(sidebar.locator(".wb-pools")).to_have_count(0)
                    wait_for(lambda: not cluster_processes(), 10, "the pool's process to end")
            finally:
                browser.close()
    finally:
        kernels = sorted(set(kernels) | set(_children(server.pid)))
        server.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        _kill(kernels)  # whatever outlived the server


def test_scaling_study_runs_form_one_group_in_the_sidebar():
    from workbench._src.studies.scaling import study_group

    assert study_group("scaling weak n=4") == ("scaling weak", False)
    assert study_group("scaling strong n=2 warm-up") == ("scaling strong", True)
    assert study_group("run 3") == (None, False)
    assert study_group("warm-up") == (None, True)  # what repl.train(warmup=N) names its warm-up run
    # Issue 23: two studies of one mode never merge (backend and start time in the group).
    assert study_group("scaling weak n=2 \u00b7 mirrored \u00b7 14:02:33") == (
        "scaling weak \u00b7 mirrored \u00b7 14:02:33",
        False,
    )
    assert study_group("scaling weak n=2 \u00b7 mirrored \u00b7 14:02:33 (2)")[0] == (
        "scaling weak \u00b7 mirrored \u00b7 14:02:33"
    )


def _write_identity_notebooks(root: Path) -> None:
    """a.ipynb and b.ipynb: two kernels that record into one run store under the same name (and
    b a short run with hparams)."""
    build = "%%replicate --backend mirrored --replicas 2 --steps 300 --name shared\n" + TOY_CELL.strip()
    for name, cells in (
        (
            "a.ipynb",
            [
                "%load_ext workbench",
                build,
                "%replicate step_fn input_fn --steps 8000 --background --no-live --name long",
                "%replicate step_fn input_fn --steps 300 --name dark",
            ],
        ),
        (
            "b.ipynb",
            [
                "%load_ext workbench",
                build,
                # A run with hparams (train's hparams=): shown and found in the run store's table.
                "import workbench as wb\n"
                'wb.current().train(step_fn, input_fn, steps=20, name="sweep", hparams={"lr": 0.1, "batch": 16})',
            ],
        ),
    ):
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
        nbformat.write(nb, root / name)


def _image_brightness(png: bytes) -> float:
    """Mean grey level (0 black .. 255 white) of a screenshot."""
    import io

    import numpy as np
    from PIL import Image

    return float(np.asarray(Image.open(io.BytesIO(png)).convert("L")).mean())


def _shown_brightness(image, before: float) -> float:
    """The mean grey of `image` (a locator) now, or `before` when the image was being replaced
    (a theme switch draws the figure again: the element can leave the page mid-screenshot)."""
    from playwright.sync_api import Error

    try:
        return _image_brightness(image.screenshot())
    except Error as e:
        if "not attached" not in str(e):
            raise
        return before


def _compare_chart_is_interactive(page, view) -> None:
    """The compare view's chart: both runs' store names in its legends, values on hover, the
    smoothing slider redraws the lines, the loss axis switches between log and linear."""
    from playwright.sync_api import expect

    loss = view.locator(".wb-chart-loss")
    for panel in (loss, view.locator(".wb-chart-examples_per_sec")):
        expect(panel.locator("canvas")).to_be_visible()
        expect(panel.locator(".u-legend .u-series .u-label")).to_have_text(["step", "from b", "shared"])
    number = re.compile(r"^-?[\d.,]+(e[-+]?\d+)?$")
    _hover(page, loss)
    expect(loss.locator(".u-legend .u-series .u-value")).to_have_text([number, number, number])
    page.mouse.move(5, 5)
    canvas = loss.locator("canvas")
    expect(view).to_have_attribute("data-smoothing", "0.60")  # TensorBoard's default
    before = canvas.screenshot()
    view.locator(".wb-smoothing").evaluate(
        "s => { s.value = '0.95'; s.dispatchEvent(new Event('input', { bubbles: true })); }"
    )
    expect(view).to_have_attribute("data-smoothing", "0.95")
    expect(view.locator(".wb-smoothing-value")).to_have_text("0.95")
    assert canvas.screenshot() != before, "smoothing did not change the drawn lines"
    # The toy's loss falls by decades: a log axis at first; the checkbox switches it.
    expect(view).to_have_attribute("data-loss-scale", "log")
    view.locator(".wb-log-scale").uncheck()
    expect(view).to_have_attribute("data-loss-scale", "linear")
    expect(loss.locator(".u-legend .u-series .u-label")).to_have_text(["step", "from b", "shared"])
    view.locator(".wb-log-scale").check()
    expect(view).to_have_attribute("data-loss-scale", "log")
    _hover(page, loss)  # for the screenshot: the values at a step


def _hover(page, chart) -> None:
    """The pointer over a uPlot chart, 60% along its x axis."""
    box = chart.locator(".u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2)


@pytest.mark.slow
def test_runs_told_apart_renamed_tagged_compared_deleted_notified_and_dark_in_a_browser(tmp_path):
    """Issue 23 in the browser: two kernels writing to one store show distinct names; rename and
    tag from the sidebar; the compare view names the runs; delete removes the card; a long run's
    end is announced while another notebook is the active tab; on the dark theme the figure is dark."""
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    _write_identity_notebooks(tmp_path)
    port, token = free_ports(1)[0], secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    server = _start_lab(tmp_path, port, token)
    kernels: list[int] = []
    try:
        _wait_for_server(f"{base}/api/status?token={token}", server, tmp_path / "jupyterlab.log")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.set_default_timeout(WAIT_MS)
                with _explained(page, tmp_path, "identity"):

                    def tab(name):
                        return _notebook_tab(page, name)

                    # Kernel A, then kernel B: both train a run named "shared" into one store.
                    page.goto(f"{base}/lab/tree/a.ipynb?reset&token={token}")
                    expect(_cells(page, "a.ipynb")).to_have_count(4)
                    sidebar = page.locator(".wb-sidebar")
                    page.locator("li[data-id='replicator-workbench-sidebar']").click()
                    expect(sidebar).to_be_visible()
                    _wait_for_idle_kernel(page)
                    _run_cell(page, 0, "a.ipynb")
                    expect(sidebar).to_have_attribute("data-state", "ready")
                    _run_cell(page, 1, "a.ipynb")
                    expect(
                        _cells(page, "a.ipynb").nth(1).locator(".jp-OutputArea-output img").first
                    ).to_be_visible()
                    page.goto(f"{base}/lab/tree/b.ipynb?token={token}")
                    expect(_cells(page, "b.ipynb")).to_have_count(3)
                    if not sidebar.is_visible():
                        page.locator("li[data-id='replicator-workbench-sidebar']").click()
                    _make_current(page, "b.ipynb")
                    _wait_for_idle_kernel(page)
                    _run_cell(page, 0, "b.ipynb")
                    expect(sidebar).to_have_attribute("data-state", "ready")
                    _run_cell(page, 1, "b.ipynb")
                    # b's run is done when its card says so (its cell's figure is a.ipynb's check)
                    expect(sidebar.locator(".wb-run .wb-run-name")).to_have_text(
                        ["shared (2)"], timeout=180_000
                    )
                    expect(sidebar.locator(".wb-run").first).to_contain_text("finished", timeout=180_000)
                    _run_cell(page, 2, "b.ipynb")  # "sweep", with hparams
                    expect(sidebar.locator(".wb-run .wb-run-name")).to_have_text(
                        ["sweep", "shared (2)"], timeout=180_000
                    )
                    expect(sidebar.locator(".wb-run").first).to_contain_text("finished", timeout=180_000)
                    kernels = _children(server.pid)

                    # The run store tab: the runs, told apart by name; the table fits the sidebar,
                    # and no header is cut (short labels, the full name in their tooltips).
                    sidebar.locator(".wb-tab-store").click()
                    rows = sidebar.locator(".wb-stored-run")
                    expect(rows.locator(".wb-stored-name")).to_have_text(["sweep", "shared (2)", "shared"])
                    table = sidebar.locator(".wb-runs-table")
                    assert table.evaluate("t => t.scrollWidth <= t.parentElement.clientWidth + 1"), (
                        "table overflows"
                    )
                    cut = table.evaluate(
                        "t => [...t.querySelectorAll('th')].filter(h => h.scrollWidth > h.clientWidth + 1)"
                        ".map(h => h.textContent)"
                    )
                    assert cut == [], f"headers cut: {cut}"
                    assert "Steps done" in (table.locator("th.wb-sort-steps").get_attribute("title") or "")
                    # hparams: under the run's name, in its tooltip, and found by the filter.
                    sweep = rows.filter(has_text="sweep")
                    expect(sweep.locator(".wb-stored-hparams")).to_have_text("lr=0.1 batch=16")
                    assert "hparams: lr=0.1, batch=16" in (sweep.get_attribute("title") or "")
                    sidebar.locator(".wb-filter-text").fill("lr=0.1")
                    expect(rows.locator(".wb-stored-name")).to_have_text(["sweep"])
                    sidebar.locator(".wb-filter-text").fill("")
                    expect(rows).to_have_count(3)
                    page.screenshot(path=str(SCREENSHOTS / "identity-store-two-kernels.png"))

                    # Rename and tag the second from the sidebar (JupyterLab's input dialogs).
                    mine = rows.filter(has_text="shared (2)")
                    run_b = mine.get_attribute("data-run-id")
                    mine.locator(".wb-pick-run").check()
                    sidebar.locator(".wb-rename").click()
                    page.locator(".jp-Dialog input").fill("from b")
                    page.locator(".jp-Dialog .jp-mod-accept").click()
                    renamed = sidebar.locator(f".wb-stored-run[data-run-id='{run_b}']")
                    expect(renamed.locator(".wb-stored-name")).to_have_text("from b")
                    sidebar.locator(".wb-tag").click()
                    page.locator(".jp-Dialog input").fill("best, lr-sweep")
                    page.locator(".jp-Dialog .jp-mod-accept").click()
                    expect(renamed.locator(".wb-stored-details")).to_contain_text("#best #lr-sweep")
                    sidebar.locator(".wb-filter-text").fill("lr-sweep")
                    expect(rows).to_have_count(1)
                    sidebar.locator(".wb-filter-text").fill("#best")  # the tag as the row shows it
                    expect(rows).to_have_count(1)
                    sidebar.locator(".wb-filter-text").fill("")
                    page.screenshot(path=str(SCREENSHOTS / "identity-renamed-tagged.png"))

                    # Compare both: the view names them as the store does, in an interactive
                    # chart (uPlot) over the kernel's table.
                    rows.filter(has_text="shared").filter(has_not_text="from b").locator(
                        ".wb-pick-run"
                    ).check()
                    sidebar.locator(".wb-compare").click()
                    view = page.locator(".wb-compare-view")
                    _compare_chart_is_interactive(page, view)
                    expect(view.locator(f"tr[data-run-id='{run_b}'] td").first).to_have_text("from b")
                    expect(view.locator("tr[data-run-id] td:first-child")).to_have_text(
                        ["from b", "shared"]
                    )  # in the order picked
                    expect(view.locator(".wb-compare-table th")).to_contain_text(
                        ["median compiled step examples/s"]
                    )
                    expect(view.locator(".wb-compare-png img")).to_be_attached()  # the PNG, folded
                    page.screenshot(path=str(SCREENSHOTS / "identity-compare.png"))
                    tab("b.ipynb").click()

                    # Delete the renamed run: its card leaves this kernel's tab at once.
                    picked = rows.locator(".wb-pick-run:checked")
                    for left in (1, 0):  # a click redraws the table: click, then count again
                        picked.first.click()
                        expect(picked).to_have_count(left)
                    renamed.locator(".wb-pick-run").check()
                    sidebar.locator(".wb-delete").click()
                    # The dialog names the run it deletes (and only it).
                    expect(page.locator(".jp-Dialog-body")).to_contain_text("\u2022 from b")
                    assert page.locator(".jp-Dialog-body").inner_text().count("\u2022") == 1
                    page.locator(".jp-Dialog .jp-mod-warn").click()
                    expect(rows).to_have_count(2)
                    sidebar.locator(".wb-tab-kernel").click()
                    expect(sidebar.locator(f".wb-run[data-run-id='{run_b}']")).to_have_count(0)

                    # A long background run in A ends while B is the active tab: announced.
                    tab("a.ipynb").click()
                    _run_cell(page, 2, "a.ipynb")
                    expect(sidebar.locator(".wb-run[data-status=running]")).to_have_count(1)
                    tab("b.ipynb").click()
                    expect(
                        page.get_by_text(re.compile(r"Replicator Workbench: long finished"))
                    ).to_be_visible()
                    page.screenshot(path=str(SCREENSHOTS / "identity-notification-other-notebook.png"))

                    # The dark theme: the next run's figure is dark too.
                    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").click()
                    page.locator(".lm-Menu-itemLabel", has_text="Theme").first.hover()
                    page.locator(".lm-Menu-itemLabel").get_by_text("JupyterLab Dark", exact=True).click()
                    expect(page.locator("body")).to_have_attribute("data-jp-theme-light", "false")
                    tab("a.ipynb").click()
                    page.wait_for_timeout(500)  # the theme message reaches the kernel
                    _run_cell(page, 3, "a.ipynb")
                    # The run's end replaces the live widget by the final PNG: wait for the end
                    # (a count in the prompt), then take the PNG, not a widget about to go.
                    cell = _cells(page, "a.ipynb").nth(3)
                    expect(cell.locator(".jp-InputPrompt").first).to_have_text(
                        re.compile(r"\[\d+\]"), timeout=WAIT_MS
                    )
                    figure = cell.locator(".jp-OutputArea-output.jp-RenderedImage img").first
                    expect(figure).to_be_visible()
                    figure.scroll_into_view_if_needed()
                    brightness = _image_brightness(figure.screenshot())
                    page.screenshot(path=str(SCREENSHOTS / "identity-dark-theme.png"))
                    assert brightness < 80, (
                        f"the figure is not dark on the dark theme (mean grey {brightness:.0f})"
                    )
                    # The compare view and the run store's table follow the theme too.
                    page.locator(".lm-TabBar-tab", has_text="Compare 2 runs").click()
                    expect(view.locator(".wb-chart-loss canvas")).to_be_visible()
                    page.wait_for_timeout(500)  # redrawn in the dark theme's colours
                    sidebar.locator(".wb-tab-store").click()
                    _hover(page, view.locator(".wb-chart-examples_per_sec"))
                    page.screenshot(path=str(SCREENSHOTS / "identity-compare-dark.png"))
                    for name, node in (("compare view", view), ("run store", sidebar)):
                        grey = _image_brightness(node.screenshot())
                        assert grey < 80, f"the {name} is not dark on the dark theme (mean grey {grey:.0f})"
            finally:
                browser.close()
    finally:
        _kill(kernels)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


# ----- issue 41: live views that agree, a Busy kernel, nothing cut -----------------------------
# Every text of the workbench that does not fit its box (a text node drawn beyond its element's
# content box or beyond the view), unless it is a deliberate ellipsis whose tooltip has the text.
CUT_TEXTS_JS = """(root) => {
  const view = root.getBoundingClientRect();
  const cut = [];
  for (const e of [root, ...root.querySelectorAll('*')]) {
    if (!e.getClientRects().length || getComputedStyle(e).visibility === 'hidden') continue;
    const style = getComputedStyle(e);
    const box = e.getBoundingClientRect();
    const left = box.left + parseFloat(style.borderLeftWidth) + parseFloat(style.paddingLeft);
    const right = box.right - parseFloat(style.borderRightWidth) - parseFloat(style.paddingRight);
    for (const node of e.childNodes) {
      if (node.nodeType !== 3 || !node.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      for (const r of range.getClientRects()) {
        const beyond = r.left < left - 1 || r.right > right + 1 || r.left < view.left - 1 || r.right > view.right + 1;
        const tooltip = (e.closest('[title]') || {}).title || '';
        const ellipsis = style.textOverflow === 'ellipsis' && tooltip.includes(node.textContent.trim());
        if (beyond && !ellipsis) {
          cut.push(`${e.tagName.toLowerCase()}.${e.className}: "${node.textContent.trim().slice(0, 50)}"`);
        }
      }
    }
    const clips = ['hidden', 'clip'].includes(style.overflowX);
    if (clips && e.scrollWidth > e.clientWidth + 1 && e.textContent.trim() && style.textOverflow !== 'ellipsis') {
      cut.push(`${e.tagName.toLowerCase()}.${e.className} clips its content (${e.scrollWidth} > ${e.clientWidth})`);
    }
  }
  return [...new Set(cut)];
}"""

# CUT_TEXTS_JS on a cell's dashboard (the run's live widget), or null while the cell has none.
DASHBOARD_CUT_JS = (
    "(cell) => { const dash = document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')"
    f"[cell].querySelector('.widget-vbox'); return dash ? ({CUT_TEXTS_JS})(dash) : null; }}"
)

# One instant of every live view of the run whose dashboard is in cell CELL: the dashboard's
# header (its snapshot and step), its progress bar's step, its figure's last step (tooltip), the
# sidebar card and the status bar (their snapshot, step and steps/s) and the kernel's state.
LIVE_VIEWS_JS = """(cell) => {
  const num = (text, pattern) => { const m = pattern.exec(text || ''); return m ? Number(m[1].replace(/,/g, '')) : null; };
  const dash = document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')[cell].querySelector('.widget-vbox');
  const header = dash && dash.querySelector('[data-snapshot]');
  const bar = dash && dash.querySelector('.widget-hbox');
  const figure = dash && dash.querySelector('.wb-figure-step');
  const card = document.querySelector('.wb-sidebar .wb-run[data-status=running]');
  const status = document.querySelector('.wb-status');
  return {
    header_seq: header ? Number(header.dataset.snapshot) : null,
    header_step: num(header && header.textContent, /step ([\\d,]+)\\//),
    bar_step: num(bar && bar.textContent, /(\\d+)\\/\\d+\\s*\\[/),  // (tqdm spaces: non-breaking)
    plot_step: num(figure && figure.textContent, /steps 1-([\\d,]+)/),
    plot_seq: (() => { const f = figure && figure.querySelector('[data-figure-snapshot]'); return f ? Number(f.dataset.figureSnapshot) : null; })(),
    card_seq: card ? Number(card.dataset.snapshot) : null,
    card_step: num(card && card.querySelector('.wb-run-step').textContent, /step ([\\d,]+)/),
    card_rate: card ? card.querySelector('.wb-run-rate').textContent : null,
    status_seq: status ? Number(status.dataset.snapshot) : null,
    status_text: status ? status.textContent : null,
    kernel: document.querySelector('.jp-StatusBar-Widget').textContent,
  };
}"""


# What a run's cell and its sidebar card say before step 1 (what the run is doing now).
START_JS = """(cell) => {
  const c = document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')[cell];
  const out = c && c.querySelector('.jp-OutputArea');
  const header = out && out.querySelector('.widget-vbox .widget-html');
  const card = document.querySelector('.wb-sidebar .wb-run[data-status=running], .wb-sidebar .wb-run[data-status=created]');
  const doing = card && card.querySelector('.wb-run-doing');
  return {
    header: header ? header.innerText.trim() : '',
    card_doing: doing && !doing.hidden ? doing.textContent : null,
    card_step: card ? card.querySelector('.wb-run-step').textContent : null,
  };
}"""


def _watch_the_start(page, cell: int, clicked: float) -> list[dict]:
    """The cell's header and the sidebar card from the cell's start to its first step, every
    0.2 s: each sample with `t`, the seconds since `clicked` (monotonic)."""
    seen, deadline = [], time.monotonic() + WAIT_MS / 1000
    while time.monotonic() < deadline:
        sample = page.evaluate(START_JS, cell)
        sample["t"] = round(time.monotonic() - clicked, 2)
        seen.append(sample)
        if re.search(r"step [1-9][\d,]*/", sample["header"]):
            return seen
        page.wait_for_timeout(200)
    raise AssertionError(f"no step within {WAIT_MS / 1000:.0f} s: {seen[-3:]}")


def _said_before_step_one(seen: list[dict], name: str) -> list[str]:
    """Something in the cell before the run does anything slow, then what the run is doing until
    step 1, in the header and the sidebar card; the step count replaces the card's line. (The
    seconds to the first text are reported: 0.4-1.8 s here at a load of 10; at a load of 40 the
    page itself took 3 s to show the cell's first output, so the check is on what came first.)"""
    shown = [s for s in seen if s["header"]]
    assert shown, f"{name}: nothing in the cell before step 1: {seen[-5:]}"
    header_texts = list(dict.fromkeys(s["header"].splitlines()[-1] for s in shown))
    card_texts = list(dict.fromkeys(s["card_doing"] for s in seen if s["card_doing"]))
    # The first text is the cell's own, or already the launcher's next one when the page's 0.2-s
    # samples missed the first (a background pool start makes that one brief).
    first = header_texts[0]
    assert first.startswith("starting the run") or re.match(r"starting \d+ [\w-]+ process", first), (
        f"{name}: the cell's first text: {header_texts}"
    )
    assert any(re.search(r"starting|compiling|importing|ready", t) for t in header_texts[1:]), (
        name,
        header_texts,
    )
    assert card_texts, f"{name}: the sidebar card never said what the run was doing: {seen[-5:]}"
    return [
        f"{name}: first text {shown[0]['t']} s after the start; header said {header_texts}; card said {card_texts}"
    ]


def _sample_live_views(page, cell: int, count: int) -> list[dict]:
    """`count` instants of the live views (each read in one evaluate: one instant), 0.7 s apart,
    from the first one where the header, the sidebar and the figure show a snapshot, the figure
    past its first 2,000 steps: its first drawings build it (fonts, axes, a panel per metric),
    and while a run's step count grows by half at every snapshot its axes grow at most of them
    (each a full drawing, 4-5 times a blitted frame's CPU, which a load of 15-20 on two cores
    stretches to a second)."""
    samples, deadline = [], time.monotonic() + 300
    while len(samples) < count and time.monotonic() < deadline:
        seen = page.evaluate(LIVE_VIEWS_JS, cell)
        drawn = (seen["plot_step"] or 0) >= 2000 or samples
        if seen["header_seq"] and seen["card_seq"] and seen["bar_step"] is not None and drawn:
            # (the dashboard's cut texts while it is there: a short run's ends with the run)
            seen["cut"] = page.evaluate(DASHBOARD_CUT_JS, cell)
            samples.append(seen)
        page.wait_for_timeout(700)
    assert len(samples) == count, f"the views never all showed a snapshot: {samples[-1:] or seen}"
    return samples


def _snapshot_steps(page, cell: int) -> dict[int, int]:
    """The run's snapshots {seq: steps}, printed by the readout cell (index `cell`) from the Run's
    own events: what each view should show for the snapshot it says it shows."""
    from playwright.sync_api import expect

    _run_cell(page, cell)
    output = (
        page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
        .nth(cell)
        .locator(".jp-OutputArea-output")
    )
    expect(output).to_contain_text("SNAPSHOTS")
    text = output.inner_text()
    return {int(k): v for k, v in json.loads(text[text.index("SNAPSHOTS") + len("SNAPSHOTS") :]).items()}


def _box(locator) -> dict:
    """The element's bounding box once it is visible. (Playwright returns None for an element
    not visible at that instant: once, on a loaded machine, the sidebar's tab while JupyterLab
    re-rendered its tab bar.)"""
    from playwright.sync_api import expect

    for _ in range(10):
        expect(locator).to_be_visible()
        box = locator.bounding_box()
        if box is not None:
            return box
        time.sleep(0.2)
    raise AssertionError(f"{locator} stayed without a bounding box (not visible)")


def _views_agree(samples: list[dict], steps: dict[int, int], name: str) -> list[str]:
    """Each instant: the header, the sidebar card and the status bar show snapshots at most one
    apart, each view the steps of the snapshot it says; the progress bar the header's snapshot or
    a neighbour of it; the figure never ahead of the header. Returns lines for the report."""
    lines = []
    for s in samples:
        # The card and the status bar render the same messages; the header is set by a thread
        # of the dashboard that does nothing else (the figure has its own): each shows the
        # latest snapshot it was handed, so at one instant they are at most one apart.
        assert abs(s["card_seq"] - s["status_seq"]) <= 1, (name, s)
        assert abs(s["header_seq"] - s["card_seq"]) <= 1, (name, s)
        assert s["header_step"] == steps[s["header_seq"]] and s["card_step"] == steps[s["card_seq"]], (
            name,
            s,
        )
        near = {steps.get(s["header_seq"] + d) for d in (-1, 0, 1)}
        assert s["bar_step"] in near, (name, s, near)
        rate = "compiling" if s["card_rate"].startswith("\u2013") else s["card_rate"]  # (no rate yet)
        assert s["status_text"].endswith(rate) or s["status_seq"] != s["card_seq"], (name, s)
        if s["plot_step"] is not None:
            # The figure: the snapshot it says, never ahead of the header (how far behind: below).
            assert s["plot_step"] == steps[s["plot_seq"]] and s["plot_step"] <= s["header_step"], (name, s)
        lines.append(
            f"{name}: snapshots header {s['header_seq']} card {s['card_seq']} status {s['status_seq']} "
            f"figure {s['plot_seq']}; steps header {s['header_step']} bar {s['bar_step']} card "
            f"{s['card_step']} figure {s['plot_step']}"
        )
    # The figure draws the latest snapshot, blitted, on its own thread, within a CPU budget
    # over a window (plots/live_frame.DrawingBudget): level with the header or one snapshot
    # behind at most instants of a foreground run; it moves on with the run. An async-ps run's
    # figure shares two cores with the browser and four server processes: at the suite's load
    # (3 test processes beside it) its budget held it 2-6 snapshots behind for seconds once
    # (decision 36), so there it has to catch up at least once (one behind at most).
    lags = sorted(s["header_seq"] - s["plot_seq"] for s in samples if s["plot_seq"] is not None)
    if name == "async-ps":
        assert lags and lags[0] <= 1, (name, lags)
    else:
        assert lags and lags[len(lags) // 2] <= 1, (name, lags)
    plotted = [s["plot_seq"] for s in samples if s["plot_seq"] is not None]
    assert plotted[-1] > plotted[0], (name, plotted)
    lines.append(f"{name}: figure behind the header by {lags} snapshots")
    return lines


def _write_live_notebook(path: Path) -> None:
    readout = (
        "import json\nprint('SNAPSHOTS' + json.dumps({e.data['snapshot']['seq']: e.data['snapshot']['steps'] "
        "for e in _.events if 'snapshot' in e.data}))"
    )
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell(c)
        for c in (
            "%load_ext workbench",
            "%%replicate --backend mirrored --replicas 2 --steps 15000\n" + TOY_CELL.strip(),
            readout,
            "%%replicate --backend async-ps --workers 2 --ps 1 --steps 100000 --background\n"
            + TOY_CELL.strip(),
            readout,
        )
    ]
    nbformat.write(nb, path)


@pytest.mark.slow
def test_live_views_agree_the_kernel_stays_busy_and_nothing_is_cut_in_a_browser(tmp_path):
    """Issue 41 at JupyterLab's default sidebar width in a 1280-px window: a foreground run and an
    async-ps background run sampled at several instants (the cell's header, its progress bar and
    figure, the sidebar card and the status bar show the same snapshot of the run, or neighbours);
    the kernel says Busy while the foreground cell trains; the final figures are the run's; no
    text of the sidebar, the dashboard, the run store or the compare view is cut; the backend is
    named once. Screenshots: build/lab-extension/live-*.png."""
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    _write_live_notebook(tmp_path / "live.ipynb")
    port, token = free_ports(1)[0], secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    server = _start_lab(tmp_path, port, token)
    kernels: list[int] = []
    report: list[str] = []
    try:
        _wait_for_server(f"{base}/api/status?token={token}", server, tmp_path / "jupyterlab.log")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.set_default_timeout(WAIT_MS)
                with _explained(page, tmp_path, "live"):
                    page.goto(f"{base}/lab/tree/live.ipynb?reset&token={token}")
                    expect(page.locator(".jp-NotebookPanel .jp-Cell")).to_have_count(5)
                    _wait_for_idle_kernel(page)
                    page.locator("li[data-id='replicator-workbench-sidebar']").click()
                    sidebar = page.locator(".wb-sidebar")
                    kernels = _children(server.pid)
                    _run_cell(page, 0)
                    expect(sidebar).to_have_attribute("data-state", "ready")

                    # A foreground run: something within 2 s and what it is doing until step 1; the
                    # views agree at every instant; the kernel says Busy.
                    clicked = time.monotonic()
                    _run_cell(page, 1)
                    report += _said_before_step_one(_watch_the_start(page, 1, clicked), "foreground")
                    samples = _sample_live_views(page, 1, 6)
                    page.screenshot(path=str(SCREENSHOTS / "live-foreground.png"))
                    idle = [s["kernel"] for s in samples if "| Busy" not in s["kernel"]]
                    assert not idle, f"the kernel did not say Busy while its cell trained: {idle}"
                    seen = [s["cut"] for s in samples if s["cut"] is not None]
                    assert seen, "the dashboard was never there while the views were sampled"
                    cut = sorted({text for found in seen for text in found})
                    assert cut == [], f"cut in the dashboard: {cut}"
                    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").nth(1)
                    expect(
                        cell.locator(".jp-OutputArea-output tr:has(th:text-is('status')) td")
                    ).to_have_text("finished", timeout=300_000)
                    report += _views_agree(samples, _snapshot_steps(page, 2), "foreground")
                    # The final figures are the run's: the summary, the card and the status bar.
                    rate = _summary_figure(cell, "steps_per_sec")
                    run_id = _summary_figure(cell, "run")
                    card = sidebar.locator(f".wb-run[data-run-id='{run_id}']")
                    expect(card.locator(".wb-run-step")).to_have_text("step 15,000 / 15,000")
                    expect(card.locator(".wb-run-rate")).to_have_text(f"{rate} steps/s")
                    # The backend once: the default name says it; no config line, no repeat in the status bar.
                    name = card.locator(".wb-run-name").inner_text()
                    assert name.startswith("mirrored x2 \u00b7 live \u00b7"), name
                    expect(card.locator(".wb-run-config")).to_be_hidden()
                    status = page.locator(".wb-status")
                    expect(status).to_have_text(
                        f"Replicator: mirrored \u00b7 2 replicas \u00b7 last run: {rate} steps/s"
                    )

                    # An async-ps run in the background (the kernel is free meanwhile): what it is
                    # doing (its servers starting, compiling) until step 1, then the views agree.
                    clicked = time.monotonic()
                    _run_cell(page, 3)
                    start = _watch_the_start(page, 3, clicked)
                    report += _said_before_step_one(start, "async-ps")
                    expect(sidebar.locator(".wb-run[data-status=running]")).to_have_count(1, timeout=180_000)
                    samples = _sample_live_views(page, 3, 6)
                    running = sidebar.locator(".wb-run[data-status=running]")
                    dashboard = page.locator(".jp-Cell").nth(3).locator(".widget-vbox").first
                    expect(dashboard.locator("img")).to_be_visible()
                    dashboard.scroll_into_view_if_needed()
                    page.screenshot(path=str(SCREENSHOTS / "live-async-ps.png"))
                    for where, node in (("sidebar", sidebar), ("dashboard", dashboard)):
                        cut = node.evaluate(CUT_TEXTS_JS)
                        assert cut == [], f"cut in the {where}: {cut}"
                    tab = _box(page.locator("li[data-id='replicator-workbench-sidebar']"))
                    title = _box(sidebar.locator(".wb-title"))
                    assert title["x"] + title["width"] <= tab["x"], "the sidebar's heading runs under its tab"
                    report += _views_agree(samples, _snapshot_steps(page, 4), "async-ps")
                    running.locator(".wb-stop").click()
                    expect(running).to_have_count(0)

                    # The run store and the compare view of both runs.
                    sidebar.locator(".wb-tab-store").click()
                    rows = sidebar.locator(".wb-stored-run")
                    expect(rows).to_have_count(2)
                    page.screenshot(path=str(SCREENSHOTS / "live-run-store.png"))
                    cut = sidebar.evaluate(CUT_TEXTS_JS)
                    assert cut == [], f"cut in the run store: {cut}"
                    # (Measured in one evaluation in the page: row by row, a list re-rendered
                    # meanwhile, as the store refreshes after a run, left a row without a box.)
                    heights, name_heights, line = rows.evaluate_all(
                        """rows => [rows.map(r => r.getBoundingClientRect().height),
                                    rows.map(r => r.querySelector('.wb-stored-name').getBoundingClientRect().height),
                                    parseFloat(getComputedStyle(rows[0].querySelector('.wb-stored-name')).lineHeight) || 16]"""
                    )
                    names = [height / line for height in name_heights]
                    assert max(names) <= 3.2, f"run names wrap to {names} lines (rows {heights} px)"
                    for pick in sidebar.locator(".wb-pick-run").all():
                        pick.check()
                    sidebar.locator(".wb-compare").click()
                    view = page.locator(".wb-compare-view")
                    expect(view.locator(".wb-chart-loss canvas")).to_be_visible()
                    table = view.locator(".wb-compare-table")
                    table.scroll_into_view_if_needed()
                    page.screenshot(path=str(SCREENSHOTS / "live-compare.png"))
                    cut = view.evaluate(CUT_TEXTS_JS)
                    assert cut == [], f"cut in the compare view: {cut}"
                    assert table.evaluate("t => t.scrollWidth <= t.parentElement.clientWidth + 1"), (
                        "the compare table is wider than its view"
                    )
                    expect(table.locator("th")).to_contain_text(["median compiled step examples/s", "loss"])

                    # A theme switch: the finished run's figure already in its cell turns dark too.
                    page.locator(".lm-TabBar-tab", has_text="live.ipynb").click()
                    figure = page.locator(".jp-Cell").nth(1).locator(".jp-RenderedImage img").first
                    figure.scroll_into_view_if_needed()
                    light = _image_brightness(figure.screenshot())
                    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").click()
                    page.locator(".lm-Menu-itemLabel", has_text="Theme").first.hover()
                    page.locator(".lm-Menu-itemLabel").get_by_text("JupyterLab Dark", exact=True).click()
                    expect(page.locator("body")).to_have_attribute("data-jp-theme-light", "false")
                    deadline, dark = time.monotonic() + WAIT_MS / 1000, light
                    while dark > 80 and time.monotonic() < deadline:
                        page.wait_for_timeout(500)
                        dark = _shown_brightness(figure, dark)
                    page.screenshot(path=str(SCREENSHOTS / "live-theme-switched.png"))
                    report.append(
                        f"finished figure's mean grey: {light:.0f} light, {dark:.0f} after the switch"
                    )
                    assert light > 150 and dark < 80, (light, dark)
            finally:
                browser.close()
    finally:
        print("\n".join(report))
        kernels = sorted(set(kernels) | set(_children(server.pid)))
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        _kill(kernels)
