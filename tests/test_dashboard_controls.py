"""The live dashboard's reading controls (issue 23): TensorBoard's smoothing slider and a y-scale
toggle above the figure, driven here through the real widgets."""

import itertools
import math
import threading
import time

import numpy as np
import pytest
from IPython.utils.capture import capture_output
from notebook_toy import ipython_shell

from workbench._src.core.run import Event
from workbench._src.plots import run_plot
from workbench._src.sinks import dashboard as dashboard_module
from workbench._src.sinks.dashboard import Dashboard

_run_numbers = itertools.count(901)  # a run id per run: final figures are cached by run id


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    """Each test starts from the kernel's default choice, and leaves it as it found it."""
    monkeypatch.setattr(dashboard_module, "_choice", {"smoothing": None, "scale": "auto"})


def start(dash, losses):
    """Sends 'started' and one chunk of metrics, as the run loop would; returns the run id."""
    run_id = f"20260101-000000-{next(_run_numbers)}"
    config = {"backend": "mirrored", "num_replicas": 2, "steps": len(losses)}
    dash.send(Event("started", run_id, time.time(), 0, {"config": config, "first_step": 1}))
    rows = [
        {"step": s, "wall_time": s * 0.01, "examples_per_sec": 12800.0 + s % 7, "loss": loss}
        for s, loss in enumerate(losses, 1)
    ]
    dash.send(Event("metrics", run_id, time.time(), len(losses), {"rows": rows}))
    return run_id


def end(dash, run_id):
    dash.send(Event("ended", run_id, time.time(), 0, {"status": "finished", "reason": None}))
    assert dash.error is None


def run(dash, losses):
    end(dash, start(dash, losses))


def loss_panel():
    """The loss panel of the figure last drawn (every dashboard draws on the shared one)."""
    ax, raw, smooth, _ = run_plot._shared._lines["loss"]
    return ax, np.asarray(raw.get_ydata(), float), np.asarray(smooth.get_ydata(), float)


def tensorboard_ema(values, weight):
    """TensorBoard's smoothing as its scalar dashboard writes it (independent of run_plot)."""
    last, count, out = 0.0, 0, []
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1 - weight) * v
        count += 1
        out.append(last / (1 - weight**count))
    return np.array(out)


DECADES = [10 / s for s in range(1, 301)]  # 10 -> 0.033: spans more than 100x, "auto" is log


def changed(dash, control, value):
    """Sets a control as the frontend would, and waits for the renderer to draw the change."""
    drawn = dash.renders
    control.value = value
    deadline = time.monotonic() + 10
    while dash.renders == drawn and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dash.renders > drawn, f"{value!r} was not drawn"
    return loss_panel()


def test_controls_redraw_the_live_figure_from_the_history_held():
    dash = Dashboard(frontend="widgets", display=False)
    run_id = start(dash, DECADES)
    deadline = time.monotonic() + 10
    while dash.renders < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dash._controls.layout.display == ""  # shown with the figure
    assert dash._smoothing_slider.value == "auto" and dash._scale_buttons.value == "auto"
    default_png = dash.png
    ax, raw, default_line = loss_panel()
    assert ax.get_yscale() == "log" and ax.get_title() == "loss (log scale)"
    np.testing.assert_allclose(default_line, run_plot._smooth(raw))  # today's line, unchanged

    ax, raw, line = changed(dash, dash._smoothing_slider, 0.9)  # dragging the slider to 0.90
    np.testing.assert_allclose(line, tensorboard_ema(DECADES, 0.9))
    assert not np.allclose(line, default_line)
    assert dash.smoothing == 0.9 and dash._image.value == dash.png != default_png

    line = changed(dash, dash._smoothing_slider, 0.0)[2]  # no smoothing: the raw values
    np.testing.assert_allclose(line, DECADES)

    ax = changed(dash, dash._scale_buttons, "linear")[0]  # linear although the loss spans decades
    assert ax.get_yscale() == "linear" and ax.get_title() == "loss"
    assert run_plot._shared._lines["examples/s"][0].get_yscale() == "linear"

    changed(dash, dash._scale_buttons, "auto")
    changed(dash, dash._smoothing_slider, "auto")
    assert dash.png == default_png and dash._image.value == default_png
    end(dash, run_id)


def test_log_scale_leaves_out_a_zero_loss_and_never_raises():
    losses = [1.0 - s / 400 for s in range(1, 101)]  # within 100x: "auto" draws it linear
    losses[49] = 0.0  # a perfect fit at step 50
    dash = Dashboard(frontend="widgets", display=False)
    run_id = start(dash, losses)
    deadline = time.monotonic() + 10
    while dash.renders < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loss_panel()[0].get_yscale() == "linear"

    ax, raw, line = changed(dash, dash._scale_buttons, "log")
    end(dash, run_id)
    assert ax.get_yscale() == "log" and "values <= 0 not drawn" in ax.get_title()
    assert math.isnan(raw[49]) and np.isfinite(np.delete(raw, 49)).all()
    assert dash.error is None and dash.png.startswith(b"\x89PNG")

    zeros = Dashboard(frontend="widgets", display=False)  # starts on log: the choice carried
    run(zeros, [0.0] * 50)  # nothing to draw on a log scale: an empty panel, no error
    assert loss_panel()[0].get_yscale() == "log" and zeros.error is None and zeros.png


def test_the_next_runs_dashboard_starts_with_the_last_choice():
    first = Dashboard(frontend="widgets", display=False)
    run(first, DECADES)
    first._smoothing_slider.value = 0.6
    first._scale_buttons.value = "linear"

    second = Dashboard(frontend="widgets", display=False)
    assert second._smoothing_slider.value == 0.6 and second._scale_buttons.value == "linear"
    assert (second.smoothing, second.scale) == (0.6, "linear")
    run(second, DECADES)
    ax, _, line = loss_panel()
    assert ax.get_yscale() == "linear"  # not the automatic log
    np.testing.assert_allclose(line, tensorboard_ema(DECADES, 0.6))


def test_a_change_during_the_run_is_drawn_by_the_renderer_thread_at_once():
    # A budget this small spaces drawings by ~1000x their cost: only the control's request can
    # bring the next one forward.
    dash = Dashboard(frontend="widgets", display=False, render_budget=0.001)
    run_id = start(dash, DECADES)
    deadline = time.monotonic() + 10
    # (a drawing that builds the figure is not what the budget spaces by: a second one may come)
    while not (dash.renders and dash._next_plot - time.monotonic() > 5) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dash._next_plot - time.monotonic() > 5  # the budget holds the next drawing back
    assert loss_panel()[0].get_yscale() == "log"
    drawn = dash.renders

    dash._scale_buttons.value = "linear"  # from this thread, as the kernel's comm handler would
    deadline = time.monotonic() + 5
    while dash.renders == drawn and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dash.renders == drawn + 1, "the change was not drawn at once"
    assert loss_panel()[0].get_yscale() == "linear"
    assert dash.render_threads == {"workbench figure"}  # drawn by the figure thread, not raced
    assert threading.current_thread().name not in dash.render_threads
    end(dash, run_id)
    assert loss_panel()[0].get_yscale() == "linear"  # the final figure keeps the choice


def test_the_final_output_is_a_plain_png_and_a_later_change_only_carries_over():
    ipython_shell()
    with capture_output() as cap:
        dash = Dashboard(frontend="widgets", display=True)
        run(dash, DECADES)
        final_png = dash.png
        shown = len(cap.outputs)
        dash._smoothing_slider.value = 0.95
    # No widget view in the saved output: it would show "model not found" once the kernel is gone.
    assert set(cap.outputs[-1].data) == {"image/png", "text/plain"}
    assert len(cap.outputs) == shown and dash.png == final_png  # nothing redrawn, nothing added
    assert dashboard_module._choice["smoothing"] == 0.95  # the next run starts with it


def test_a_script_gets_no_controls(capsys):
    dash = Dashboard(frontend="console")
    assert dash.widget is None and not hasattr(dash, "_controls")
    assert capsys.readouterr() == ("", "")  # nothing printed before the run


def test_smooth_keeps_its_default_and_takes_a_weight():
    y = np.linspace(3.0, 1.0, 200) + np.sin(np.arange(200))
    np.testing.assert_array_equal(run_plot._smooth(y), run_plot._smooth(y, None))
    np.testing.assert_array_equal(run_plot._smooth(y, 0.0), y)
    with_nan = np.array([1.0, math.nan, 3.0, 5.0])
    np.testing.assert_allclose(run_plot._smooth(with_nan, 0.5), tensorboard_ema(with_nan, 0.5))
    with pytest.raises(ValueError, match="smoothing weight must be in"):
        run_plot._smooth(y, 1.0)
    with pytest.raises(ValueError, match="scale must be one of"):
        run_plot.Plotter().render({"step": [1, 2], "loss": [1.0, 2.0]}, "t", scale="symlog")
