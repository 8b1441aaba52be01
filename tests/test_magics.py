"""%replicate / %%replicate on an in-process IPython shell (run_line_magic / run_cell_magic)."""

import os
import re
import time

import pytest
import tensorflow as tf
from IPython.core.error import UsageError
from notebook_toy import TOY_CELL, ipython_shell, isolated_notebook_state

import workbench as wb


@pytest.fixture(scope="module")
def shell():
    ip = ipython_shell()
    return ip


@pytest.fixture
def ip(shell, tmp_path):
    with isolated_notebook_state(tmp_path / "runs"):
        for name in ("step_fn", "input_fn", "repl"):
            shell.user_ns.pop(name, None)
        yield shell


def magic(ip, line):
    return ip.run_line_magic("replicate", line)


def test_load_ext_registers_the_magic_and_configures_virtual_cpus(ip):
    assert "replicate" in ip.magics_manager.magics["line"]
    assert "replicate" in ip.magics_manager.magics["cell"]
    assert wb.device_summary()["virtual_cpus"] >= 4
    from workbench._src import runstore
    from workbench._src.train_loop import SINK_FACTORIES

    runstore.uninstall()
    ip.run_line_magic("reload_ext", "workbench")  # what a fresh kernel's %load_ext does
    assert runstore._recorder_factory in SINK_FACTORIES


def test_set_form_sets_the_session_replicator(ip):
    repl = magic(ip, "--backend mirrored --replicas 2")
    assert wb.current() is repl and ip.user_ns["repl"] is repl
    assert repl.backend == "mirrored" and repl.num_replicas == 2
    assert magic(ip, "--backend mirrored --replicas 2") is repl  # same choice: same variables
    assert magic(ip, "") is repl  # bare %replicate shows the current one
    assert magic(ip, "-b single").backend == "single"


@pytest.mark.parametrize(
    "line, message",
    [
        ("--backend nope", r"Unknown replicator backend 'nope'.*mirrored"),
        (
            "--backend multi-worker --workers 2",
            r"'multi-worker' backend is not available.*yet.*--backend mirrored",
        ),
        ("--backend async-ps --workers 2 --ps 1", r"'async-ps' backend is not available.*yet"),
        (
            "--backend mirrored --workers 2",
            r"--workers applies to the multi-worker and async-ps backends.*received backend='mirrored'",
        ),
        ("--backend mirrored --ps 1", r"--ps .* applies to the async-ps backend"),
        ("--backend mirrored --replicas 0", r"argument --replicas.*positive integer.*'0'.*Usage"),
        ("--backend mirrored --replicas 99", r"needs 99 devices.*Fix: ask for at most"),
        ("--backend single --replicas 2", r"exactly one replica.*Fix: use wb.replicator\('mirrored'"),
        ("--backend tpu", r"No TPU is reachable.*Fix"),
        ("--steps-per-execution lots step_fn input_fn --steps 3", r"--steps-per-execution.*'lots'"),
        (
            "--background",
            r"Training options given \(--background\), but this line trains nothing.*--steps 300 --background",
        ),
        ("step_fn --steps 10", r"two notebook functions.*received step_fn.*Fix: %replicate step_fn input_fn"),
        ("step_fn input_fn", r"How many steps\? Fix: %replicate step_fn input_fn --steps 300"),
        ("--steps 10", r"two notebook functions.*received none"),
    ],
)
def test_mistakes_raise_usage_errors_that_say_the_fix(ip, line, message):
    ip.user_ns.update(step_fn=lambda b: {}, input_fn=lambda c: None)
    with pytest.raises(UsageError, match=re.compile(message, re.S)):
        magic(ip, line)


def test_no_replicator_chosen_says_how(ip):
    with pytest.raises(UsageError, match="No replicator chosen.*--backend mirrored --replicas 4"):
        ip.run_cell_magic("replicate", "--steps 5", TOY_CELL)
    with pytest.raises(wb.ConfigurationError, match="No replicator has been chosen.*wb.use"):
        wb.current()


def test_line_form_names_that_are_missing_or_swapped(ip):
    magic(ip, "--backend mirrored --replicas 2")
    ip.user_ns.update(step_fn=lambda b: {}, input_fn=lambda c: None, not_a_fn=3)
    with pytest.raises(
        UsageError, match="'stepfn' .* is not defined in the notebook. Did you mean step_fn\\?"
    ):
        magic(ip, "stepfn input_fn --steps 3")
    with pytest.raises(UsageError, match="must be a function; received a int"):
        magic(ip, "not_a_fn input_fn --steps 3")
    with pytest.raises(UsageError, match="look swapped.*Fix: %replicate step_fn input_fn --steps 3"):
        magic(ip, "input_fn step_fn --steps 3")


def test_cell_form_builds_in_the_context_then_trains(ip):
    run = ip.run_cell_magic("replicate", "--backend mirrored --replicas 2 --steps 40 --no-live", TOY_CELL)
    assert isinstance(run, wb.Run) and run.status == "finished" and run.steps == 40
    assert isinstance(ip.user_ns["w"], tf.distribute.DistributedValues)  # created in repl.context()
    assert ip.user_ns["repl"] is wb.current()
    assert run.history["loss"].iloc[-1] < run.history["loss"].iloc[0] / 10
    # The line form trains the same functions on the same replicator: the data stream continues.
    more = magic(ip, "step_fn input_fn --steps 10 --no-live --steps-per-execution 5")
    assert list(more.history["step"]) == list(range(41, 51))
    assert [r["id"] for _, r in wb.runs().iterrows()] == [run.id, more.id]


def test_cell_form_errors(ip):
    magic(ip, "--backend mirrored --replicas 2")
    with pytest.raises(UsageError, match="must define step_fn\\(batch\\) and input_fn\\(ctx\\); step_fn"):
        ip.run_cell_magic("replicate", "--steps 5", "def input_fn(ctx): return None")
    with pytest.raises(ZeroDivisionError):  # the user's own error, with its traceback
        ip.run_cell_magic("replicate", "--steps 5", "x = 1 / 0")
    with pytest.raises(UsageError, match="takes no function names"):
        ip.run_cell_magic("replicate", "step_fn input_fn --steps 5", TOY_CELL)


def test_background_checkpoint_logdir_and_live_console(ip, tmp_path, capsys):
    ip.run_cell_magic("replicate", "--backend mirrored --replicas 2 --steps 1 --no-live", TOY_CELL)
    t0 = time.perf_counter()
    run = magic(
        ip, f"step_fn input_fn --steps 100000 --background --no-live --checkpoint {tmp_path / 'ckpt'}"
    )
    assert time.perf_counter() - t0 < 5 and run.status in ("created", "running")
    while run.steps < 20:
        time.sleep(0.05)
    run.stop().wait(30)
    assert run.status == "stopped" and 20 <= run.steps < 100000
    assert any(f.startswith("ckpt-") for f in os.listdir(tmp_path / "ckpt"))
    # --logdir records the run elsewhere; live (console, outside a kernel) shows a tqdm bar.
    logged = magic(ip, f"step_fn input_fn --steps 30 --logdir {tmp_path / 'elsewhere'}")
    assert (tmp_path / "elsewhere" / logged.id / "history.csv").exists()
    assert wb.load_run(logged.id).history["step"].tolist()[-1] == logged.history["step"].iloc[-1]
    out = capsys.readouterr()
    assert "30/30" in out.err and "step" in out.err  # the progress bar
    assert f"figure: {tmp_path / 'elsewhere' / logged.id}" in out.out


class FakeProcessBackend:
    """Stands in for a process backend that has not landed yet, to check the options reach it."""

    backend = "multi-worker"

    @classmethod
    def from_replicas(cls, num_replicas=None, **kwargs):
        made = cls()
        made.received = {"num_replicas": num_replicas, **kwargs}
        return made


def test_workers_and_ps_route_through_wb_replicator_when_the_backend_exists(ip, monkeypatch):
    from workbench._src.backends import BACKENDS

    monkeypatch.setitem(BACKENDS, "multi-worker", (__name__, "FakeProcessBackend", "test"))
    monkeypatch.setitem(BACKENDS, "async-ps", (__name__, "FakeProcessBackend", "test"))
    assert magic(ip, "--backend multi-worker --workers 3").received == {
        "num_replicas": None,
        "num_workers": 3,
    }
    assert magic(ip, "--backend async_ps --workers 2 --ps 1").received == {
        "num_replicas": None,
        "num_workers": 2,
        "num_ps": 1,
    }
    assert wb.current().received["num_ps"] == 1


def test_help_lists_every_option(ip):
    doc = ip.find_line_magic("replicate").__doc__
    for option in (
        "--backend",
        "--replicas",
        "--workers",
        "--ps",
        "--steps",
        "--steps-per-execution",
        "--background",
        "--no-live",
        "--checkpoint",
        "--logdir",
    ):
        assert option in doc
