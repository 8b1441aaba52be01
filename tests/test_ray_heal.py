"""The `ray-heal` bar (issue 40): a sync run on a two-node Ray cluster loses a node and finishes on
the one left (`min_workers=1`).

Two network namespaces joined by a veth pair are the two hosts (tests/two_hosts.py, NOTES.md);
`ray start --head` runs in the first, `ray start --address` in the second, and the driver (the
notebook's side) in the first. multi-worker x2 with placement="spread" puts one worker on each
node; at row 120 the second host's link is cut. The run heals: the new pool of two cannot be
placed (the second node is unreachable, the first has room for one), so it goes on with one
worker from its last checkpoint and finishes: 300 rows, steps 1..300 once each, one restart,
the weights of one device on the global batch. Nothing of the run is left on either node. Every
process is ended by the pids of the two namespaces (never `ray stop`).
"""

from __future__ import annotations

import pytest
from two_hosts import ASYNC_PS_NODE_CUT, ray_on_two_hosts, read_until, start_driver

pytest.importorskip("ray", reason='Ray is an optional extra: pip install -e ".[ray,test]"')
pytestmark = pytest.mark.slow

DRIVER = r"""
import json, sys, time
import numpy as np
import workbench as wb

cell, head = sys.argv[1], sys.argv[2]
cluster = wb.RayCluster(address=head, resources_per_worker={"CPU": 1}, placement="spread")
# startup_timeout bounds the wait for a placement the cluster cannot meet (the lost node still
# looks alive to Ray for a while), then the run shrinks.
repl = wb.MultiWorkerReplicator(num_workers=2, min_workers=1, cluster=cluster, startup_timeout=60)
ns_ray, ns_one = {}, {}
run = repl.train_cell(
    cell, ns_ray, steps=300, checkpoint_every=50, max_restarts=1, background=True, steps_per_execution=5
)
while run.steps < 120 and run.running:
    time.sleep(0.01)
print("AT120 " + json.dumps({"rows": run.steps, "processes": run.processes}), flush=True)
sys.stdin.readline()  # the test has cut the link
run.wait(timeout=900)
out = {
    "status": run.status,
    "steps": run.history["step"].tolist(),
    "global_steps": run.history["global_step"].tolist(),
    "restarts": run.restarts,
    "processes": run.processes,
    "said": [e.data["text"] for e in run.events if e.kind == "message"],
}
repl.shutdown()
wb.NonReplicator().train_cell(cell, ns_one, steps=300)
out["max_difference"] = max(
    float(np.max(np.abs(a - b))) for a, b in zip(ns_ray["model"].get_weights(), ns_one["model"].get_weights())
)
print("RESULT " + json.dumps(out, default=str), flush=True)
"""


@pytest.fixture
def two_nodes(tmp_path):
    with ray_on_two_hosts(tmp_path) as (hosts, nodes):
        yield hosts, nodes


def test_a_node_lost_mid_run_heals_on_one_worker_and_finishes_as_one_device(two_nodes, tmp_path):
    hosts, nodes = two_nodes
    driver, log = start_driver(hosts, nodes, tmp_path, DRIVER)

    try:
        at_120 = read_until(driver, tmp_path, "AT120", 600)
        assert sorted(p["node"] for p in at_120["processes"]) == sorted(hosts.addresses), at_120
        hosts.cut()
        driver.stdin.write("cut\n")
        driver.stdin.flush()
        result = read_until(driver, tmp_path, "RESULT", 900)
        print("heals:", result["restarts"])  # (pytest -rP shows it: the heal's seconds)
        assert driver.wait(timeout=120) == 0, (tmp_path / "driver.err").read_text()[-3000:]

        assert result["status"] == "finished", result
        assert result["steps"] == list(range(1, 301)), "not one row per step"  # 300 rows, each once
        assert result["global_steps"] == list(range(1, 301))
        [heal] = result["restarts"]
        assert heal["workers"] == 1 and heal["of_workers"] == 2, heal
        assert heal["step"] in (50, 100) and heal["step"] <= heal["lost_at"], heal
        assert [p["node"] for p in result["processes"]] == [hosts.addresses[0]], result["processes"]
        assert any("continued on 1 of 2 workers" in text for text in result["said"]), result["said"]
        assert result["max_difference"] < 1e-5, result["max_difference"]

        # Nothing of the run is left on either node: the first pool's actors (the far one once its
        # raylet gives up on the head it cannot reach) and the healed pool's (shut down).
        left = hosts.still_running([p["pid"] for p in at_120["processes"] + result["processes"]])
        assert not left, f"actors of the run still alive: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()


def test_an_async_ps_worker_whose_node_is_lost_stays_dropped_and_the_run_goes_on(tmp_path):
    """The node-gone path of an async-ps worker's replacement on Ray (placements/ray/replace.py): a
    new server elsewhere would not be at the address the coordinator's cluster spec holds, so the
    worker is not replaced. The loss is named (worker and node) once Ray declares the node dead,
    the run goes on with the other worker, `workers` drops to 1, nothing is recorded as a heal,
    and a stop afterwards returns at once."""
    with ray_on_two_hosts(tmp_path, cpus=(3, 1)) as (hosts, nodes):
        driver, log = start_driver(hosts, nodes, tmp_path, ASYNC_PS_NODE_CUT)
        try:
            training = read_until(driver, tmp_path, "TRAINING", 600)
            far = [p for p in training["processes"] if p["node"] == hosts.addresses[1]]
            assert [(p["role"], p["index"]) for p in far] == [("worker", 1)], training["processes"]
            hosts.cut()
            driver.stdin.write("cut\n")
            driver.stdin.flush()
            result = read_until(driver, tmp_path, "RESULT", 600)
            print("node lost:", {k: result[k] for k in ("named_s", "resumed_s", "stop_s", "rows_after", "after_s")})
            assert driver.wait(timeout=120) == 0, (tmp_path / "driver.err").read_text()[-3000:]
            # Nothing of the run is left on either node (the far one's once its raylet gives up).
            left = hosts.still_running([p["pid"] for p in training["processes"]])
            assert not left, f"actors of the run still alive: {left}"
        finally:
            if driver.poll() is None:
                driver.kill()
            log.close()

    assert result["status"] == "stopped", result
    lost = [t for t in result["said"] if t.startswith("worker 1 (")]
    assert len(lost) == 1 and f"its node {hosts.addresses[1]} is gone" in lost[0], result["said"]
    assert result["named_s"] < 30, result  # (Ray's health check here: dead after ~5 missed 1-s checks)
    # The other worker went on. (A loaded suite run once recorded 35 rows here; the messages and
    # the seconds from the cut to the stop say whether the run stalled or went slowly.)
    assert result["rows_after"] >= 100, (result["after_s"], result["status"], result["said"])
    # ... at once: the chunks in flight on the lost worker are given up once Ray has said it died,
    # not waited for until worker_timeout (60 s) declares it lost too. (Seconds on a quiet machine,
    # the time of the next 10 rows included: 10.9 s at load 30. Half of worker_timeout still tells
    # the two apart, and a loaded machine does not reach it.)
    assert result["resumed_s"] < 30, result
    workers = result["workers"]
    assert workers[0] == 2 and workers[-1] == 1, workers
    assert result["restarts"] == [], result["restarts"]
    # A stop after the fault waits for no fault's timeout (worker_timeout, 60 s; the hangs this
    # guards against lasted 120-400 s). Measured: 2.7-3.7 s on a quiet machine and 6-8 s at load
    # 5-24 (bench_ray_cut.py, which keeps the 10 s), 10.2 s in a loaded suite run. Half of
    # worker_timeout, as above, tells a stop from a wait for the lost worker on a busy machine.
    assert result["stop_s"] < 30, result
    assert not any("could not take" in t for t in result["said"]), result["said"]  # (no new server tried)
