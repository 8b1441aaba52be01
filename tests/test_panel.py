"""wb.ui.panel(): widget state without a browser; choices shared with %replicate; Run and Stop."""

import time

import pytest
import traitlets
from notebook_toy import TOY_CELL, ipython_shell, isolated_notebook_state

import workbench as wb
from workbench._src.notebook import session


@pytest.fixture
def ns(tmp_path):
    with isolated_notebook_state(tmp_path / "runs"):
        yield {}


@pytest.fixture
def panel(ns):
    p = wb.ui.panel(namespace=ns)
    yield p
    if p.run is not None and p.run.running:
        p.run.stop().wait(30)
    p.close()


def wait_for(condition, timeout=60):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_devices_and_choices_that_cannot_work(panel):
    devices = wb.device_summary()
    assert (
        f"{devices['virtual_cpus']} virtual CPU" in panel._devices.value and "0 GPU" in panel._devices.value
    )
    buttons = panel._backend_buttons
    assert list(buttons) == ["single", "mirrored", "multi-worker", "async-ps", "tpu"]
    assert not buttons["single"].disabled and not buttons["mirrored"].disabled
    for name in ("multi-worker", "async-ps"):  # process backends: local workers on 127.0.0.1
        assert not buttons[name].disabled, buttons[name].tooltip
    assert buttons["tpu"].disabled and "no TPU" in buttons["tpu"].tooltip
    assert not panel._async_button.disabled
    assert "tpu: no TPU" in panel._reasons.value
    with pytest.raises(traitlets.TraitError, match="backend 'tpu' cannot be chosen here: no TPU"):
        panel.backend = "tpu"
    with pytest.raises(traitlets.TraitError, match=r"replicas must be between 1 and 8 .* received 9"):
        panel.replicas = 9
    assert panel._replicas.get_state()["max"] == devices["virtual_cpus"]


def test_opening_the_panel_chooses_nothing(panel):
    assert session.current_or_none() is None
    assert panel.backend == "mirrored" and panel.replicas == 2
    assert (
        panel.magic_line
        == "%replicate step_fn input_fn --backend mirrored --replicas 2 --steps 300 --background"
    )
    assert panel.magic_line in panel._magic.get_state()["value"]


def test_choosing_in_the_panel_sets_the_session_replicator_as_the_magic_does(panel):
    ip = ipython_shell()
    panel._replicas.value = 4  # the user types 4
    repl = wb.current()
    assert repl.backend == "mirrored" and repl.num_replicas == 4
    assert ip.run_line_magic("replicate", "--backend mirrored --replicas 4") is repl  # the same choice
    assert "--replicas 4" in panel.magic_line
    panel._backend_buttons["single"].value = True  # the user clicks "single"
    assert wb.current().backend == "single" and panel._replicas.disabled and panel._replicas.value == 1
    assert not panel._backend_buttons["mirrored"].value
    assert panel.magic_line.startswith("%replicate step_fn input_fn --backend single --steps 300")
    # ... and the panel follows the magic.
    ip.run_line_magic("replicate", "--backend mirrored --replicas 3")
    assert panel.backend == "mirrored" and panel.replicas == 3 and panel._backend_buttons["mirrored"].value
    assert "--replicas 3" in panel.magic_line and wb.current().num_replicas == 3
    panel._sync_button.value = True  # sync while already synchronous: no change
    assert panel.backend == "mirrored"


def test_run_trains_the_notebook_functions_in_the_background(panel, ns):
    panel.steps = 40
    panel.apply()
    from notebook_toy import define_toy

    define_toy(wb.current(), ns)
    panel._run_button.click()
    run = panel.run
    assert run is not None and panel._run_button.disabled and not panel._stop_button.disabled
    run.wait(60)
    assert run.status == "finished" and run.steps == 40
    wait_for(lambda: not panel._run_button.disabled)
    assert panel.status.startswith(f"{run.name} finished at step 40") and panel._stop_button.disabled
    (dash_box,) = panel._live.children
    image = dash_box.children[-1]
    assert bytes(image.value).startswith(b"\x89PNG")
    assert wb.load_run(run.id).status == "finished"  # recorded like any run


def test_stop_button_stops_the_run(panel, ns):
    panel.steps = 10**7
    panel.apply()
    from notebook_toy import define_toy

    define_toy(wb.current(), ns)
    run = panel.start()
    wait_for(lambda: run.steps >= 10)
    panel._stop_button.click()
    run.wait(30)
    assert run.status == "stopped" and 10 <= run.steps < 10**7
    wait_for(lambda: "stopped" in panel.status)


def test_run_without_functions_says_what_to_do(panel):
    panel._run_button.click()
    assert panel.run is None
    assert panel.status.startswith("error: step_fn and input_fn not defined in the notebook. Fix:")
    assert "color:var(--jp-error-color1)" in panel._status.value  # the theme's error colour


def test_panel_uses_the_shell_namespace_by_default(ns):
    ip = ipython_shell()
    ip.run_cell_magic("replicate", "--backend mirrored --replicas 2 --steps 1 --no-live", TOY_CELL)
    p = wb.ui.panel()
    try:
        assert p.replicas == 2 and p.backend == "mirrored"  # opens on the session's choice
        p.steps = 5
        run = p.start()
        run.wait(60)
        assert run.status == "finished" and run.history["step"].tolist() == [1, 2, 3, 4, 5]
        assert run.history["global_step"].tolist() == [2, 3, 4, 5, 6]
    finally:
        p.close()


@pytest.mark.slow
@pytest.mark.usefixtures("no_orphans")
def test_run_on_a_process_backend_sends_the_last_replicate_cell(tmp_path):
    """The notebook's model trains on multi-worker from the panel: Run sends the last %%replicate
    cell to the processes (as the magic does) and the trained weights come back into `model`."""
    from helpers import PROCESS_CELL

    shell = ipython_shell()
    with isolated_notebook_state(tmp_path / "runs"):
        shell.run_cell_magic("replicate", "--backend single --steps 5 --no-live", PROCESS_CELL)
        before = shell.user_ns["model"].get_weights()[0].copy()
        p = wb.ui.panel()
        try:
            p.backend, p.workers, p.steps = "multi-worker", 1, 30
            run = p.start()
            assert run is not None, p.status
            run.wait(120)
            assert run.status == "finished" and run.steps == p.steps, run.stop_reason
            assert [q["role"] for q in run.processes] == ["worker"]
            after = shell.user_ns["model"].get_weights()[0]
            assert not (after == before).all()  # the chief's weights, loaded into the cell's model
            wait_for(lambda: p.status.startswith(f"{run.name} finished"))
        finally:
            p.close()


@pytest.mark.slow
@pytest.mark.usefixtures("no_orphans")
def test_run_with_restarts_heals_a_killed_worker_and_its_magic_line_does_the_same(tmp_path):
    """The panel's restarts field is repl.train's max_restarts: a worker SIGKILLed mid-run is
    healed (one restart, every step once), and the equivalent magic line carries it and runs."""
    import os
    import signal

    from helpers import PROCESS_CELL

    shell = ipython_shell()
    with isolated_notebook_state(tmp_path / "runs"):
        shell.run_cell_magic("replicate", "--backend single --steps 5 --no-live", PROCESS_CELL)
        p = wb.ui.panel()
        try:
            p.backend, p.workers, p.steps = "multi-worker", 2, 200
            assert p._max_restarts.disabled is False and p.max_restarts == 0
            p._max_restarts.value = 1  # as a researcher types it
            assert p.max_restarts == 1 and "--max-restarts 1" in p.magic_line, p.magic_line
            with pytest.raises(traitlets.TraitError, match="max_restarts.*should not be less than 0"):
                p.max_restarts = -1
            run = p.start()
            assert run is not None, p.status
            wait_for(lambda: run.steps >= 60 or not run.running, timeout=180)
            worker = next(q for q in run.processes if q["role"] == "worker" and q["index"] == 1)
            os.kill(worker["pid"], signal.SIGKILL)
            run.wait(300)
            assert run.status == "finished", run.stop_reason
            assert list(run.history["step"]) == list(range(1, 201))  # the lost stretch re-run, once
            assert len(run.restarts) == 1 and run.restarts[0]["member"] == "worker 1", run.restarts
            # The line the panel shows, pasted as the head of the cell, is accepted as it reads.
            line = p.magic_line.split(" ", 1)[1].replace("--steps 200", "--steps 3") + " --no-live"
            pasted = shell.run_cell_magic("replicate", line, PROCESS_CELL)
            pasted.wait(120)
            assert pasted.status == "finished", pasted.stop_reason
            p.backend = "single"  # (the restarts field is off where nothing heals)
            assert p._max_restarts.disabled and "--max-restarts" not in p.magic_line, p.magic_line
        finally:
            p.close()


@pytest.mark.usefixtures("no_orphans")  # (choosing multi-worker started its pool in the background)
def test_run_on_a_process_backend_without_a_replicate_cell_says_what_to_do(panel):
    panel.backend, panel.workers = "multi-worker", 2
    panel._run_button.click()
    assert panel.run is None
    assert "needs the cell that builds it. Fix: run a %%replicate cell" in panel.status, panel.status


@pytest.mark.usefixtures("no_orphans")  # (choosing multi-worker starts its pool in the background)
def test_min_workers_field_is_multi_workers_and_its_magic_line_chooses_the_same_replicator(panel):
    """The min-workers field is MultiWorkerReplicator's min_workers (elastic sync runs): only
    multi-worker takes it; the line the panel shows carries it, and pasted it chooses the same."""
    assert panel._min_workers.disabled and panel.min_workers == 0  # mirrored: nothing to shrink
    panel.backend, panel.workers = "multi-worker", 3
    assert not panel._min_workers.disabled and "--min-workers" not in panel.magic_line
    panel._min_workers.value = 2  # as a researcher types it
    assert panel.min_workers == 2 and "--workers 3 --min-workers 2" in panel.magic_line, panel.magic_line
    assert session.current_or_none().plan.min_workers == 2, panel.status
    panel._min_workers.value = 4  # more than the workers: said in the panel, nothing chosen
    assert (
        panel.status.startswith("error: --min-workers is the fewest workers")
        and "--workers 4" in panel.status
    )
    panel._min_workers.value = 2
    chosen = session.current_or_none()
    line = panel.magic_line.split(" ", 1)[1].split(" --steps")[0]  # "--backend multi-worker --workers 3 ..."
    ipython_shell().run_line_magic("replicate", line)  # pasted, it chooses the same replicator
    assert session.current_or_none() is chosen and chosen.num_workers == 3
    # ... and the panel follows a magic's --min-workers, as it follows its other choices.
    ipython_shell().run_line_magic("replicate", "--backend multi-worker --workers 3 --min-workers 1")
    assert panel.min_workers == 1 and panel._min_workers.value == 1, panel.status
    assert "--workers 3 --min-workers 1" in panel.magic_line, panel.magic_line
    panel.backend = "async-ps"  # (async-ps goes on without a lost worker: no elastic count)
    assert panel._min_workers.disabled and "--min-workers" not in panel.magic_line, panel.magic_line
