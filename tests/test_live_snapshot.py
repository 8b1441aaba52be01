"""One snapshot of a run for every live view (workbench/_src/core/live.py): the incremental
figures equal run_stats.figures at every refresh; the Run hands each snapshot to its sinks in
the metrics event that made it, at most every REFRESH_SECONDS, and ends with the whole run's."""

from __future__ import annotations

import math
import random

import pytest

from workbench._src.core import live
from workbench._src.core.run import Run
from workbench._src.core.run_stats import figures


def _rows(n: int, start: int = 0, untimed: int = 0, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows, t = [], 0.0
    for i in range(start, start + n):
        t += rng.uniform(0.001, 0.02) * (20 if i % 97 == 0 else 1)  # chunks with gaps between
        rate = math.nan if i < untimed else rng.uniform(100, 5000)
        rows.append(
            {"step": i + 1, "wall_time": t, "examples_per_sec": rate, "examples": 32.0, "loss": 1 / (i + 1)}
        )
    return rows


@pytest.mark.parametrize("untimed", [0, 1, 7])
def test_live_figures_equal_run_stats_figures_at_every_refresh(untimed):
    rows = _rows(3000, untimed=untimed)
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    keeper = live.LiveFigures()
    done = 0
    for size in (1, 3, 50, 200, 7, 900, 839, 1000):
        keeper.add(rows[done : done + size])
        done += size
        part = {k: v[:done] for k, v in columns.items()}
        assert keeper.figures(5000) == figures(part, running=True, target_steps=5000), done
    assert keeper.last_metrics == {"loss": rows[-1]["loss"]}


def test_a_run_hands_one_snapshot_to_every_sink_and_ends_with_the_whole_runs(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(live.time, "monotonic", lambda: clock[0])
    run = Run({"backend": "single", "steps": 300})
    seen = []
    run.subscribe(lambda e: seen.append(e))
    run._start()
    rows = _rows(300)
    for i in range(0, 300, 10):  # a chunk every 0.2 s: a snapshot every 0.6 s (>= 0.5 s)
        clock[0] += 0.2
        run.record_rows([dict(r) for r in rows[i : i + 10]])
    snaps = [e.data["snapshot"] for e in seen if e.kind == "metrics" and "snapshot" in e.data]
    assert [s["seq"] for s in snaps] == list(range(1, len(snaps) + 1)) and 9 <= len(snaps) <= 11
    # The one kept on the run is the last handed out, at most one refresh (here 2 chunks) behind.
    assert snaps[-1] is run.snapshot and 0 <= run.steps - run.snapshot["steps"] <= 20
    run._end("finished")
    final = seen[-1].data["snapshot"]
    assert final is run.snapshot and final["final"] and final["steps"] == 300
    whole = figures(run.history, running=False, target_steps=300)
    assert {k: final[k] for k in whole} == whole  # what run.summary() says
    assert final["metrics"] == {"loss": rows[-1]["loss"]}


def test_a_rewound_run_has_a_snapshot_of_what_is_left_at_once():
    """A heal rewinds the history to its checkpoint (launch/heal.py): the snapshot follows at once
    (the "restart" event carries it), with the figures of the rows kept."""
    run = Run({"backend": "multi-worker", "steps": 3000})
    run._start()
    run.record_rows(_rows(2000))
    before = run.snapshot["seq"]
    run._rewind(1200)
    snap = run.snapshot
    assert snap["seq"] == before + 1 and snap["steps"] == 1200
    assert {k: snap[k] for k in figures({})} == figures(run.history, running=True, target_steps=3000)


def test_a_heal_rewinds_by_global_step_and_numbers_each_attempts_rows_from_the_runs_first():
    """launch/heal.py: what a rewind keeps, and a relayed row's step, follow the rows' global
    steps, not their count: a run that began at global step 40 (a second run of a model) whose
    rows of global steps 61-65 never came (a relay lost them), rewound to its checkpoint at
    global 75. A count would keep 35 rows, global 76-80 among them, and the next attempt's rows
    would repeat them."""
    from workbench._src.launch.heal import Healing

    def row(g):
        return {"step": g - 40, "global_step": g, "wall_time": g / 10, "examples_per_sec": 1.0, "loss": 1.0}

    run = Run({"backend": "multi-worker", "steps": 100})
    run._start()
    healing = Healing(run, type("Opts", (), {"max_restarts": 1})(), {})
    healing.first_global = 40  # (from the first attempt's "started": first_step 41)
    run.record_rows([healing.step_of(row(g)) for g in [*range(41, 61), *range(66, 81)]])
    assert run._rewind(75) == 30
    assert run.history["global_step"].tolist() == [*range(41, 61), *range(66, 76)]
    # The next attempt resumed at global 75: its own steps 1, 2, ... are the run's 36, 37, ...
    resumed = [{**row(g), "step": g - 75} for g in (76, 77)]
    run.record_rows([healing.step_of(r) for r in resumed])
    assert run.history["step"].tolist()[-3:] == [35, 36, 37]
    assert run._rewind(None) == 0  # no checkpoint: the run starts anew, nothing kept
    healing.close()


def test_doing_now_says_what_a_run_does_before_step_one_then_gives_way_to_the_steps():
    assert live.doing_now(None, None, "running") == live.COMPILING
    starting = "starting 2 multi-worker processes (each imports TensorFlow, then they form the cluster)"
    assert live.doing_now(starting, {"steps": 0}, "running") == starting
    ready = "multi-worker processes ready in 4.2 s (import 2.0 s, cluster 1.1 s)"
    assert live.doing_now(ready, {"steps": 0}, "running") == f"{ready}; {live.COMPILING}"
    assert (
        live.doing_now("worker 1 lost", {"steps": 40}, "running") == "worker 1 lost"
    )  # (said under the numbers)
    assert live.doing_now(None, {"steps": 40}, "running") is None


@pytest.mark.slow
def test_the_cell_and_the_sidebar_say_what_a_process_run_does_before_step_one():
    """A multi-worker run (two worker processes) with the live dashboard and the sidebar's
    watcher: before step 1 both say what it is doing (starting the processes, then compiling),
    the same line; the steps replace it. Both read the run's events, as in a kernel."""
    import time

    import workbench as wb
    from workbench._src.notebook.labcomm import _RunWatcher
    from workbench._src.sinks import register_default, unregister_default
    from workbench._src.sinks.dashboard import Dashboard

    def input_fn(ctx):
        import tensorflow as tf

        return tf.data.Dataset.from_tensors(tf.ones([4, 2])).repeat()

    def step_fn(x):
        import tensorflow as tf

        return {"loss": tf.reduce_mean(x)}

    dash = Dashboard(frontend="widgets", display=False, render_budget=1.0)
    repl = wb.replicator("multi-worker", num_workers=2, pool=False)
    seen: list[tuple[str, str | None]] = []
    watchers: list[_RunWatcher] = []

    def watcher(run):  # the sidebar's own factory, as %load_ext registers it (labcomm._watch)
        watchers.append(_RunWatcher(run))
        return watchers[-1]

    register_default(watcher)
    try:
        run = repl.train(step_fn, input_fn, steps=200, background=True, sinks=[dash], name="doing")
    finally:
        unregister_default(watcher)
    try:
        deadline = time.monotonic() + 180
        while run.steps == 0 and time.monotonic() < deadline and not run.ended:
            seen.append((dash._header.value, watchers[0].info()["doing"]))
            time.sleep(0.05)
        run.wait(180)
    finally:
        run.stop()
    headers = " | ".join(dict.fromkeys(h for h, _ in seen))
    cards = list(dict.fromkeys(c for _, c in seen if c))
    assert "starting 2 multi-worker processes" in headers, headers
    assert any("starting 2 multi-worker processes" in c for c in cards), cards
    assert any(live.COMPILING in c for c in cards) or live.COMPILING in headers, (headers, cards)
    assert watchers[0].info()["doing"] is None and run.status == "finished"
