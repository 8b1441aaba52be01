"""%replicate / %%replicate on an in-process IPython shell (run_line_magic / run_cell_magic)."""

import os
import re
import time

import pytest
import tensorflow as tf
from IPython.core.error import UsageError
from notebook_toy import TOY_CELL, define_toy, ipython_shell, isolated_notebook_state

import workbench as wb
from workbench._src.core.reaper import discard_programs
from workbench._src.notebook import session


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
        # The session's replicator is dropped next: delete its idle input iterators off the main
        # thread (reaper.py), or a later test freezes 10-40 s when the garbage collector finds them.
        repl = session.current_or_none()
        if repl is not None:
            discard_programs(getattr(repl, "_programs", {}).values())  # a fake backend has none


def magic(ip, line):
    return ip.run_line_magic("replicate", line)


def test_load_ext_registers_the_magic_and_configures_virtual_cpus(ip):
    assert "replicate" in ip.magics_manager.magics["line"]
    assert "replicate" in ip.magics_manager.magics["cell"]
    assert wb.device_summary()["virtual_cpus"] >= 4
    from workbench._src.sinks import _default_factories as SINK_FACTORIES
    from workbench._src.sinks import runstore

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
        (
            "--backend mirrored --replicas 2 the session replicator",
            r"--backend mirrored --replicas 2 chooses the session's replicator.*received the session "
            r"replicator\. Fix: %replicate --backend mirrored --replicas 2 alone",
        ),
    ],
)
def test_mistakes_raise_usage_errors_that_say_the_fix(ip, line, message):
    ip.user_ns.update(step_fn=lambda b: {}, input_fn=lambda c: None)
    with pytest.raises(UsageError, match=re.compile(message, re.S)):
        magic(ip, line)


def test_a_trailing_comment_is_dropped_as_a_shell_would(ip):
    # The README's lines, pasted as they are: IPython passes the comment on to the magic.
    repl = magic(ip, "--backend mirrored --replicas 2      # the session's replicator (wb.current())")
    assert wb.current() is repl and repl.num_replicas == 2
    define_toy(repl, ip.user_ns)
    run = magic(ip, "step_fn input_fn --steps 3 --no-live   # train functions defined earlier")
    assert run.status == "finished" and len(run.history) == 3
    # A '#' inside quotes or inside a word is not a comment.
    from workbench._src.notebook.magics import strip_comment

    assert strip_comment("--logdir 'runs #2' --steps 3 # three") == "--logdir 'runs #2' --steps 3"
    assert strip_comment('--logdir "a \\" #b" # c') == '--logdir "a \\" #b"'
    assert strip_comment("--logdir runs#2") == "--logdir runs#2"
    assert strip_comment("# only a comment") == ""


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
    assert list(more.history["step"]) == list(range(1, 11))  # counted from the run's start
    assert list(more.history["global_step"]) == list(range(41, 51))
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
    import dataclasses

    from workbench._src.backends import BACKENDS

    for name in ("multi-worker", "async-ps"):
        fake = dataclasses.replace(BACKENDS[name], cls=f"{__name__}:FakeProcessBackend")
        monkeypatch.setitem(BACKENDS, name, fake)
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
        "--scaling",
        "--mode",
        "--warmup",
        "--batch-size",
        "--compare",
    ):
        assert option in doc


# ----- %replicate --scaling (issue 5) --------------------------------------------------------
# A %%replicate --scaling cell: run once per replica count, in that count's repl.context().
SCALING_CELL = """
import tensorflow as tf, keras
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
opt = repl.wrap_optimizer(keras.optimizers.SGD(0.05))
initial_weights.append(float(model.weights[0].numpy().sum()))  # the study seeds every build

def input_fn(ctx):
    x = tf.random.stateless_normal([256, 4], seed=[1, 2])
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ctx.global_batch_size)

def step_fn(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return {"loss": loss, "batch": tf.cast(tf.shape(x)[0], tf.float32)}
"""
FAST_STUDY = "--steps 6 --warmup 2 --steps-per-execution 3 --no-live"


@pytest.mark.slow
def test_scaling_cell_form_rebuilds_the_model_per_replica_count(ip):
    session_repl = magic(ip, "--backend mirrored --replicas 2")
    ip.user_ns["initial_weights"] = []
    study = ip.run_cell_magic("replicate", f"--scaling 1,2,4 --batch-size 8 {FAST_STUDY}", SCALING_CELL)
    assert isinstance(study, wb.ScalingStudy) and study.mode == "weak"
    table = study.table
    assert list(table["replicas"]) == [1, 2, 4]
    assert list(table["global_batch"]) == [8, 16, 32] and list(table["per_replica_batch"]) == [8, 8, 8]
    assert not table[["examples_per_sec", "speedup", "efficiency"]].isna().any().any()
    assert [set(study.runs[n].history["batch"]) for n in (1, 2, 4)] == [{8.0}] * 3  # per replica
    assert len(ip.user_ns["initial_weights"]) == 3 and len(set(ip.user_ns["initial_weights"])) == 1
    # The session is untouched: `repl` is its replicator again, not the last configuration's.
    assert wb.current() is session_repl and ip.user_ns["repl"] is session_repl


def test_scaling_line_form_strong_mode_splits_the_global_batch(ip):
    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([ctx.global_batch_size, 4])).repeat()

    def step_fn(batch):
        return {"batch": tf.cast(tf.shape(batch)[0], tf.float32)}

    ip.user_ns.update(step_fn=step_fn, input_fn=input_fn)
    study = magic(ip, f"step_fn input_fn --scaling 1,2 --mode strong --batch-size 16 {FAST_STUDY}")
    assert study.mode == "strong"
    assert list(study.table["global_batch"]) == [16, 16]
    assert list(study.table["per_replica_batch"]) == [16, 8]
    assert [set(study.runs[n].history["batch"]) for n in (1, 2)] == [{16.0}, {8.0}]
    assert session.current_or_none() is None  # a study does not choose the session's replicator


def test_scaling_refuses_input_that_ignores_the_batch_size(ip):
    cell = SCALING_CELL.replace(".batch(ctx.global_batch_size)", ".batch(8)")
    ip.user_ns["initial_weights"] = []
    with pytest.raises(
        UsageError,
        match=r"\(2 replica\(s\)\) input_fn must yield batches of 16 \(ctx.global_batch_size\).*Fix",
    ):
        ip.run_cell_magic("replicate", f"--scaling 1,2 --batch-size 8 {FAST_STUDY}", cell)


def test_scaling_line_form_with_a_stateful_step_says_to_use_the_cell_form(ip):
    ip.run_cell_magic("replicate", "--backend mirrored --replicas 2 --steps 1 --no-live", TOY_CELL)
    with pytest.raises(
        UsageError, match=r"variables created under another replicator.*Fix: put %%replicate --scaling 1,2"
    ):
        magic(ip, f"step_fn input_fn --scaling 1,2 --batch-size 16 {FAST_STUDY}")


# ----- %replicate --compare (issue 6) --------------------------------------------------------
def test_compare_cell_form_returns_the_differences_and_shows_the_plot(ip, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    table = ip.run_cell_magic("replicate", "--backend mirrored --replicas 4 --compare --steps 2", TOY_CELL)
    assert table.attrs["replicas"] == 4 and sorted(set(table["step"])) == [1, 2]
    assert set(table["kind"]) == {"output", "variable"}
    assert table["max_abs_diff"].max() < 1e-4  # wrapped SGD: 4 replicas = one device
    assert len(shown) == 1 and isinstance(shown[0], IPython.display.Image)  # the plot
    # The notebook keeps the replicated side's objects; `repl` is the session's replicator.
    assert ip.user_ns["repl"] is wb.current() and wb.current().num_replicas == 4
    assert isinstance(ip.user_ns["w"], tf.distribute.DistributedValues)


def test_compare_line_form_takes_setup_and_input_fn(ip):
    magic(ip, "--backend mirrored --replicas 2")
    ip.run_cell(
        "import keras, tensorflow as tf\n"
        "def setup(repl):\n"
        "    keras.utils.set_random_seed(0)\n"
        "    return keras.layers.BatchNormalization()  # plain BN: per-replica statistics\n"
        "def input_fn(ctx):\n"
        "    x = tf.random.stateless_normal([16, 3], seed=[3, 4]) * tf.range(16.0)[:, None]\n"
        "    return tf.data.Dataset.from_tensors(x).repeat()\n"
    )
    table = magic(ip, "setup input_fn --compare --no-live")
    output = table[table["kind"] == "output"].iloc[0]
    assert output["how"] == "concatenated" and output["max_abs_diff"] > 0.1  # the classic trap
    with pytest.raises(UsageError, match=r"needs setup\(repl\).*received 'step_fn'"):
        magic(ip, "step_fn input_fn --compare")


# ----- mistakes in the study forms -----------------------------------------------------------
@pytest.mark.parametrize(
    "line, message",
    [
        ("--scaling 1,x,4", r"argument --scaling: expected replica counts separated by commas.*'1,x,4'"),
        ("--scaling 0,2", r"argument --scaling: expected positive replica counts.*'0,2'"),
        ("--scaling 1,2 --mode sideways", r"argument --mode: invalid choice: 'sideways'"),
        (
            "--mode strong --warmup 3",
            r"--mode, --warmup only apply to a scaling study.*Fix: add.*--scaling 1,2,4,8",
        ),
        ("--scaling 1,2 --compare", r"two different studies.*Fix"),
        ("--scaling 1,2 --background", r"--background cannot be used with --scaling.*Fix: drop --background"),
        ("--scaling 1,2 --replicas 4", r"--replicas cannot be used with --scaling.*one replicator per count"),
        ("step_fn --scaling 1,2", r"takes two notebook functions, step_fn input_fn; received step_fn.*Fix"),
        ("input_fn step_fn --scaling 1,2", r"look swapped.*Fix: %replicate step_fn input_fn --scaling 1,2"),
        ("step_fn input_fn --scaling 1,2 --steps 0", r"--steps must be at least 1.*Fix: --steps 50"),
        ("step_fn input_fn --scaling 1,16", r"needs 16 devices"),
        ("step_fn input_fn --scaling 1,2 --backend nope", r"Unknown replicator backend 'nope'"),
        ("--compare --background", r"--background cannot be used with --compare.*Fix: drop --background"),
        ("--compare --checkpoint /tmp/x", r"--checkpoint cannot be used with --compare"),
        ("setup input_fn --compare", r"No replicator chosen"),
        (
            "setup input_fn --compare --backend single",
            r"one replica.*Fix: %%replicate --compare --backend mirrored",
        ),
    ],
)
def test_study_mistakes_raise_usage_errors_that_say_the_fix(ip, line, message):
    ip.user_ns.update(step_fn=lambda b: {}, input_fn=lambda c: None, setup=lambda r: None)
    with pytest.raises(UsageError, match=re.compile(message, re.S)):
        magic(ip, line)


def test_study_cell_forms_take_no_function_names(ip):
    with pytest.raises(UsageError, match="takes no function names.*Fix: %%replicate --scaling 1,2,4"):
        ip.run_cell_magic("replicate", "step_fn input_fn --scaling 1,2", TOY_CELL)
    with pytest.raises(UsageError, match="must define step_fn\\(batch\\) and input_fn\\(ctx\\); step_fn"):
        ip.run_cell_magic("replicate", f"--scaling 1,2 {FAST_STUDY}", "def input_fn(ctx): return None")


# ----- re-running a %%replicate cell starts clean (issue 4) ----------------------------------
def cell_run(ip, line, cell_id):
    result = ip.run_cell(f"%%replicate {line}\n{TOY_CELL}", cell_id=cell_id)
    assert result.error_in_exec is None and result.error_before_exec is None
    return result.result


def test_rerunning_a_cell_releases_what_its_previous_run_left_on_the_replicator(ip):
    first = cell_run(ip, "--backend mirrored --replicas 2 --steps 3 --no-live", "cell-a")
    repl = wb.current()
    variables, programs = len(repl._created_variables), len(repl._programs)
    assert variables >= 3 and programs == 1  # w, the optimizer's iterations/lr/slots; one program
    for _ in range(2):
        again = cell_run(ip, "--steps 3 --no-live", "cell-a")
        assert (len(repl._created_variables), len(repl._programs)) == (variables, programs)
    assert again.history["step"].tolist() == [1, 2, 3]  # a fresh program: the data stream restarts
    assert any(v is ip.user_ns["w"] for v in repl._created_variables)  # the current cell's w
    # Another cell keeps its own state beside it.
    cell_run(ip, "--steps 3 --no-live", "cell-b")
    assert len(repl._created_variables) == 2 * variables and len(repl._programs) == 2
    assert first.status == "finished"


def test_rerunning_a_cell_stops_its_background_run(ip):
    running = cell_run(ip, "--backend mirrored --replicas 2 --steps 1000000 --background --no-live", "cell-c")
    deadline = time.time() + 120
    while running.steps < 5 and time.time() < deadline:
        time.sleep(0.05)
    repl = wb.current()
    cell_run(ip, "--steps 2 --no-live", "cell-c")
    assert running.stop_requested  # the re-run asked the old run to stop ...
    running.wait(120)  # (it waits up to 60 s itself; a garbage-collector stall can exceed that)
    assert running.status == "stopped"  # ... and it stopped at a step boundary
    assert len(repl._programs) == 1
