"""Loose ends a researcher trips on (issue 41), each as it happens in the notebook: the panel's
line pastes, a background run's repr follows the run, "#best" finds the runs tagged best, the
delete request names the runs, one median everywhere."""

import itertools

import pytest
from IPython.core import magic_arguments
from notebook_toy import TOY_CELL, ipython_shell, isolated_notebook_state

from workbench._src.core import registry
from workbench._src.notebook.magics import ReplicateMagics, strip_comment
from workbench._src.notebook.panel import equivalent_magic


@pytest.fixture
def ip(tmp_path):
    shell = ipython_shell()
    with isolated_notebook_state(tmp_path / "runs"):
        for name in ("step_fn", "input_fn", "repl"):
            shell.user_ns.pop(name, None)
        yield shell


def _panel_choices():
    """Every choice the panel's widgets offer (its counts' bounds, its cluster options)."""
    for name, spec in registry.BACKENDS.items():
        if spec.unavailable_reason():
            continue  # (its button is disabled)
        for replicas, workers, ps, cluster in itertools.product(
            (1, 2, 8), (1, 2, 256), (1, 64), ("", "ray", "ray=local", "ray=10.0.0.1:6379")
        ):
            yield name, replicas, workers, ps, cluster


def test_every_line_the_panel_offers_goes_through_the_magics_parser_and_checks():
    lines = {equivalent_magic(*choice, steps=300) for choice in _panel_choices()}
    assert len(lines) > 20
    for line in lines:
        magic, rest = line.split(" ", 1)
        args = magic_arguments.parse_argstring(ReplicateMagics.replicate, strip_comment(rest))
        spec = registry.spec(args.backend)
        registry.check_counts(spec, args.replicas, args.workers, args.ps)
        registry.check_cluster(spec, args.cluster)
        assert args.steps == 300 and args.background, line
        if spec.in_processes:  # the model is built in each process: the cell that builds it
            assert magic == "%%replicate" and not args.functions, line
        else:  # the notebook's functions, trained as Run trains them
            assert magic == "%replicate" and args.functions == ["step_fn", "input_fn"], line


@pytest.mark.parametrize("backend, replicas", [("single", 1), ("mirrored", 2)])
def test_the_panels_line_pasted_into_a_cell_trains(ip, backend, replicas):
    # The researcher's model, built (and tried for a step) by a %%replicate cell on this choice.
    counts = f" --replicas {replicas}" if replicas > 1 else ""
    ip.run_cell_magic("replicate", f"--backend {backend}{counts} --steps 1 --no-live", TOY_CELL)
    line = equivalent_magic(backend, replicas, 2, 1, steps=20)
    run = ip.run_line_magic("replicate", line.split(" ", 1)[1] + " --no-live")
    run.wait(120)
    assert run.status == "finished" and run.steps == 20


def test_a_background_runs_output_becomes_its_summary_when_it_ends(ip):
    from IPython.utils.capture import capture_output

    ip.run_cell_magic("replicate", "--backend single --steps 1 --no-live", TOY_CELL)
    with capture_output() as shown:
        result = ip.run_cell("%replicate step_fn input_fn --steps 200 --background --no-live")
        run = result.result
        run.wait(120)
    first, *updates = [o for o in shown.outputs if "wb.Run" in o.data.get("text/html", "")]
    assert "training in the background" in first.data["text/html"]
    assert updates and "training in the background" not in updates[-1].data["text/html"]
    assert "finished" in updates[-1].data["text/html"] and "200" in updates[-1].data["text/html"]
    # An ended run (and a foreground one) is a plain result, drawn from its _repr_html_.
    assert not hasattr(run, "_ipython_display_") and "finished" in run._repr_html_()


def test_a_failed_background_runs_output_says_why(ip):
    from IPython.utils.capture import capture_output

    ip.run_cell_magic("replicate", "--backend single --steps 1 --no-live", TOY_CELL)
    ip.run_cell("def broken(x, y):\n    return {'loss': learning_rat * 2.0}")
    with capture_output() as shown:
        run = ip.run_cell("%replicate broken input_fn --steps 20 --background --no-live").result
        with pytest.raises(NameError):
            run.wait(120)
    last = [o for o in shown.outputs if "wb.Run" in o.data.get("text/html", "")][-1].data["text/html"]
    assert "failed" in last and "learning_rat" in last and "training in the background" not in last


def test_one_median_in_the_study_table_the_sidebar_the_run_store_and_the_figure(tmp_path):
    import tensorflow as tf

    import workbench as wb
    from workbench._src.core.run_stats import median_rate
    from workbench._src.notebook import labcomm

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([ctx.global_batch_size, 8])).repeat()

    with isolated_notebook_state(tmp_path / "runs"):
        watchers = {}
        study = wb.scaling_study(
            lambda x: {"s": tf.reduce_sum(x)}, input_fn, replicas=[1, 2], steps=40, warmup=2,
            steps_per_execution=1, batch_size=16, live=False,
        )  # fmt: skip
        table = study.table.set_index("replicas")
        stored = wb.compare_runs([run.id for run in study.runs.values()]).table.set_index("id")
        for n, run in study.runs.items():
            watchers[n] = labcomm._RunWatcher(run)
            run.subscribe(watchers[n])  # the sidebar's card, from the run's events
            card = watchers[n].info()["median_examples_per_sec"]
            exact = median_rate(run.history["examples_per_sec"])
            assert len(run.history) % 2 == 0  # (an even count: the two middle steps' mean)
            assert table.loc[n, "median_step_examples_per_sec"] == pytest.approx(exact, rel=1e-9)
            assert table.loc[n, "step_time_median_s"] == pytest.approx(16 * n / exact, rel=1e-9)
            for shown in (
                card,
                stored.loc[run.id, "median_examples_per_sec"],
                run.summary()["median_examples_per_sec"],
            ):
                assert shown == pytest.approx(exact, rel=5e-4)  # (4 significant digits shown)


@pytest.mark.slow
def test_the_panel_says_a_pools_state_when_it_changes_as_the_sidebar_is_told():
    """The panel said a pool was idle while the sidebar said busy: it read the pools only when
    it ran something. Now the pools' observer refreshes it, from the same pool.describe()."""
    from helpers import regression_setup, wait_for

    import workbench as wb
    from workbench._src.launch import pool as pools
    from workbench._src.notebook.panel import Panel

    panel = Panel(namespace={})
    try:
        run = wb.MultiWorkerReplicator(num_workers=1).train(
            setup=regression_setup, steps=3000, background=True
        )
        wait_for(lambda: ", busy (run" in panel.pool_text, 180, "the panel to say the pool is busy")
        assert [p.describe()["state"] for p in pools.live_pools()] == ["busy"]
        run.wait(240)  # (busy from its checkout, the processes' start included, to its end)
        wait_for(lambda: "idle since" in panel.pool_text, 60, "the panel to say the pool is idle")
        assert [p.describe()["state"] for p in pools.live_pools()] == ["idle"]
    finally:
        pools.shutdown(reason="the test ended")
        panel.close()
    assert panel.pool_text == ""
