"""One truth on screen: the run's figures are defined and formatted once (workbench/_src/core/run_stats.py)."""

import math

import pytest
from helpers import GLOBAL_BATCH, regression_setup

from workbench._src.core.run_stats import figures, fmt, fmt_duration, shown_reason


def loop_rows(chunks, per_step=0.001, gap=0.0005, batch=128, compile_seconds=2.0, first_step=1):
    """Rows as the run loop writes them: a chunk's steps evenly spaced over its time; the first
    chunk compiles (untimed: NaN examples/s)."""
    rows, t = [], 0.0
    for c, k in enumerate(chunks):
        compiling = c == 0
        step_time = compile_seconds / k if compiling else per_step
        start = t if compiling else t + gap
        for i in range(k):
            rows.append(
                {
                    "step": first_step + len(rows),
                    "wall_time": start + step_time * (i + 1),
                    "examples_per_sec": math.nan if compiling else batch / per_step,
                }
            )
        t = rows[-1]["wall_time"]
    return {k: [r[k] for r in rows] for k in rows[0]}


def test_whole_run_rates_are_wall_clock_and_examples_are_steps_times_the_batch():
    cols = loop_rows([10] + [20] * 9)
    fig = figures(cols)
    seconds = cols["wall_time"][-1] - cols["wall_time"][9]
    assert fig["steps"] == 190 and fig["steps_per_sec"] == pytest.approx(180 / seconds, rel=1e-3)
    assert fig["examples_per_sec"] == pytest.approx(fig["steps_per_sec"] * 128, rel=1e-3)
    assert fig["median_examples_per_sec"] == 128000  # the compiled calls alone, labelled "median"
    assert fig["eta_seconds"] is None  # ended


def test_running_rates_are_over_the_last_window_and_eta_from_them():
    cols = loop_rows([10] + [1000] * 30, per_step=0.001)  # ~30 s of training after compiling
    fig = figures(cols, running=True, target_steps=40_000)
    assert fig["steps_per_sec"] == pytest.approx(1000 / 1.0005, rel=1e-3)
    assert fig["eta_seconds"] == pytest.approx((40_000 - 30_010) / fig["steps_per_sec"], rel=1e-2)
    # Before the first timed chunk: no rate and no ETA (no absurd first ETA from compiling).
    early = figures(loop_rows([10]), running=True, target_steps=40_000)
    assert early["steps_per_sec"] is None and early["eta_seconds"] is None and early["steps"] == 10


def test_a_later_run_counts_its_own_steps():
    cols = loop_rows([20] * 5, first_step=20016)
    assert figures(cols)["steps"] == 100


@pytest.mark.parametrize(
    "value, text",
    [
        (1234.5, "1,235"),
        (100_000_000, "100,000,000"),
        (12.25, "12.3"),  # a tie rounds up, as JavaScript's toFixed does
        (12.345, "12.3"),
        (0.5, "0.5"),
        (0.01234, "0.012"),
        (0.000123, "0.000123"),
        (0, "0"),
        (None, "\u2013"),
        (math.nan, "\u2013"),
    ],
)
def test_fmt_is_the_sidebars_formatNumber(value, text):
    # The same cases as extensions/replicator-workbench/test/model.test.ts.
    assert fmt(value) == text


def test_durations_and_reasons():
    assert [fmt_duration(s) for s in (42.4, 185, 7800, None)] == ["42 s", "3 min 5 s", "2 h 10 min", "\u2013"]
    assert shown_reason("stopped", "stopped at step 8337") is None
    assert shown_reason("stopped", "interrupted at step 12") == "interrupted"
    assert shown_reason("finished", "input exhausted after step 7") == "input exhausted after step 7"


# ----- one truth on every backend (issue 23): real runs --------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["multi-worker", "async-ps"])
def test_examples_per_step_is_the_global_batch_on_process_backends(backend, no_orphans):
    """examples/s / steps/s = the global batch within 1%, over the same window: async-ps used to
    report 240 steps/s beside 10,436 examples/s at 64 examples a step."""
    import workbench as wb

    repl = wb.replicator(backend, num_workers=2)
    run = repl.train(setup=regression_setup, steps=600)
    s = run.summary()
    assert s["examples_per_sec"] / s["steps_per_sec"] == pytest.approx(GLOBAL_BATCH, rel=0.01), s
    assert run.config["global_batch"] == GLOBAL_BATCH
    assert run.history["step"].tolist() == list(range(1, 601))


def test_scaling_study_table_shows_each_configurations_run_figures(tmp_path):
    """A study's table (and so its plot) shows the run's own examples/s, the one the sidebar and
    the run store show; the median step's figure keeps its own, labelled column."""
    import tensorflow as tf

    import workbench as wb

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([ctx.global_batch_size, 8])).repeat()

    study = wb.scaling_study(
        lambda x: {"s": tf.reduce_sum(x)},
        input_fn,
        replicas=[1, 2],
        steps=60,
        warmup=2,
        batch_size=16,
        live=False,
    )
    table = study.table.set_index("replicas")
    for n, run in study.runs.items():
        s = run.summary()
        assert table.loc[n, "examples_per_sec"] == s["examples_per_sec"]
        assert s["examples_per_sec"] / s["steps_per_sec"] == pytest.approx(16 * n, rel=0.01)
        assert "median_step_examples_per_sec" in table and run.name.startswith(
            f"scaling weak n={n} \u00b7 mirrored \u00b7 "
        )


def test_log_scale_loss_plot_survives_exact_zeros_and_follows_a_dark_theme(monkeypatch):
    """A loss spanning decades that hits exactly 0 stays on a log scale (zeros left out, said in
    the title); WORKBENCH_THEME=dark (or the sidebar's theme message) draws a dark figure."""
    import io

    import numpy as np
    from PIL import Image

    from workbench._src.plots import run_plot

    n = 200
    loss = list(np.logspace(2, -3, n))
    loss[-5:] = [0.0] * 5
    columns = {
        "step": list(range(1, n + 1)),
        "wall_time": [0.01 * i for i in range(1, n + 1)],
        "examples_per_sec": [1000.0] * n,
        "examples": [16.0] * n,
        "loss": loss,
    }
    plotter = run_plot.Plotter()
    light = plotter.render(columns, "zeros")
    ax = plotter._lines["loss"][0]
    assert ax.get_yscale() == "log" and "values <= 0 not drawn" in ax.get_title()

    def brightness(png):
        return float(np.asarray(Image.open(io.BytesIO(png)).convert("L")).mean())

    monkeypatch.setenv("WORKBENCH_THEME", "dark")
    dark = plotter.render(columns, "zeros")
    assert brightness(light) > 200 and brightness(dark) < 60, (brightness(light), brightness(dark))


@pytest.mark.parametrize("repeat", [1, 2, 3])
def test_the_figures_title_fits_its_width_and_names_the_backend_once(repeat):
    """A suptitle wider than the figure was cut at both ends (issue 41): it shrinks to fit, then
    goes on two lines; a default name says the backend, so the title does not again."""
    from workbench._src.plots import run_plot

    config = {"backend": "multi-worker", "num_replicas": 2, "num_workers": 2}
    name = " \u00b7 ".join(["multi-worker x2 \u00b7 nb01 \u00b7 01:18"] * repeat)
    columns = {"step": [1, 2, 3], "wall_time": [0.1, 0.2, 0.3], "examples_per_sec": [math.nan, 640.0, 640.0]}
    columns["loss"] = [1.0, 0.5, 0.25]
    title = run_plot.title_for(config, "finished", columns, name, 3)
    assert title.count("multi-worker") == repeat and "\u00b7 finished \u00b7 step 3/3 \u00b7" in title
    assert run_plot.title_for(config, "finished", columns, "bg", 3).startswith(
        "bg \u00b7 multi-worker x2 \u00b7"
    )
    run_plot.render(columns, title)
    plotter = run_plot._shared
    extent = plotter._title.get_window_extent(plotter._figure.canvas.get_renderer())
    assert extent.x0 >= 0 and extent.x1 <= plotter._figure.bbox.width, (extent, title)
